"""Environments of multi-turn rollouts: the built-in python tool (the code sandbox) and the registry plugins join."""
