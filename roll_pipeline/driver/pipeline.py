"""RLVRPipeline: the RL loop, one short step of named stages at a time (the clusters: runtime.py; checkpoints
and resume: run_state.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from ray.exceptions import RayActorError

from roll_core.algorithms import ADVANTAGES, DOMAIN_MIXERS, KL_CONTROLLERS
from roll_core.algorithms.advantages import advantage_metrics, place_at_last_token, postprocess_advantages
from roll_core.algorithms.kl import kl_penalty_rewards
from roll_core.algorithms.mixing import observe_rollout, observe_validation
from roll_core.algorithms.offpolicy import (
    correction_metrics,
    importance_weights,
    rejection_keep,
    staleness_metrics,
)
from roll_core.algorithms.shaping import shape_scores
from roll_core.batch import Batch, loss_mask
from roll_core.config import ResolvedConfig, domain_shares
from roll_core.data.loading import RunData
from roll_core.tracking.metadata import run_tags
from roll_core.tracking.mlflow_tracker import MlflowTracker
from roll_core.tracking.spool import SPOOL_DIRNAME
from roll_core.tracking.system import MemoryProbe
from roll_pipeline.driver.digests import DIGESTS_FILE, append_step_digests
from roll_pipeline.driver.loop_state import FirstValidation, LoopState, Rollout
from roll_pipeline.driver.records import batch_records
from roll_pipeline.driver.report import log_validation_artifacts, train_sample_table, train_table_file
from roll_pipeline.driver.reward_audit import audit_plan, environment_plan, run_audit
from roll_pipeline.driver.run_state import restore_run, save_run, warn_config_changes
from roll_pipeline.driver.runtime import ClusterRuntime, WorkerDiedError, load_run_data, log_dropped
from roll_pipeline.driver.significance import prompt_outcomes, validation_significance
from roll_pipeline.driver.summary import run_summary
from roll_pipeline.driver.validation import (
    answer_keys,
    metric_name_part,
    rollout_metrics,
    validation_metrics,
)
from roll_pipeline.driver.weight_sync import WeightSync

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class StepTimer:
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class RLVRPipeline:
    """Multi-domain RLVR: per-domain schedulers fill each step's batch, then one PPO-style update for all.

    It holds what the run runs on (`runtime`: Ray, the clusters, the schedulers; runtime.py) and what the loop
    carries from step to step (`loop`, saved and restored whole; loop_state.py); checkpoints are written and
    read by run_state.py. This module is the step and the loop."""

    def __init__(self, resolved: ResolvedConfig) -> None:
        self.resolved = resolved
        self.cfg = resolved.config
        self.runtime = ClusterRuntime(self.cfg)
        self.loop = LoopState(
            kl_ctrl=KL_CONTROLLERS.get(self.cfg.kl_ctrl)(
                kl_coef=self.cfg.init_kl_coef, target_kl=self.cfg.target_kl, horizon=self.cfg.kl_horizon
            )
        )
        self.tracker: MlflowTracker | None = None
        self.resumed_from: Path | None = None
        self.weights = WeightSync(self.cfg, self.runtime, self.loop)
        """actor_infer's weights: their version and the syncs (weight_sync.py)."""
        self.async_steps = self.cfg.async_steps
        """Rollouts are launched up to this many steps ahead of the step that trains on them (0: synchronous)."""

    # ------------------------------------------------------------------------------------------- set-up

    def setup(self, resume_from: Path | None = None, data: RunData | None = None) -> None:
        """Start every cluster and scheduler, and the MLflow run; with `resume_from` (a checkpoint folder), load
        its state and go on in the MLflow run it names. `data`: the prompts as the preflight checks loaded them
        (`preflight_with_data`); without it they are loaded here."""
        from workers.strategies.loading import load_tokenizer

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.actor_infer.model_args)
        if data is None:
            data = load_run_data(self.tokenizer, cfg)
        else:
            log_dropped(data, cfg.data.prompt_length)
        train, val, dropped = data.train, data.val, data.dropped()
        self.runtime.start_clusters()
        self.has_validation = any(val[d].rows for d in cfg.domain_interleave_probs if d in val)
        self.runtime.start_schedulers(train, val)
        spool_root = Path(cfg.output_dir) / SPOOL_DIRNAME
        if resume_from is None:
            self.tracker = MlflowTracker(cfg.tracking, spool_root)
            self.tracker.log_params(dataclasses.asdict(cfg))
            self.loop.history[0] = dict(dropped)  # a resumed run has them in its restored history and MLflow run
            self.tracker.log_metrics(dropped, step=0)
        else:
            state = self.restore(resume_from)
            warn_config_changes(state["config"], self.resolved.to_dict())
            self.tracker = MlflowTracker(cfg.tracking, spool_root, resume_spool=state["mlflow_spool"])
        self.tracker.log_dict(self.resolved.to_dict(), "resolved_config.json")
        self.tracker.set_tags({**run_tags(self.resolved, cfg.tracking.hash_inputs), "pretrain": cfg.pretrain})
        self.memory = MemoryProbe({c.name: c.workers for c in self.runtime.clusters()})
        self.answer_keys = answer_keys(cfg.rewards)
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.output_dir) / "resolved_config.json").write_text(json.dumps(self.resolved.to_dict(), indent=2))
        placement = self.runtime.placement_record()
        (Path(cfg.output_dir) / "placement.json").write_text(json.dumps(placement, indent=2))
        self.tracker.log_dict(placement, "placement.json")

    # ------------------------------------------------------------------------------------------- the step

    def step(self) -> dict[str, float]:
        """One RL step: rollout, log-probs, importance weights, values, rewards, advantages, update, weight sync.

        With async_generation_ratio k, once this step's rollout is collected the rollouts of the next k steps are
        in flight (those not launched yet are launched now, with the weights from before this step's update) and
        generate while this step trains; the weights go to actor_infer just before a launch instead of after the
        update."""
        timer = StepTimer()
        with timer.stage("rollout"):
            rollout = self.rollout()
        batch, metrics = rollout.batch, rollout.metrics
        if self.async_steps:
            with timer.stage("launch_ahead"):  # the weight sync before each launch included
                self.launch_ahead()
            metrics["offpolicy/buffered_rollouts"] = float(len(self.loop.pending_rollouts))
        with timer.stage("log_probs"):
            batch = self.compute_log_probs(batch)
        if self.cfg.deterministic:
            append_step_digests(Path(self.cfg.output_dir) / DIGESTS_FILE, self.loop.step, batch.tensors)
        with timer.stage("importance_weights"):
            batch, offpolicy = self.importance_weights(batch, rollout.version)
            metrics |= offpolicy
        with timer.stage("values"):
            batch = self.compute_values(batch)
        with timer.stage("shape_rewards"):
            batch, shaping = self.shape_rewards(batch)
            metrics |= shaping
        with timer.stage("advantages"):
            batch = self.compute_advantages(batch)
            metrics |= advantage_metrics(batch["advantages"], loss_mask(batch), batch.meta["domain"])
        self.log_train_samples(batch)
        with timer.stage("train"):
            metrics |= self.train(batch)
        if not self.async_steps:
            with timer.stage("sync_weights"):
                self.weights.ensure()
        metrics |= {f"time/{name}_s": s for name, s in timer.seconds.items()}
        generated = float(batch["response_mask"].sum())
        metrics["throughput/generated_tokens"] = generated
        metrics["throughput/rollout_tokens_per_s"] = generated / max(timer.seconds["rollout"], 1e-9)
        metrics["time/step_s"] = sum(timer.seconds.values())
        return metrics

    def rollout(self) -> Rollout:
        """This step's rollout: the oldest one launched ahead (async), or a new one; waited for. Under
        partial_rollout_token the last update is synced first: the rollout may wait for it at its switch token."""
        if self.cfg.partial_rule:
            self.weights.ensure()
        pending = self.loop.pending_rollouts
        return self.finish_rollout(pending.pop(0) if pending else self.launch_rollout())

    def launch_ahead(self) -> None:
        """Async: launch the rollouts of the next async_steps steps that are not in flight yet (none past
        max_steps). With `deterministic` each waits for those before it first: the weight sync before a launch then
        never lands while a rollout generates, and the schedulers' draws never depend on timing. Under
        partial_rollout_token none waits: each token's weights follow the rule, and a rollout launched before this
        step's update takes it at the switch token (when this step updates the actor)."""
        pending = self.loop.pending_rollouts
        switch_at = None if self.critic_warming_up() else self.cfg.partial_rollout_token
        while len(pending) < self.async_steps and self.loop.step + len(pending) < self.cfg.max_steps:
            if self.cfg.deterministic and not self.cfg.partial_rule:
                self._finish_pending()
            pending.append(self.launch_rollout(switch_at))

    def launch_rollout(self, switch_at: int | None = None) -> Rollout:
        """Every domain's scheduler starts filling its share of rollout_batch_size prompts, each prompt with a
        scored group that passed the domain's filters, with the weights actor_train has now (under
        partial_rollout_token: and from token `switch_at` on with the next version)."""
        self.weights.ensure()
        self.offload_trained_states()
        n = self.cfg.num_return_sequences_in_group
        args = self.cfg.actor_infer.generating_args
        probs, shares = self.domain_mix()
        pin = (self.weights.version, switch_at) if self.cfg.partial_rule else None
        schedulers = {d: self.runtime.schedulers[d] for d in shares}
        # Each fill's call number is reserved first: rollouts launched together reach a scheduler in any order.
        calls = self.runtime.wait_for([s.reserve_fill.remote() for s in schedulers.values()],
                                      [f"scheduler[{d}].reserve_fill" for d in schedulers])
        refs = {
            d: s.get_batch.remote(shares[d], n, args, pin, call)
            for (d, s), call in zip(schedulers.items(), calls, strict=True)
        }
        mix = {f"mix/{d}": p for d, p in probs.items()} | {f"mix/{d}/prompts": float(k) for d, k in shares.items()}
        return Rollout(version=self.weights.version, refs=refs, metrics=mix)

    def domain_mix(self) -> tuple[dict[str, float], dict[str, int]]:
        """This rollout's domain probabilities (the domain mixer's, from what it has measured so far) and the
        prompt shares they give."""
        mixer = self.cfg.domain_mixer
        params = {k: getattr(mixer, k) for k in ("floor", "ceil", "strength", "validation_weight")}
        probs = DOMAIN_MIXERS.get(mixer.type)(self.cfg.domain_interleave_probs, self.loop.mixer, **params)
        return probs, domain_shares(probs, self.cfg.rollout_batch_size)

    def finish_rollout(self, rollout: Rollout) -> Rollout:
        """Wait for a launched rollout; its parts become one batch, group ids numbered over the whole batch."""
        if rollout.batch is not None:
            return rollout
        n = self.cfg.num_return_sequences_in_group
        parts, metrics = [], dict(rollout.metrics or {})
        names = [f"scheduler[{d}].get_batch" for d in rollout.refs]
        results = self.runtime.wait_for(list(rollout.refs.values()), names)
        for domain, (part, scheduler_metrics) in zip(rollout.refs, results, strict=True):
            parts.append(part)
            metrics |= rollout_metrics(domain, batch_records(part)) | scheduler_metrics
        batch = Batch.concat(parts)
        batch = batch.update({"group_ids": torch.arange(len(batch) // n).repeat_interleave(n)})
        if self.cfg.infer_offloads:  # colocated training gets the GPU memory back; this step's update (if the
            # actor trains in it) is synced before anything generates again, so vLLM may drop its weights
            self.runtime.actor_infer.call("offload", not self.critic_warming_up())
        metrics |= rollout_metrics("all", batch_records(batch))
        mixer = self.cfg.domain_mixer
        observe_rollout(self.loop.mixer, metrics, list(rollout.refs), mixer.smoothing)
        return Rollout(version=rollout.version, batch=batch, metrics=metrics)

    def offload_trained_states(self) -> None:
        """actor_train's and the critic's states to CPU memory while actor_infer generates, where their section
        says offload_states (colocated on the GPUs generation uses); their next call reloads them."""
        for cluster, section in ((self.runtime.actor_train, self.cfg.actor_train), (self.runtime.critic, self.cfg.critic)):
            if cluster is not None and section.offload_states:
                cluster.call("offload_states")

    def importance_weights(self, batch: Batch, generated_with: int) -> tuple[Batch, dict[str, float]]:
        """How off-policy the batch is (offpolicy/*: staleness in updates, per token from the versions that
        sampled them, or `generated_with` for a batch without them; the ratios between the policy that sampled it
        and actor_train's, and what the corrections cut), and the corrections cfg.correction asks for: the
        importance weights (`infer_is_weights`) and the rejection (`offpolicy_keep`, which loss_mask applies). The
        ratios read actor_infer's log-probs of each token, which the version that sampled it computed: a response
        sampled across a weight sync is corrected token by token against the weights of each part."""
        metrics = staleness_metrics(
            self.loop.trained_version, batch.tensors.get("token_versions"), batch["response_mask"], generated_with
        )
        if "infer_log_probs" not in batch:
            return batch, metrics
        mask, correction = loss_mask(batch), self.cfg.correction
        old, infer = batch["old_log_probs"], batch["infer_log_probs"]
        bounds = correction.rejection_bounds
        metrics |= correction_metrics(
            old, infer, mask, is_level=correction.is_level, cap=correction.is_cap, rs_level=correction.rs_level,
            bounds=bounds,
        )
        tensors = {}
        if correction.is_level is not None:
            tensors["infer_is_weights"] = importance_weights(
                old, infer, batch["response_mask"], correction.is_level, correction.is_cap
            )
        if correction.rs_level is not None:
            tensors["offpolicy_keep"] = rejection_keep(old, infer, batch["response_mask"], correction.rs_level, *bounds)
        return batch.update(tensors), metrics

    def compute_log_probs(self, batch: Batch) -> Batch:
        """old_log_probs from actor_train (unless its update makes them itself: cfg.update_gives_old_log_probs)
        and ref_log_probs from the reference, where there is one."""
        tensors = {}
        if not self.cfg.update_gives_old_log_probs:
            tensors["old_log_probs"] = torch.cat(self.runtime.actor_train.dispatch("compute_log_probs", batch))
        if self.runtime.reference is not None:
            tensors["ref_log_probs"] = torch.cat(self.runtime.reference.dispatch("compute_log_probs", batch))
        return batch.update(tensors)

    def compute_values(self, batch: Batch) -> Batch:
        if self.runtime.critic is None:
            return batch
        return batch.update({"values": torch.cat(self.runtime.critic.dispatch("compute_values", batch))})

    def shape_rewards(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Per domain: the loss-side sample masks and the shaped scores (cfg.reward_shaping), placed at each
        response's last token; then the KL penalty on every token when add_token_level_kl is on."""
        cfg = self.cfg
        scores, in_loss, metrics = shape_scores(
            batch["scores"],
            batch.meta["domain"],
            batch["group_ids"],
            batch["in_loss"],
            batch["response_mask"],
            batch.meta["correct"],
            {domain: cfg.shaping_for(domain) for domain in cfg.rewards},
            self.loop.reward_moments,
            max_length=cfg.actor_infer.generating_args.max_new_tokens,
        )
        self.shaped_scores = scores * in_loss  # for the training sample table
        rewards = place_at_last_token(scores, batch["response_mask"])
        if cfg.add_token_level_kl:
            mask = loss_mask(batch.update({"in_loss": in_loss}))
            coef = self.loop.kl_ctrl.value
            rewards, kl = kl_penalty_rewards(
                rewards, batch["old_log_probs"], batch["ref_log_probs"], mask, coef, cfg.kl_penalty
            )
            current_kl = float(kl.sum() / in_loss.sum().clamp(min=1.0))
            self.loop.kl_ctrl.update(current_kl, n_steps=len(batch))
            metrics |= {"kl_penalty/kl": current_kl, "kl_penalty/coef": coef}
        return batch.update({"token_level_rewards": rewards, "in_loss": in_loss}), metrics

    def log_train_samples(self, batch: Batch) -> None:
        """Every tracking.logging_steps steps, the step's training samples as an MLflow table."""
        t = self.cfg.tracking
        if not (self.tracker and t.logging_steps and t.train_sample_rows_per_domain) or self.loop.step % t.logging_steps:
            return
        prompts = self.tokenizer.batch_decode(
            [ids[m > 0] for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)],
            skip_special_tokens=True,
        )
        mask = loss_mask(batch)
        tokens = mask.sum(1).clamp(min=1.0)
        table = train_sample_table(
            batch_records(batch),
            prompts,
            self.shaped_scores.tolist(),
            ((batch["advantages"] * mask).sum(1) / tokens).tolist(),
            (batch["in_loss"] > 0).tolist(),
            t.train_sample_rows_per_domain,
        )
        self.tracker.log_table(table, train_table_file(self.loop.step))

    def compute_advantages(self, batch: Batch) -> Batch:
        """The estimator's advantages and returns, post-processed (whitening, clipping): over the whole batch, or
        with advantage_scope `domain` over each domain's samples on their own, with its own whiten/clip."""
        cfg = self.cfg
        if cfg.advantage_scope == "batch":
            advantages, returns = self._advantages(batch, cfg.whiten_advantages, cfg.advantage_clip)
            return batch.update({"advantages": advantages, "returns": returns})
        advantages = torch.zeros_like(batch["response_mask"], dtype=torch.float32)
        returns = torch.zeros_like(advantages)
        domains = batch.meta["domain"]
        for domain in dict.fromkeys(domains):
            rows = [i for i, d in enumerate(domains) if d == domain]
            idx = torch.tensor(rows, dtype=torch.long)
            adv, ret = self._advantages(batch.select(rows), *cfg.advantage_post(domain))
            advantages[idx], returns[idx] = adv.to(advantages.dtype), ret.to(returns.dtype)
        return batch.update({"advantages": advantages, "returns": returns})

    def _advantages(self, batch: Batch, whiten: bool, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        estimator = ADVANTAGES.get(self.cfg.adv_estimator)
        advantages, returns = estimator(
            token_level_rewards=batch["token_level_rewards"],
            response_mask=batch["response_mask"],
            group_ids=batch["group_ids"],
            in_loss=batch["in_loss"],
            values=batch.tensors.get("values"),
            gamma=self.cfg.gamma,
            lambd=self.cfg.lambd,
        )
        return postprocess_advantages(advantages, loss_mask(batch), whiten, clip), returns

    def critic_warming_up(self) -> bool:
        """This step is one of the first critic_warmup steps, which train the critic only."""
        return 0 < self.loop.step <= self.cfg.critic_warmup

    def train(self, batch: Batch) -> dict[str, float]:
        """The critic's and the actor's updates, side by side; during the first critic_warmup steps of a run
        (the loop's step counts from 1) only the critic's."""
        warming_up = self.critic_warming_up()
        refs, names = [], []
        if self.runtime.critic is not None:
            refs += self.runtime.critic.call_async_dispatch("train_step", batch)
            names += self.runtime.critic.call_names("train_step")
        if not warming_up:
            refs += self.runtime.actor_train.call_async_dispatch("train_step", batch)
            names += self.runtime.actor_train.call_names("train_step")
            self.loop.trained_version += 1
        per_key: dict[str, list[float]] = {}
        for result in self.runtime.wait_for(refs, names):  # one per rank of each cluster; a key comes from one cluster's
            for k, v in result.items():
                per_key.setdefault(k, []).append(v)
        metrics = {k: sum(vs) / len(vs) for k, vs in per_key.items()}
        if self.runtime.critic is not None:
            metrics["critic/warmup"] = float(warming_up)
        return metrics

    # ------------------------------------------------------------------------------------------- the loop

    def validate(self) -> dict[str, float]:
        """k responses per validation prompt, scored by the training reward; metrics per tag and domain
        (roll_pipeline/driver/validation.py names them), and the sample table and accuracy chart go to MLflow.

        With the current weights: an async rollout still generating with older ones is finished first."""
        self._settle()
        args = self.cfg.validation.generating_args
        v = self.cfg.validation
        records = []
        for batch in self.runtime.on_schedulers("validate", args, v.max_prompts, v.num_samples):
            prompts = self.tokenizer.batch_decode(
                [ids[m > 0] for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)],
                skip_special_tokens=True,
            )
            records += [
                r.but(prompt=p, ground_truth=g)
                for r, p, g in zip(batch_records(batch), prompts, batch.meta["ground_truth"], strict=True)
            ]
        metrics = validation_metrics(records, self.answer_keys)
        outcomes = prompt_outcomes(records, metric_name_part)
        significance, tags = validation_significance(outcomes, self.loop.val_outcomes, v.regression_alpha, v.confidence)
        metrics |= significance
        if tags.get("val_regressed", "none") != "none":
            logger.warning(
                "validation at step %d: tags %s regressed significantly since the last validation (val_change/*)",
                self.loop.step,
                tags["val_regressed"],
            )
        if self.tracker:
            history = {**self.loop.history, self.loop.step: metrics}
            rows = self.cfg.tracking.sample_rows_per_tag
            log_validation_artifacts(self.tracker, self.loop.step, records, history, rows, outcomes)
            self.tracker.set_tags(tags)
        self.loop.val_outcomes = outcomes
        if self.loop.first_val is None:
            self.loop.first_val = FirstValidation(self.loop.step, outcomes)
        observe_validation(self.loop.mixer, metrics, list(self.cfg.domain_interleave_probs))
        if self.cfg.infer_offloads:  # what comes next (a checkpoint, the next update) needs the GPU
            self.runtime.actor_infer.call("offload", False)
        return metrics

    def audit_rewards(self) -> dict[str, float]:
        """Every audited reward scores its panel on its live workers, and every audited environment runs its panel
        on its domain's scheduler (roll_pipeline/driver/reward_audit.py); raises `RewardAuditError` when a verdict
        or an answer is not the known one and reward_audit.on_change is `stop`."""
        audit = self.cfg.reward_audit
        panels, judges = audit_plan(self.cfg)
        return run_audit(
            self.loop.step, panels, judges, self.runtime.rewards, self.runtime.wait_for, audit.judge_items,
            audit.on_change, environments=environment_plan(self.cfg), schedulers=self.runtime.schedulers,
        )

    def run(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, Any]:
        """Train up to max_steps (from the restored step after `restore`); validate at the start, every
        eval_steps and at the end. Returns a summary."""
        cfg = self.cfg
        start = time.perf_counter()
        status = "FAILED"
        try:
            if self.resumed_from is None:
                first: dict[str, float] = {}
                if cfg.reward_audit.every_steps:
                    first |= self.audit_rewards()
                if cfg.validation.eval_at_start and self.has_validation:
                    first |= self.validate()
                if first:
                    self._log(0, first)
            for step in range(self.loop.step + 1, cfg.max_steps + 1):
                self.loop.step = step
                metrics = self.step()
                if cfg.reward_audit.every_steps and step % cfg.reward_audit.every_steps == 0:
                    metrics |= self.audit_rewards()
                last = step == cfg.max_steps
                if self.has_validation and (last or (cfg.eval_steps and step % cfg.eval_steps == 0)):
                    metrics |= self.validate()
                self._log(step, metrics)
                if cfg.save_steps and (step % cfg.save_steps == 0 or last):
                    self.save_checkpoint(step)
                if on_step:
                    on_step(step, metrics)
            status = "FINISHED"
        except RayActorError as exc:
            dead = self.runtime.dead_training_workers()
            if dead:
                raise WorkerDiedError(self.runtime.death_message(dead, exc, self.loop.step)) from exc
            raise
        finally:
            if self.tracker:
                self.tracker.finish(status)
        return run_summary(self.loop, self.cfg, self.tracker, time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------- state

    def save_checkpoint(self, step: int) -> Path:
        """Everything the run needs to go on as if it had never stopped (run_state.py), once an async rollout in
        flight is collected and actor_infer has the current weights."""
        self._settle()
        cfg = self.cfg
        return save_run(step, self.runtime, self.loop, self.tracker, self.resolved.to_dict(), cfg.output_dir,
                        cfg.max_checkpoints_to_keep)

    def restore(self, checkpoint: Path) -> dict[str, Any]:
        """Load a checkpoint `save_checkpoint` wrote into the running clusters and the loop; returns its state."""
        state = restore_run(checkpoint, self.runtime, self.loop, sync=self.weights.ensure)
        self.resumed_from = checkpoint
        return state

    def shutdown(self) -> None:
        """Stop the schedulers and clusters, and Ray where this run started it."""
        self.runtime.shutdown()

    # ------------------------------------------------------------------------------------------- helpers

    def _settle(self) -> None:
        """Finish the async rollouts in flight (each keeps its batch for its step) and give actor_infer the
        current weights: before validating, and before a checkpoint (whose scheduler states then match). Under
        partial_rollout_token the weights go first: a rollout in flight may wait for them."""
        if self.cfg.partial_rule:
            self.weights.ensure()
        self._finish_pending()
        self.weights.ensure()

    def _finish_pending(self) -> None:
        """Wait for the rollouts launched ahead, oldest first."""
        pending = self.loop.pending_rollouts
        pending[:] = [self.finish_rollout(r) for r in pending]

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = metrics | self.memory()
        self.loop.history[step] = self.loop.history.get(step, {}) | metrics
        if self.tracker:
            self.tracker.log_metrics(metrics, step)
