"""MLflow tracking for a run: params, the resolved config as an artifact, and one batched call per step."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from roll_pipeline.config import TrackingConfig

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
_MAX_PARAM_LEN = 6000
_PARAMS_PER_CALL = 100


def tracking_uri(cfg: TrackingConfig) -> str:
    """Config first, then MLFLOW_TRACKING_URI, then a sqlite file in the working directory."""
    return cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out |= flatten(v, key)
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


class MlflowTracker:
    def __init__(self, cfg: TrackingConfig) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri)
        mlflow.set_tracking_uri(self.uri)
        experiment = self.client.get_experiment_by_name(cfg.experiment_name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment_name)
        )
        self.run = self.client.create_run(experiment_id, run_name=cfg.run_name)
        self.run_id = self.run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=items[i : i + _PARAMS_PER_CALL])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """All of a step's metrics in one request; NaN values (nothing to measure) are left out."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if not math.isnan(float(v))]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        self.client.log_dict(self.run_id, dict(data), artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
