"""`roll config import`: a ROLL RLVR YAML (Hydra) to this project's config, with a report of what was mapped, what
changed meaning (and the exact substitution), and what is not supported. convert.py is the entry point; each
*_keys.py module handles one part of ROLL's config."""
