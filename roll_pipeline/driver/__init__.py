"""The driver: what runs a pipeline on top of everything else (config names checked against the registries, and,
as the driver moves here from roll_pipeline/, the pipeline step, the runtime and the commands).

Layers, each importing only the ones below it:

1. the core: roll_pipeline/{config, batch, registry, algorithms, tracking, data/loading, console,
   models/forward}: no workers, no schedulers, and the config without torch or Ray;
2. workers/ and schedulers/;
3. the driver: this package, and the modules of roll_pipeline/ that start or command a run.

tests/test_layers.py holds each layer to that.
"""
