"""The driver's side of a weight sync: which weights actor_infer holds, and how actor_train's reach it.

A sync is: actor_train's weights after `trained_version` updates go to every actor_infer worker, which takes them
as version `trained_version`; then each domain's scheduler is told that version (its requests name it, and
actor_infer refuses a request for a version it does not hold) with what a restarted actor_infer worker must be
given again. Two transports, chosen by `actor_infer.weight_transport`:

- `rpc` (the default): actor_train's rank 0 packs its state dict (workers/inference/weight_wire.py; under ZeRO-3
  every rank takes part in gathering it, the others return nothing) into Ray's object store, and actor_infer's
  workers load it from there; the reference goes on to the schedulers, which keep it for a restarted worker.
  Under the partial rule (`partial_rollout_token`) actor_infer also keeps the versions that the rollouts still
  generating were launched with (workers/inference/version_store.py).
- a vLLM weight-transfer engine (`nccl`, `ipc`, `gloo`): actor_train sends the weights to actor_infer's engines
  itself (workers/strategies/vllm_transfer.py); nothing is kept for a restarted worker.

`ensure()` syncs when actor_infer's version is behind actor_train's (and, under the partial rule, once at the
start: its rule may need the starting weights again after newer ones arrive)."""

from __future__ import annotations

from typing import Any

from roll_core.config import PipelineConfig
from roll_pipeline.driver.loop_state import LoopState


class WeightSync:
    """actor_infer's weights version and the syncs that move it; `runtime` is the run's ClusterRuntime."""

    def __init__(self, cfg: PipelineConfig, runtime: Any, loop: LoopState) -> None:
        self.cfg, self.runtime, self.loop = cfg, runtime, loop
        self.version = 0
        """The weights actor_infer holds: the number of actor updates they include."""
        self.synced_once = False

    def ensure(self) -> None:
        """Sync if actor_train's weights changed since actor_infer last got them (under the partial rule also the
        first time)."""
        if self.version != self.loop.trained_version or (self.cfg.partial_rule and not self.synced_once):
            self.sync()

    def sync(self) -> None:
        """actor_train's weights to actor_infer as version `loop.trained_version`, and that version to the
        schedulers."""
        self.version = self.loop.trained_version
        if self.cfg.actor_infer.weight_transport != "rpc":
            self.runtime.actor_train.call("send_weights", self.runtime.actor_infer.workers, self.version)
            kept = None
        else:
            kept = self._by_rpc()
        self.synced_once = True
        self.runtime.on_schedulers("set_weights", self.version, [kept])

    def _by_rpc(self) -> Any:
        """The packed weights loaded by every actor_infer worker; returns their object reference. The reference
        goes on as it is: the weights pass from actor_train's object store to the workers without a copy into
        this process and another back out (a 7B model's 15 GB, every step)."""
        train = self.runtime.actor_train
        if self.cfg.actor_train.zero_stage == 3:  # sharded parameters: every rank gathers; the others return {}
            refs = train.call_async("get_weights", packed=True)
            self.runtime.wait_for(refs[1:], train.call_names("get_weights")[1:])
            weights = refs[0]
        else:
            weights = train.workers[0].get_weights.remote(packed=True)
        if self.cfg.partial_rule:  # the versions the rollouts in flight were launched with stay on actor_infer
            in_flight = [r.version for r in self.loop.pending_rollouts if r.batch is None]
            self.runtime.actor_infer.call("update_weights", weights, self.version, min([self.version, *in_flight]))
        else:
            self.runtime.actor_infer.call("update_weights", weights, self.version)
        return weights
