"""The top floor of roll-pipeline: the pipeline (driver/pipeline.py: RLVRPipeline), the `roll` command
(driver/cli.py), `roll serve` (serve/), Ray clusters (distributed/), the builders of the embedded models (models/)
and of the example data (data/), and api.py, the names code outside the project builds on. The layer map:
pyproject.toml, [tool.importlinter]."""

import roll_core  # noqa: F401 (installs roll_core/lean_imports.py before anything of this package imports transformers)
