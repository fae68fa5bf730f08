"""What the RL loop carries from one step to the next, as one object that a checkpoint saves and restores whole.

Every field of `LoopState` has a codec in `CODECS` (how it is written into the checkpoint's state file and read
back), and `checkpoint` / `load_checkpoint` walk the fields, so a field without one cannot be saved, and one that
is saved is also restored (tests/test_loop_state.py round-trips every field). The one field with tensors, the
async run's pending rollouts, goes to files of their own beside the state file.

What is not here: the workers' states (actor_train's and the critic's DeepSpeed states, RNGs) and the
schedulers' data positions live in their processes and are gathered by run_state.py; which weights actor_infer
holds is the runtime's, and a restored run syncs them again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll_core.algorithms.mixing import MixState
from roll_core.algorithms.shaping import DomainRewardMoments
from roll_core.batch import Batch
from roll_pipeline.driver.significance import PromptOutcome, outcomes_from_table, outcomes_table

PENDING_ROLLOUT_FILE = "pending_rollout.pt"
"""The first pending rollout's file; the next ones are pending_rollout_1.pt, pending_rollout_2.pt, ..."""


def pending_rollout_file(index: int) -> str:
    return PENDING_ROLLOUT_FILE if index == 0 else f"pending_rollout_{index}.pt"


@dataclass
class Rollout:
    """A step's rollout: launched (`refs`, one per domain) or collected (`batch`, `metrics`); `version` is the
    weights version actor_infer generated it with."""

    version: int
    refs: dict[str, Any] | None = None
    batch: Batch | None = None
    metrics: dict[str, float] | None = None


@dataclass(frozen=True)
class FirstValidation:
    """The run's first validation, which the end of the run is paired with (the summary's "change")."""

    step: int
    outcomes: dict[str, PromptOutcome]


@dataclass
class LoopState:
    """The loop's state. Field names are the keys of the checkpoint's state file."""

    kl_ctrl: Any
    """The KL controller (roll_core/algorithms/kl.py), built from the config; its coefficient is state."""
    step: int = 0
    """The last step begun (0 before the first)."""
    trained_version: int = 0
    """The number of actor updates so far."""
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Every logged metric, by step."""
    val_outcomes: dict[str, PromptOutcome] | None = None
    """The last validation's per-prompt outcomes, which the next one is compared with."""
    first_val: FirstValidation | None = None
    mixer: MixState = field(default_factory=MixState)
    """What the domain mixer has measured (roll_core/algorithms/mixing.py)."""
    reward_moments: DomainRewardMoments = field(default_factory=DomainRewardMoments)
    """The running reward moments of reward shaping's normalisation, per domain."""
    pending_rollouts: list[Rollout] = field(default_factory=list)
    """Async: the rollouts of the next steps, oldest first, launched during this step and the ones before
    (collected before a checkpoint)."""

    def checkpoint(self, folder: Path) -> dict[str, Any]:
        """The state file's part of every field (plain JSON), the pending rollout's tensors written to `folder`."""
        return {f.name: CODECS[f.name].save(getattr(self, f.name), folder) for f in dataclasses.fields(self)}

    def load_checkpoint(self, state: Mapping[str, Any], folder: Path) -> None:
        """Every field from `checkpoint`'s output (and `folder`); a key absent from an older checkpoint leaves
        the field as it is."""
        for f in dataclasses.fields(self):
            codec = CODECS[f.name]
            if f.name in state or codec.file:
                setattr(self, f.name, codec.load(getattr(self, f.name), state.get(f.name), folder))


@dataclass(frozen=True)
class Codec:
    """How one field goes into the state file (`save(value, folder)`) and comes back (`load(current, saved,
    folder)`; `current` is the field's value before, for objects restored in place). `file`: the field lives
    in a file of its own, so it is loaded even when the state file has no key for it."""

    save: Callable[[Any, Path], Any]
    load: Callable[[Any, Any, Path], Any]
    file: bool = False


def _plain() -> Codec:
    return Codec(save=lambda value, _: value, load=lambda _, saved, __: saved)


def _loaded_into(current: Any, saved: Any) -> Any:
    current.load_state_dict(saved)
    return current


def _save_rollouts(rollouts: list[Rollout], folder: Path) -> int:
    for index, rollout in enumerate(rollouts):
        if rollout.batch is None:
            raise ValueError("a launched rollout is collected before a checkpoint (the pipeline's _settle)")
        torch.save({"version": rollout.version, "batch": rollout.batch, "metrics": rollout.metrics},
                   folder / pending_rollout_file(index))
    return len(rollouts)


def _load_rollouts(_: Any, saved: int | None, folder: Path) -> list[Rollout]:
    """The rollouts the state file says were pending (`saved`: how many; checkpoints of one-step-ahead runs wrote
    true or false); a checkpoint from before the state file said so (None) has one where its file is."""
    if saved is None:
        saved = int((folder / PENDING_ROLLOUT_FILE).exists())
    rollouts = []
    for index in range(int(saved)):
        path = folder / pending_rollout_file(index)
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: the checkpoint's state names {int(saved)} pending rollout(s), but this file is missing"
            )
        rollouts.append(Rollout(**torch.load(path, weights_only=False)))
    return rollouts


def _outcomes_codec() -> Codec:
    return Codec(
        save=lambda value, _: None if value is None else outcomes_table(value),
        load=lambda _, saved, __: None if saved is None else outcomes_from_table(saved),
    )


CODECS: dict[str, Codec] = {
    "kl_ctrl": Codec(save=lambda c, _: c.state_dict(), load=lambda c, saved, _: _loaded_into(c, saved)),
    "step": _plain(),
    "trained_version": _plain(),
    "history": Codec(
        save=lambda h, _: {str(k): v for k, v in h.items()},  # JSON keys are strings
        load=lambda _, saved, __: {int(k): v for k, v in saved.items()},
    ),
    "val_outcomes": _outcomes_codec(),
    "first_val": Codec(
        save=lambda v, _: None if v is None else {"step": v.step, "outcomes": outcomes_table(v.outcomes)},
        load=lambda _, saved, __: None if saved is None else FirstValidation(
            saved["step"], outcomes_from_table(saved["outcomes"])),
    ),
    "mixer": Codec(save=lambda m, _: m.state_dict(), load=lambda _, saved, __: MixState.from_state(saved)),
    "reward_moments": Codec(
        save=lambda m, _: m.state_dict(), load=lambda m, saved, _: _loaded_into(m, saved)
    ),
    "pending_rollouts": Codec(save=_save_rollouts, load=_load_rollouts, file=True),
}
