
import roll_core  # noqa: F401 (installs roll_core/lean_imports.py before anything of this package imports transformers)
