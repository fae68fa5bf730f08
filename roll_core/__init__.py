"""The ground floor of roll-pipeline: what every layer above builds on and that imports none of them.

config/ (the schema and the strict loader; no torch, no Ray), batch.py, registry.py, algorithms/ (the RL math as
pure functions behind registries), rewards/ (the reward contract: scorer base classes, ScoredSample), tracking/
(MLflow), data/ (loading prompt data), models/ (forward passes, the sampling distribution, the embedded and
pretrained models' catalogs), console.py, lean_imports.py (installed here: three imports of transformers and
DeepSpeed that the project never uses, skipped). The layer map: pyproject.toml, [tool.importlinter].
"""

from roll_core import lean_imports

lean_imports.install()
