"""A run's state across stops: the checkpoint `RLVRPipeline` writes (everything it needs to go on as if it had
never stopped) and reads back on `--resume` (roll_pipeline/driver/checkpoint.py writes the folder atomically).

A checkpoint is the loop's state (loop_state.py, saved whole), what lives in the run's processes (actor_train's
and the critic's DeepSpeed states and RNGs, actor_infer's RNGs, each scheduler's data position), the driver's
RNGs, where the MLflow run is, and the resolved config."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from roll_pipeline.driver.checkpoint import checkpoint_root, config_changes, read_state, write_checkpoint
from roll_pipeline.driver.loop_state import LoopState
from roll_pipeline.driver.runtime import ClusterRuntime
from workers.base import load_rng_states, rng_states

logger = logging.getLogger(__name__)

RNG_FILE = "rng_states.pt"


def save_run(
    step: int, runtime: ClusterRuntime, loop: LoopState, tracker: Any, config: dict[str, Any], output_dir: str,
    keep: int,
) -> Path:
    """Write the checkpoint of `step` under output_dir/checkpoints (all but the newest `keep` are deleted):
    the trained clusters' states, the RNGs, the loop state, the schedulers' positions and the MLflow run. A
    pending async rollout must have been collected (the pipeline settles it first)."""
    state: dict[str, Any] = {
        "schedulers": runtime.scheduler_states(),
        "mlflow_run_id": tracker.run_id if tracker else None,
        "mlflow_spool": str(tracker.spool.path.resolve()) if tracker else None,
        "config": config,
    }

    def write_parts(folder: Path) -> None:  # the state file is written after the parts (checkpoint.py)
        runtime.actor_train.call("save_checkpoint", str(folder / "actor_train"), {"step": step})
        if runtime.critic is not None:
            runtime.critic.call("save_checkpoint", str(folder / "critic"), {"step": step})
        torch.save({"driver": rng_states(), "actor_infer": runtime.actor_infer.call("rng_state")}, folder / RNG_FILE)
        state.update(loop.checkpoint(folder), step=step)  # the step saved (in a run, the loop's)

    return write_checkpoint(checkpoint_root(output_dir), step, write_parts, state, keep)


def restore_run(
    checkpoint: Path, runtime: ClusterRuntime, loop: LoopState, sync: Callable[[], None]
) -> dict[str, Any]:
    """Load a checkpoint `save_run` wrote: the trained clusters' states, the loop state (in place), then
    `sync()` (actor_infer gets the restored weights), the schedulers' positions and the RNGs. Returns the
    state file's contents."""
    state = read_state(checkpoint)
    runtime.actor_train.call("load_checkpoint", str(checkpoint / "actor_train"))
    if runtime.critic is not None:
        runtime.critic.call("load_checkpoint", str(checkpoint / "critic"))
    loop.load_checkpoint(state, checkpoint)
    sync()
    schedulers = state["schedulers"]
    runtime.wait_for([runtime.schedulers[d].load_state_dict.remote(s) for d, s in schedulers.items()],
                     [f"scheduler[{d}].load_state_dict" for d in schedulers])
    rngs = torch.load(checkpoint / RNG_FILE, weights_only=False)  # NumPy arrays and tuples inside
    load_rng_states(rngs["driver"])
    infer = runtime.actor_infer
    if len(rngs["actor_infer"]) == infer.world_size:  # else the world size changed: fresh RNGs
        infer.wait([w.load_rng_state.remote(r) for w, r in zip(infer.workers, rngs["actor_infer"], strict=True)],
                   "load_rng_state")
    return state


def warn_config_changes(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = config_changes(saved, current)
    if changed:
        logger.warning("resuming with a config that differs from the checkpoint's in: %s", ", ".join(changed[:20]))
