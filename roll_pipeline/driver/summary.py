"""What `RLVRPipeline.run` returns when the run ends: its MLflow run, steps and seconds, the first and last
validations' accuracies, and the run's change per prompt between them (run_change.py)."""

from __future__ import annotations

from typing import Any

from roll_core.config import PipelineConfig
from roll_pipeline.driver.loop_state import LoopState
from roll_pipeline.driver.run_change import run_change


def run_summary(loop: LoopState, cfg: PipelineConfig, tracker: Any, wall_s: float) -> dict[str, Any]:
    """The summary of a run whose loop state is `loop`; `tracker`: its MLflow tracker, or None."""
    val_steps = [s for s, m in sorted(loop.history.items()) if "val_correct/all/mean" in m]

    def accuracies(step: int) -> dict[str, float]:
        metrics = loop.history[step].items()
        return {k: v for k, v in metrics if k.startswith("val_correct/") and k.endswith("/mean")}

    change = None
    first = loop.first_val
    if first is not None and loop.val_outcomes is not None and val_steps:
        v = cfg.validation
        change = {
            "first_step": first.step,
            "last_step": val_steps[-1],
            "alpha": v.regression_alpha,
            "confidence": v.confidence,
            "rows": run_change(first.outcomes, loop.val_outcomes, v.regression_alpha, v.confidence),
        }
    return {
        "run_id": tracker.run_id if tracker else None,
        "tracking_uri": tracker.uri if tracker else None,
        "steps": loop.step,
        "wall_s": wall_s,
        "start": {"step": val_steps[0], **accuracies(val_steps[0])} if val_steps else None,
        "end": {"step": val_steps[-1], **accuracies(val_steps[-1])} if val_steps else None,
        "output_dir": cfg.output_dir,
        "change": change,
    }
