"""A run's state across stops: the checkpoint `RLVRPipeline` writes (everything it needs to go on as if it had
never stopped) and reads back on `--resume` (roll_pipeline/driver/checkpoint.py writes the folder atomically)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from roll_core.algorithms.mixing import MixState
from roll_core.batch import Batch
from roll_pipeline.driver.checkpoint import checkpoint_root, config_changes, read_state, write_checkpoint
from roll_pipeline.driver.significance import outcomes_from_table, outcomes_table
from workers.base import load_rng_states, rng_states

logger = logging.getLogger(__name__)

RNG_FILE = "rng_states.pt"
PENDING_ROLLOUT_FILE = "pending_rollout.pt"


@dataclasses.dataclass
class Rollout:
    """A step's rollout: launched (`refs`, one per domain) or collected (`batch`, `metrics`); `version` is the
    weights version actor_infer generated it with."""

    version: int
    refs: dict[str, Any] | None = None
    batch: Batch | None = None
    metrics: dict[str, float] | None = None


class RunState:
    """Checkpoints of `RLVRPipeline`: `save_checkpoint`, `restore`, and the warning when a resumed run's config
    differs from the checkpoint's."""

    def save_checkpoint(self, step: int) -> Path:
        """Everything the run needs to go on as if it had never stopped (roll_pipeline/driver/checkpoint.py writes it
        atomically): the trained clusters' DeepSpeed states and RNGs, actor_infer's and the driver's RNGs, every
        scheduler's data position, the KL controller, the running reward moments, the metric history, the
        step, and where the MLflow run is."""

        self._settle()

        def write_parts(folder: Path) -> None:
            self.actor_train.call("save_checkpoint", str(folder / "actor_train"), {"step": step})
            if self.critic is not None:
                self.critic.call("save_checkpoint", str(folder / "critic"), {"step": step})
            torch.save(
                {"driver": rng_states(), "actor_infer": self.actor_infer.call("rng_state")}, folder / RNG_FILE
            )
            if self.next_rollout is not None:  # async: the next step's batch, generated already
                pending = self.next_rollout
                torch.save(
                    {"version": pending.version, "batch": pending.batch, "metrics": pending.metrics},
                    folder / PENDING_ROLLOUT_FILE,
                )

        state = {
            "step": step,
            "trained_version": self.trained_version,
            "schedulers": self.scheduler_states(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "reward_moments": self.reward_moments.state_dict(),
            "history": {str(k): v for k, v in self.history.items()},
            "val_outcomes": None if self.val_outcomes is None else outcomes_table(self.val_outcomes),
            "first_val": None if self.first_val_outcomes is None else {
                "step": self.first_val_step, "outcomes": outcomes_table(self.first_val_outcomes)},
            "mixer": self.mix_state.state_dict(),
            "mlflow_run_id": self.tracker.run_id if self.tracker else None,
            "mlflow_spool": str(self.tracker.spool.path.resolve()) if self.tracker else None,
            "config": self.resolved.to_dict(),
        }
        root = checkpoint_root(self.cfg.output_dir)
        return write_checkpoint(root, step, write_parts, state, self.cfg.max_checkpoints_to_keep)

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        """Load a checkpoint `save_checkpoint` wrote into the running clusters; returns its state."""
        state = read_state(checkpoint)
        self.actor_train.call("load_checkpoint", str(checkpoint / "actor_train"))
        if self.critic is not None:
            self.critic.call("load_checkpoint", str(checkpoint / "critic"))
        self.trained_version = state["trained_version"]
        self.ensure_synced()
        if (checkpoint / PENDING_ROLLOUT_FILE).exists():
            self.next_rollout = Rollout(**torch.load(checkpoint / PENDING_ROLLOUT_FILE, weights_only=False))
        self.wait_for([self.schedulers[d].load_state_dict.remote(s) for d, s in state["schedulers"].items()],
                      [f"scheduler[{d}].load_state_dict" for d in state["schedulers"]])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.reward_moments.load_state_dict(state["reward_moments"])
        self.history = {int(k): v for k, v in state["history"].items()}
        saved_outcomes = state.get("val_outcomes")  # absent from checkpoints written before it was kept
        self.val_outcomes = None if saved_outcomes is None else outcomes_from_table(saved_outcomes)
        first = state.get("first_val")  # absent from checkpoints written before it was kept: no change at the end
        if first is not None:
            self.first_val_outcomes, self.first_val_step = outcomes_from_table(first["outcomes"]), first["step"]
        if state.get("mixer") is not None:
            self.mix_state = MixState.from_state(state["mixer"])
        self.global_step = state["step"]
        rngs = torch.load(checkpoint / RNG_FILE, weights_only=False)  # NumPy arrays and tuples inside
        load_rng_states(rngs["driver"])
        if len(rngs["actor_infer"]) == self.actor_infer.world_size:  # else the world size changed: fresh RNGs
            workers = zip(self.actor_infer.workers, rngs["actor_infer"], strict=True)
            self.actor_infer.wait([w.load_rng_state.remote(r) for w, r in workers], "load_rng_state")
        self.resumed_from = checkpoint
        return state

    def scheduler_states(self) -> dict[str, Any]:
        return dict(zip(self.schedulers, self.on_schedulers("state_dict"), strict=True))

    def _warn_config_changes(self, saved: dict[str, Any]) -> None:
        changed = config_changes(saved, self.resolved.to_dict())
        if changed:
            logger.warning(
                "resuming with a config that differs from the checkpoint's in: %s", ", ".join(changed[:20])
            )
