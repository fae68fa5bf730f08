"""The reward contract: a domain's pure scorer (scorer.py) and one judged response (scored.py). The worker that
runs scorers, the built-in ones and their registry are in workers/rewards/; a plugin imports these through
roll_pipeline.api."""
