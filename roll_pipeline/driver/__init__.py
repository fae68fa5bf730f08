"""The driver: what runs a pipeline, on top of everything else: the pipeline (pipeline.py), checkpoints
(checkpoint.py), the checks before a run (preflight.py, names.py), validation metrics and reports
(validation.py, report.py), and the `roll` command (cli.py, reward_commands.py, tracking_commands.py).

roll_pipeline/ is the top floor of the project's layers (the map: pyproject.toml, [tool.importlinter]).
"""
