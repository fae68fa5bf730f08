"""The driver: what runs a pipeline, on top of everything else: the pipeline (pipeline.py), checkpoints
(checkpoint.py), the checks before a run (preflight.py, names.py), validation metrics and reports
(validation.py, report.py), and the `roll` command (cli.py, reward_commands.py, tracking_commands.py).

Layers, each importing only the ones below it:

1. the core: roll_pipeline/{config, batch, registry, algorithms, tracking, data/loading, console,
   models/forward, models/embedded}: no workers, no schedulers, and the config without torch or Ray;
2. workers/ (with workers/inference, shared by actor_infer, `roll serve` and the local judge) and schedulers/;
3. the driver: this package, and roll_pipeline/{serve, models (the builders), distributed, data/synthetic.py}.

tests/test_layers.py holds each layer to that.
"""
