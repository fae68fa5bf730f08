"""Where the examples expect the embedded and pretrained models and their data, relative to the repository root
(where `roll` commands are run): the catalogs (embedded.py, pretrained.py) and the builders share them."""

from __future__ import annotations

from pathlib import Path

#: Where the examples expect the models, relative to the repository root (where `roll` commands are run).
MODELS_DIR = Path("examples/models")
DATA_DIR = Path("examples/data")
#: Finished builds kept with the project (`EmbeddedModel.shipped`), one folder per model.
SHIPPED_DIR = Path("examples/shipped-models")
