"""`PipelineConfig`: the top level of a run's config, its fields and the checks that span sections.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

from roll_core.config.clusters import (
    VLLM_MAX_LORA_RANKS,
    WEIGHT_TRANSPORTS,
    ActorInferConfig,
    ActorTrainConfig,
    CriticConfig,
    ReferenceConfig,
)
from roll_core.config.data import DataConfig
from roll_core.config.offpolicy import OffPolicyCorrectionConfig
from roll_core.config.ray import RayConfig
from roll_core.config.rewards import RewardAuditConfig, RewardConfig
from roll_core.config.sampling import DomainMixerConfig, DynamicSamplingConfig
from roll_core.config.shaping import RewardShapingConfig
from roll_core.config.shares import domain_shares
from roll_core.config.tracking import TrackingConfig
from roll_core.config.validation import ValidationConfig


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    pretrain: str
    """The policy's starting checkpoint: the default for every cluster's model_args.model_name_or_path."""
    max_steps: int
    rollout_batch_size: int
    """Prompts per RL step, over all domains."""
    domain_interleave_probs: dict[str, float]
    """Each domain's share of rollout_batch_size; must sum to 1. Shares are rounded by largest remainder."""
    rewards: dict[str, RewardConfig]
    data: DataConfig

    exp_name: str = "rlvr"
    seed: int = 42
    output_dir: str | None = None
    """Checkpoints and the resolved config go here; relative to the working directory. None: runs/<exp_name>."""
    num_return_sequences_in_group: int = 8
    """Responses sampled per prompt; advantages are computed within each prompt's group."""
    eval_steps: int = 10
    """Validate every this many steps and at the last step; 0: only at the start and the end."""
    save_steps: int = 0
    """Checkpoint every this many steps (and at the last step); 0 disables checkpoints. A checkpoint holds all a
    run needs to go on as if it had never stopped (`roll run CFG --resume`)."""
    max_checkpoints_to_keep: int = 2
    """Checkpoints kept under output_dir/checkpoints; older ones are deleted after a new one is complete."""
    async_generation_ratio: float = 0.0
    """0: synchronous, each step generates with the weights it trains. k (a whole number >= 1): rollouts are
    generated up to k steps ahead of the step that trains on them, while earlier steps train: each step's rollout
    is launched k steps before it, with the weights of then, so its tokens are at most k updates old. With k >= 2
    a weight sync lands while rollouts are generating and they go on with the new weights (partial rollouts: each
    token keeps the version that sampled it, batch key token_versions); with `deterministic: true` a sync waits for
    them instead, so every rollout is exactly k updates old (or lands where partial_rollout_token says). Pair it with an off-policy correction (infer_is_cap or
    offpolicy_correction)."""
    infer_is_cap: float | None = None
    """Truncated importance sampling between the policy that generated a batch (actor_infer's log-probs of the
    tokens it sampled) and actor_train's policy before the update: each token's policy-gradient term is weighted
    by min(exp(old_log_prob - infer_log_prob), infer_is_cap) (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"). None: off. 2.0 is the usual cap. The offpolicy/* metrics are
    logged whenever actor_infer returns log-probs (async runs, or a correction set). The shorthand for
    offpolicy_correction's `is_level: token` with `is_cap` this value; set one or the other."""
    offpolicy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    """Importance weights and rejection at the token or sequence level (roll_core/config/offpolicy.py)."""
    deterministic: bool = False
    """Repeatable runs: the same config and seed give the same metrics bitwise on CPU, and a resumed run goes on
    exactly as the uninterrupted one would have. Each prompt's group is then generated on its own with a sampling
    seed of its own (no batching across prompts), and a domain's scheduler waits for every prompt it drew before
    it fills its share in draw order (no aborts). Slower; for debugging and for tests."""
    partial_rollout_token: int | None = None
    """Partial rollouts in a deterministic run, by a rule instead of timing (with `deterministic: true` and
    async_generation_ratio >= 1). A rollout launched ahead with weights version v samples the first
    partial_rollout_token tokens of each generate call with v and the rest with v + 1, the update of the step that
    launched it (which always comes before the rollout is trained on); generation waits at that token until the
    sync of v + 1 arrives. So where a sync lands inside a response is the same in every rerun and after `--resume`.
    actor_infer keeps in host memory every version a rollout in flight still needs (up to k + 1 copies of the
    weights). The transformers engine only (vLLM steps requests of every version together). null: a deterministic
    run's weight syncs wait for the rollouts in flight (each rollout exactly k updates old)."""
    adv_estimator: str = "grpo"
    """Advantage estimator (roll_core/algorithms/advantages.py): `grpo` (group mean and std; DeepSeekMath,
    arXiv:2402.03300), `dr_grpo` (group mean only; Dr. GRPO, arXiv:2503.20783), `rloo` (leave-one-out group mean;
    arXiv:2402.14740), `reinforce` (discounted returns, no baseline: ROLL's reinforce), `reinforce_plus_plus`
    (discounted returns whitened over the batch; arXiv:2501.03262), `reinforce_plus_plus_baseline` (group mean,
    then batch whitening; arXiv:2501.03262) or `gae` (with the critic; arXiv:1506.02438)."""
    whiten_advantages: bool = False
    """Whiten the estimator's advantages over the valid tokens of the batch (mean 0, std 1); with advantage_scope
    `domain`, over each domain's."""
    advantage_scope: Literal["batch", "domain"] = "batch"
    """Where the advantages' batch statistics come from: `batch`, the whole step's batch (the estimators that
    whiten over the batch, reinforce_plus_plus and reinforce_plus_plus_baseline, and whiten_advantages); `domain`,
    each domain's samples on their own, with rewards.<domain>.whiten_advantages / advantage_clip where set (ROLL:
    each domain its own statistics). Group statistics (grpo, rloo, ...) are per prompt group either way."""
    advantage_clip: float | None = None
    """Clip the advantages (after whitening) to [-advantage_clip, advantage_clip]; None: no clipping."""
    ppo_epochs: int = 1
    policy_loss: str = "ppo_clip"
    """Policy loss (roll_core/algorithms/policy_loss.py): `ppo_clip` (PPO, arXiv:1707.06347, with DAPO's
    clip-higher and dual-clip options), `gspo` (sequence-level ratio; arXiv:2507.18071, use with
    seq-mean-token-mean), `cispo` (clipped, detached importance weights; MiniMax-M1, arXiv:2506.13585) or `topr`
    (tapered off-policy REINFORCE; arXiv:2503.14286)."""
    pg_clip: float = 0.2
    """The ratio's clip range on both sides, where pg_clip_low / pg_clip_high are not set (PPO's epsilon)."""
    pg_clip_low: float | None = None
    """The ratio's lower bound is 1 - pg_clip_low; None: pg_clip. CISPO clips only from above: 1.0."""
    pg_clip_high: float | None = None
    """The ratio's upper bound is 1 + pg_clip_high; None: pg_clip. DAPO's clip-higher (arXiv:2503.14476): 0.28
    with pg_clip_low 0.2. GSPO's ranges are tiny (3e-4 / 4e-4)."""
    dual_clip_c: float | None = None
    """Dual-clip PPO (Ye et al., arXiv:1912.09729), ppo_clip only: for negative advantages the loss is capped at
    -c * A (c > 1; 3.0 in the paper); None: off."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one (roll_core/algorithms/aggregation.py): `token-mean` (every token weighs
    the same; DAPO, arXiv:2503.14476), `seq-mean-token-mean` (every response weighs the same; GRPO,
    arXiv:2402.03300), `seq-mean-token-sum` (token sums averaged over responses) or `seq-mean-token-sum-norm`
    (token sums divided by the constant loss_scale_factor, averaged over responses; Dr. GRPO, arXiv:2503.20783)."""
    loss_scale_factor: int | None = None
    """The constant of seq-mean-token-sum-norm; None: actor_infer.generating_args.max_new_tokens."""
    entropy_loss_coef: float = 0.0
    """Entropy bonus: the loss minus coef * the aggregated entropy of the policy over the response tokens (Mnih et
    al., A3C, arXiv:1602.01783); 0: off."""
    use_kl_loss: bool = False
    """KL to the reference policy as a loss term weighted by kl_loss_coef (GRPO, arXiv:2402.03300); starts the
    reference cluster."""
    kl_loss_coef: float = 0.0
    kl_estimator: str = "k3"
    """Estimator of the KL loss (Schulman, "Approximating KL Divergence", 2020): `k1`, `k2` (alias `mse`), `k3`
    (alias `low_var_kl`) or `abs`."""
    add_token_level_kl: bool = False
    """KL to the reference policy as a token-level reward penalty (Ziegler et al., arXiv:1909.08593): every response
    token's reward gets -coef * KL_t, coef from kl_ctrl; starts the reference cluster."""
    kl_penalty: str = "k1"
    """Estimator of the KL reward penalty (the names of kl_estimator)."""
    kl_ctrl: str = "fixed"
    """Controller of the KL penalty's coefficient: `fixed` (init_kl_coef throughout) or `adaptive` (Ziegler et al.,
    arXiv:1909.08593: the coefficient moves by up to 20% per kl_horizon samples towards a KL of target_kl)."""
    init_kl_coef: float = 0.001
    """The KL penalty's coefficient at the start (throughout, when kl_ctrl is fixed)."""
    target_kl: float | None = None
    """The adaptive controller's target: mean per-token KL of a response; required when kl_ctrl is adaptive."""
    kl_horizon: int = 10000
    """The adaptive controller's horizon, in samples."""
    gamma: float = 1.0
    """Discount of GAE and REINFORCE++ returns."""
    lambd: float = 0.95
    """GAE's lambda (arXiv:1506.02438)."""
    critic_warmup: int = 0
    """The first this many steps train only the critic, so the actor starts from useful values (ROLL's
    critic_warmup); needs adv_estimator gae."""
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)

    actor_train: ActorTrainConfig = field(default_factory=ActorTrainConfig)
    actor_infer: ActorInferConfig = field(default_factory=ActorInferConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    critic: CriticConfig | None = None
    """Required when adv_estimator is gae."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    reward_audit: RewardAuditConfig = field(default_factory=RewardAuditConfig)
    domain_mixer: DomainMixerConfig = field(default_factory=DomainMixerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_steps < 1:
            yield "max_steps", "must be >= 1"
        if self.rollout_batch_size < 1:
            yield "rollout_batch_size", "must be >= 1"
        if self.num_return_sequences_in_group < 1:
            yield "num_return_sequences_in_group", "must be >= 1"
        if self.eval_steps < 0 or self.save_steps < 0:
            yield "eval_steps" if self.eval_steps < 0 else "save_steps", "must be >= 0"
        if self.max_checkpoints_to_keep < 1:
            yield "max_checkpoints_to_keep", "must be >= 1"
        if self.async_generation_ratio < 0 or self.async_generation_ratio != int(self.async_generation_ratio):
            yield (
                "async_generation_ratio",
                f"must be a whole number >= 0 (0: synchronous, k: up to k steps ahead), got {self.async_generation_ratio}",
            )
        yield from self._validate_partial_rollout_token()
        if self.infer_is_cap is not None and self.infer_is_cap <= 0:
            yield "infer_is_cap", "must be > 0 (or null: off)"
        if self.infer_is_cap is not None and self.offpolicy_correction.is_level is not None:
            yield "infer_is_cap", (
                "is the shorthand for offpolicy_correction.is_level token; set one or the other "
                f"(offpolicy_correction.is_level is {self.offpolicy_correction.is_level!r})"
            )
        yield from self._validate_domains()
        if self.ppo_epochs < 1:
            yield "ppo_epochs", "must be >= 1"
        yield from self._validate_algorithms()
        yield from self._validate_batch_division()
        yield from self._validate_token_budgets()
        yield from self._validate_lora()
        yield from self._validate_weight_transport()

    def _validate_weight_transport(self) -> Iterator[tuple[str, str]]:
        transport = self.actor_infer.weight_transport
        if transport == "rpc" or transport not in WEIGHT_TRANSPORTS:
            return
        key = "actor_infer.strategy_args.strategy_config.weight_transport"
        if self.actor_train.lora is not None:
            yield key, f"{transport}: with actor_train.lora a sync brings the adapters as a folder; use rpc"
        infer, train = set(self.actor_infer.devices or []), set(self.actor_train.devices or [])
        shared = infer & train
        if transport == "ipc" and self.actor_infer.devices is not None and not infer <= train:
            yield key, (
                f"ipc opens actor_train's tensors on the GPU they are on: every GPU of actor_infer must be one of "
                f"actor_train's; GPUs {sorted(infer - train)} are not"
            )
        if transport == "nccl" and shared:
            yield key, (
                f"nccl puts actor_train and the vLLM workers in one NCCL group, which cannot have two ranks on a "
                f"GPU; they share GPUs {sorted(shared)}: use ipc"
            )

    def _validate_partial_rollout_token(self) -> Iterator[tuple[str, str]]:
        token = self.partial_rollout_token
        if token is None:
            return
        if token < 1:
            yield "partial_rollout_token", f"must be >= 1 (or null), got {token}"
        elif not self.deterministic:
            yield "partial_rollout_token", (
                "applies to deterministic runs (deterministic: true); other runs take a weight sync inside a "
                "response wherever it arrives"
            )
        elif self.async_generation_ratio < 1:
            yield "partial_rollout_token", "needs async_generation_ratio >= 1 (synchronous rollouts take no sync)"
        elif self.actor_infer.strategy_args.strategy_name == "vllm":
            yield "partial_rollout_token", (
                "needs the transformers engine (actor_infer.strategy_args.strategy_name hf_infer): vLLM steps the "
                "requests of every weights version together"
            )

    @property
    def partial_rule(self) -> bool:
        """Deterministic partial rollouts: each token's weights version follows partial_rollout_token."""
        return self.partial_rollout_token is not None

    def _validate_lora(self) -> Iterator[tuple[str, str]]:
        if self.actor_train.lora is None:
            return
        largest = VLLM_MAX_LORA_RANKS[-1]
        if self.actor_infer.strategy_args.strategy_name == "vllm" and self.actor_train.lora.rank > largest:
            yield "actor_train.lora.rank", f"vLLM serves adapters up to rank {largest}, got {self.actor_train.lora.rank}"
        base = self.actor_train.model_args.model_name_or_path or self.pretrain
        for section in ("actor_infer", "reference") if self.needs_reference else ("actor_infer",):
            theirs = getattr(self, section).model_args.model_name_or_path or self.pretrain
            if theirs != base:
                role = "which is also the reference" if section == "reference" else "which generates with them"
                yield (
                    f"{section}.model_args.model_name_or_path",
                    f"must be actor_train's model ({base!r}) with actor_train.lora: the adapters train on that base "
                    f"model, {role}; got {theirs!r}",
                )

    def _validate_algorithms(self) -> Iterator[tuple[str, str]]:
        # The names (adv_estimator, policy_loss, ...) and what they need (a critic) are checked against their
        # registries by the driver (roll_pipeline/driver/names.py).
        if not 0 < self.pg_clip < 1:
            yield "pg_clip", f"must be in (0, 1), got {self.pg_clip}"
        if self.pg_clip_low is not None and not 0 < self.pg_clip_low <= 1:
            yield "pg_clip_low", f"must be in (0, 1], got {self.pg_clip_low}"
        if self.pg_clip_high is not None and self.pg_clip_high <= 0:
            yield "pg_clip_high", f"must be > 0, got {self.pg_clip_high}"
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            yield "dual_clip_c", f"must be > 1 (or null), got {self.dual_clip_c}"
        if self.advantage_clip is not None and self.advantage_clip <= 0:
            yield "advantage_clip", f"must be > 0 (or null), got {self.advantage_clip}"
        if self.loss_scale_factor is not None and self.loss_scale_factor < 1:
            yield "loss_scale_factor", "must be >= 1 (or null)"
        if self.kl_ctrl == "adaptive" and (self.target_kl is None or self.target_kl <= 0):
            yield "target_kl", "kl_ctrl adaptive needs a target_kl > 0"
        if self.kl_horizon < 1:
            yield "kl_horizon", "must be >= 1"
        if not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            yield "gamma" if not 0 <= self.gamma <= 1 else "lambd", "must be in [0, 1]"
        if self.critic_warmup < 0:
            yield "critic_warmup", "must be >= 0"
        for name in ("actor_train", "critic"):
            section = getattr(self, name)
            if section is not None and section.offload_states and section.zero_stage not in (1, 2, 3):
                yield (
                    f"{name}.offload_states",
                    f"needs strategy_config.zero_optimization.stage 1, 2 or 3 (DeepSpeed offloads the states of a "
                    f"ZeRO optimizer only), got stage {section.zero_stage}",
                )
        if self.actor_infer.offload_states and self.async_generation_ratio > 0:
            yield (
                "actor_infer.offload_states",
                "cannot be on with async_generation_ratio > 0: generation runs during the update, on its own GPUs",
            )
        max_new = self.actor_infer.generating_args.max_new_tokens
        blocks = [("reward_shaping", self.reward_shaping)]
        blocks += [(f"rewards.{d}.reward_shaping", r.reward_shaping) for d, r in self.rewards.items() if r.reward_shaping]
        for key, block in blocks:
            overlong = block.overlong_penalty
            if overlong is not None and overlong.buffer_len > max_new:
                yield (
                    f"{key}.overlong_penalty.buffer_len",
                    f"must be <= actor_infer.generating_args.max_new_tokens ({max_new}), got {overlong.buffer_len}",
                )
        for domain, reward in self.rewards.items():
            for name in ("whiten_advantages", "advantage_clip"):
                if getattr(reward, name) is not None and self.advantage_scope != "domain":
                    yield f"rewards.{domain}.{name}", "a domain's own value needs advantage_scope: domain"
            if reward.advantage_clip is not None and reward.advantage_clip <= 0:
                yield f"rewards.{domain}.advantage_clip", f"must be > 0 (or null), got {reward.advantage_clip}"

    def shaping_for(self, domain: str) -> RewardShapingConfig:
        """The reward shaping of `domain`: its own block, else the top-level one."""
        return self.rewards[domain].reward_shaping or self.reward_shaping

    def advantage_post(self, domain: str) -> tuple[bool, float | None]:
        """(whiten, clip) of `domain`'s advantages: its own values where set, else the top-level ones."""
        reward = self.rewards[domain]
        whiten = self.whiten_advantages if reward.whiten_advantages is None else reward.whiten_advantages
        clip = self.advantage_clip if reward.advantage_clip is None else reward.advantage_clip
        return whiten, clip

    @property
    def samples_per_step(self) -> int:
        """Responses per RL step: rollout_batch_size prompts times num_return_sequences_in_group."""
        return self.rollout_batch_size * self.num_return_sequences_in_group

    def optimizer_steps(self, section: ActorTrainConfig) -> int:
        """Optimizer steps a trained section (actor_train, critic) takes over the whole run."""
        return self.max_steps * self.ppo_epochs * (self.samples_per_step // section.samples_per_update)

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): the policy ratio is kept in [1 - low, 1 + high]."""
        low = self.pg_clip if self.pg_clip_low is None else self.pg_clip_low
        high = self.pg_clip if self.pg_clip_high is None else self.pg_clip_high
        return low, high

    @property
    def async_steps(self) -> int:
        """How many steps ahead rollouts are generated (async_generation_ratio); 0: synchronous."""
        return int(self.async_generation_ratio)

    @property
    def needs_infer_log_probs(self) -> bool:
        """actor_infer returns the log-probs of what it samples (for the correction and the offpolicy metrics)."""
        return self.async_generation_ratio > 0 or self.correction.active

    @property
    def correction(self) -> OffPolicyCorrectionConfig:
        """offpolicy_correction, with the infer_is_cap shorthand spelled out."""
        if self.infer_is_cap is None:
            return self.offpolicy_correction
        return replace(self.offpolicy_correction, is_level="token", is_cap=self.infer_is_cap)

    @property
    def infer_offloads(self) -> bool:
        """actor_infer frees its accelerator memory after each rollout and each validation. Only with synchronous
        generation (async rollouts generate while the others train), and only where something else needs that
        memory: its section says offload_states, or it runs vLLM with sleep mode (strategy_config
        enable_sleep_mode, on by default) on GPUs a trained cluster or the reference also uses (overlapping
        device_mappings, or a fraction of a GPU each without one). vLLM on GPUs of its own stays awake."""
        infer = self.actor_infer
        if self.async_generation_ratio > 0:
            return False
        if infer.offload_states:
            return True
        options = infer.strategy_args.strategy_config
        if infer.strategy_args.strategy_name != "vllm" or not options.get("enable_sleep_mode", True):
            return False
        if infer.devices is None:
            return 0 < infer.num_gpus_per_worker < 1
        others = [self.actor_train, self.reference if self.reference_cluster else None, self.critic]
        return any(set(infer.devices) & set(s.devices or []) for s in others if s is not None)

    @property
    def update_gives_old_log_probs(self) -> bool:
        """Each step's batch is trained in one pass (ppo_epochs 1), and nothing before the update reads
        old_log_probs (no KL reward penalty, no actor_infer log-probs to compare them with). Then the driver's
        separate log-prob pass is skipped: the first mini-batch's update runs the forward of the policy before the
        update, so actor_train takes that forward's log-probs, detached, as the old ones (the ratio is exactly 1),
        and, where the batch has further mini-batches, actor_train computes their old log-probs itself before its
        first optimizer step (workers/actor_train.py)."""
        return self.ppo_epochs == 1 and not self.add_token_level_kl and not self.needs_infer_log_probs

    @property
    def needs_reference(self) -> bool:
        """The KL loss or the KL reward penalty needs the reference policy's log-probs."""
        return self.use_kl_loss or self.add_token_level_kl

    @property
    def reference_cluster(self) -> bool:
        """Whether the run starts a reference cluster: the reference is needed and actor_train trains full weights.
        With LoRA adapters (actor_train.lora) the reference is the base model with the adapter disabled, and
        actor_train computes its log-probs (no second copy of the weights)."""
        return self.needs_reference and self.actor_train.lora is None

    def _validate_domains(self) -> Iterator[tuple[str, str]]:
        probs = self.domain_interleave_probs
        if not probs:
            yield "domain_interleave_probs", "must name at least one domain"
            return
        for domain, p in probs.items():
            if not 0 < p <= 1:
                yield f"domain_interleave_probs.{domain}", f"must be in (0, 1], got {p}"
            if domain not in self.rewards:
                yield f"domain_interleave_probs.{domain}", f"domain {domain!r} has no reward worker under rewards"
        total = sum(probs.values())
        if abs(total - 1.0) > 1e-6:
            parts = ", ".join(f"{d}={p}" for d, p in probs.items())
            yield "domain_interleave_probs", f"must sum to 1, got {total:g} ({parts})"
        for domain in self.rewards:
            if domain not in probs:
                yield f"rewards.{domain}", f"domain {domain!r} has no entry in domain_interleave_probs"
        seen: dict[str, str] = {}
        for domain, reward in self.rewards.items():
            for tag in reward.tag_included:
                if tag in seen:
                    yield f"rewards.{domain}.tag_included", f"tag {tag!r} is also routed to domain {seen[tag]!r}"
                seen[tag] = domain
        mixer = self.domain_mixer
        if mixer.type != "static":
            n = len(probs)
            if not mixer.floor * n <= 1 <= mixer.ceil * n:
                yield "domain_mixer.floor", f"with {n} domains need floor * {n} <= 1 <= ceil * {n}"
            if mixer.floor * self.rollout_batch_size < 1:
                yield (
                    "domain_mixer.floor",
                    f"floor {mixer.floor} x rollout_batch_size {self.rollout_batch_size} is under one prompt: a "
                    "domain could get none (and its signals would stop)",
                )
        if all(0 < p <= 1 for p in probs.values()) and abs(total - 1.0) <= 1e-6:
            for domain, share in domain_shares(probs, self.rollout_batch_size).items():
                if share == 0:
                    yield (
                        f"domain_interleave_probs.{domain}",
                        f"gives domain {domain!r} 0 of rollout_batch_size={self.rollout_batch_size} prompts; "
                        "raise its probability or the batch size",
                    )

    def _validate_token_budgets(self) -> Iterator[tuple[str, str]]:
        """A token budget per micro-batch must hold one row of the longest a single-turn rollout makes (its width
        rounded up as the section's sequence-length rounding pads it)."""
        row = self.data.prompt_length + self.actor_infer.generating_args.max_new_tokens
        for name in ("actor_train", "actor_infer", "reference", "critic"):
            section = getattr(self, name)
            if section is None:
                continue
            budgets = {
                f"{name}.infer_max_tokens_per_microbatch": (
                    section.infer_max_tokens_per_microbatch, section.infer_sequence_length_round
                )
            }
            if hasattr(section, "training_args"):
                ta = section.training_args
                budgets[f"{name}.training_args.max_tokens_per_microbatch"] = (
                    ta.max_tokens_per_microbatch, ta.sequence_length_round
                )
            for key, (budget, round_to) in budgets.items():
                width = -(-row // max(round_to, 1)) * max(round_to, 1)  # a micro-batch's width, rounded up
                if budget is not None and budget < width:
                    rounding = "" if width == row else f", {width} rounded up"
                    yield (
                        key,
                        f"{budget} tokens cannot hold one row: data.prompt_length + actor_infer.generating_args."
                        f"max_new_tokens = {self.data.prompt_length} + "
                        f"{self.actor_infer.generating_args.max_new_tokens} = {row} tokens{rounding}",
                    )

    def _validate_batch_division(self) -> Iterator[tuple[str, str]]:
        samples = self.samples_per_step
        for name in ("actor_train", "critic"):
            section = getattr(self, name)
            if section is None:
                continue
            per_step = section.samples_per_update
            if samples % per_step:
                yield (
                    f"{name}.training_args",
                    f"rollout_batch_size * num_return_sequences_in_group = {samples} samples per step must be "
                    f"divisible by per_device_train_batch_size * gradient_accumulation_steps * world_size "
                    f"= {per_step}",
                )
