"""The `tracking` section: the MLflow experiment and server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    tracking_uri: str | None = None
    """MLflow tracking URI: a server URL (http://...), `sqlite:///path.db` or a file store (`file:///dir`). None:
    MLFLOW_TRACKING_URI if set, else `sqlite:///mlflow.db` in the working dir."""
    experiment_name: str = "roll-pipeline"
    run_name: str | None = None
    """None: the config's exp_name."""
    retry_interval_s: float = 5.0
    """While MLflow is unreachable, check for it this often; tracking data waits in <output_dir>/mlflow_spool."""
    flush_timeout_s: float = 60.0
    """At the end of a run, wait this long for MLflow to take the spooled data while none gets through; what is
    left is sent later by `roll mlflow sync <output_dir>`."""
    sample_rows_per_tag: int = 8
    """Responses per tag in each validation's sample table (the first ones, all k of a prompt together)."""
    hash_inputs: bool = True
    """Tag the run with the sha256 of every data file and of the model folder (reads every byte once per run)."""
    logging_steps: int = 10
    """Every this many steps, the step's training samples go to MLflow as a table, train_samples/step_<N>.json
    (prompt, response, reward, shaped reward, advantage, in the loss or not); 0: never."""
    train_sample_rows_per_domain: int = 8
    """Rows of each domain in that table (its first groups, a prompt's responses together)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.logging_steps < 0 or self.train_sample_rows_per_domain < 0:
            yield "logging_steps", "logging_steps and train_sample_rows_per_domain must be >= 0"
        if self.retry_interval_s <= 0:
            yield "retry_interval_s", "must be > 0"
        if self.flush_timeout_s < 0:
            yield "flush_timeout_s", "must be >= 0"
        if self.sample_rows_per_tag < 0:
            yield "sample_rows_per_tag", "must be >= 0"
