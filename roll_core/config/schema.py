"""The pipeline's configuration schema: frozen dataclasses, each field documented once, at the field.

`validate()` methods only check values and yield (relative key, message) pairs; the loader prefixes the key
paths and reports every problem at once. Field names follow ROLL's where they mean the same thing.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from roll_core.config.devices import parse_device_mapping
from roll_core.config.shares import domain_shares


class ConfigError(ValueError):
    """A configuration problem; the message names the key path(s) and is meant for the user as is."""



@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    model_name_or_path: str | None = None
    """A local Hugging Face model folder (or a hub id where the hub is reachable). None: the top-level `pretrain`.
    A relative path is taken relative to the config file's folder; write it as ./dir/name when it could be
    mistaken for a hub id (an `org/name` that does not exist there)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False


@dataclass(frozen=True, kw_only=True)
class TrainingArgs:
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment. Far below the gradients' size (the default) a step
    moves each weight by about lr * sign(gradient); far above it, by lr * gradient / epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear LR warm-up from 0."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up; linear and cosine decay to 0 at the last optimizer step of the run."""
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.learning_rate <= 0:
            yield "learning_rate", f"must be > 0, got {self.learning_rate}"
        if self.per_device_train_batch_size < 1:
            yield "per_device_train_batch_size", "must be >= 1"
        if self.gradient_accumulation_steps < 1:
            yield "gradient_accumulation_steps", "must be >= 1"
        if self.warmup_steps < 0:
            yield "warmup_steps", "must be >= 0"
        if self.max_grad_norm <= 0:
            yield "max_grad_norm", "must be > 0"
        if self.adam_epsilon <= 0:
            yield "adam_epsilon", f"must be > 0, got {self.adam_epsilon}"

    @property
    def minibatch_size(self) -> int:
        """Samples per optimizer step on one rank: per_device_train_batch_size * gradient_accumulation_steps."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


@dataclass(frozen=True, kw_only=True)
class GeneratingArgs:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    do_sample: bool = True
    """False is greedy decoding (temperature, top_p and top_k are then ignored)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_new_tokens < 1:
            yield "max_new_tokens", "must be >= 1"
        if self.do_sample and self.temperature <= 0:
            yield "temperature", "must be > 0 when do_sample is true (set do_sample: false for greedy)"
        if not 0 < self.top_p <= 1:
            yield "top_p", f"must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            yield "top_k", "must be >= 0"


@dataclass(frozen=True, kw_only=True)
class StrategyArgs:
    strategy_name: str
    """Training: `deepspeed_train`. Inference: `hf_infer` (transformers; CPU or GPU) or `vllm` (GPU)."""
    strategy_config: dict[str, Any] = field(default_factory=dict)
    """Passed to the strategy; for deepspeed_train, merged into the DeepSpeed config (e.g. zero_optimization)."""


TRAIN_STRATEGIES = ("deepspeed_train",)
INFER_STRATEGIES = ("hf_infer", "vllm")


def custom_resource_problems(resources: dict[str, float]) -> Iterator[tuple[str, str]]:
    """Problems of a section's `resources` (custom Ray resources per worker)."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            yield "resources", f"{name!r} is set by num_cpus_per_worker / num_gpus_per_worker, not resources"
        elif not isinstance(amount, int | float) or isinstance(amount, bool) or not amount > 0:
            yield "resources", f"{name}: must be a number > 0, got {amount!r}"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Resources and model of one cluster of Ray workers that run the same role."""

    model_args: ModelArgs = field(default_factory=ModelArgs)
    world_size: int = 1
    """Number of workers (data-parallel ranks) in this cluster. With a device_mapping it must equal the number
    of GPUs listed divided by num_gpus_per_worker (it is checked, not derived, so the YAML says what runs)."""
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    """GPUs each worker asks Ray for; a fraction shares a GPU. With a device_mapping: how many of the listed GPUs
    each worker uses, a whole number >= 1 (the fraction of a GPU shared with another cluster comes from the
    plan, not from here)."""
    device_mapping: list[int] | str | None = None
    """ROLL's device mapping: the GPUs of the pipeline's pool this cluster runs on, by index; GPU i is GPU
    i % ray.num_gpus_per_node of node i // ray.num_gpus_per_node, and the pool spans as many nodes as the
    highest index needs. A list of distinct indices, or ROLL's string forms, parsed without eval:
    "list(range(0,8))", "range(8, 16)", "[0, 1, 2, 3]", sums such as "list(range(0,4)) + list(range(8,12))".
    Worker r uses the r-th run of num_gpus_per_worker indices (all on one node). Clusters whose GPUs overlap are
    colocated: each worker on a shared GPU holds an equal fraction of it (ROLL's colocation; vLLM's sleep mode
    frees the memory between phases); disjoint mappings get separate GPUs. If one cluster has a mapping, every
    cluster that uses GPUs needs one. None: Ray places the workers by num_gpus_per_worker and `placement`.
    `roll run CONFIG --dry-run` prints the plan."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each worker asks for, to pin it to the nodes that offer them (`ray start
    --resources='{"trainer": 8}'`), e.g. {trainer: 1}; CPU and GPU are num_cpus_per_worker/num_gpus_per_worker."""
    torch_threads: int = 2
    """torch intra-op threads per worker; the stages run one after another, so each may use the whole box."""
    infer_batch_size: int = 32
    """Micro-batch size for forward passes that need no gradient (log-probs, values)."""
    placement: Literal["default", "pack", "spread", "strict_spread"] = "default"
    """Where the workers go. `default`: wherever Ray finds their resources. The others reserve one placement-group
    bundle per worker (all workers start together or not at all): `pack` on as few nodes as possible (colocated
    ranks), `spread` over as many nodes as possible, `strict_spread` one node per worker."""
    offload_states: bool = False
    """Take turns on shared GPUs: between the phases that use it, this cluster's GPU state waits in CPU memory.
    actor_train and critic offload their weights, gradients and optimizer states (DeepSpeed's offload_states,
    ZeRO stage 1-3) while actor_infer generates and reload them for log-probs, values and the update; the
    reference keeps its weights on the CPU except while it computes log-probs; actor_infer (synchronous
    generation only) frees its GPU between rollouts (vLLM's sleep mode, or the hf model's weights to the CPU).
    Colocated clusters (overlapping device_mappings) need it where their states do not fit a GPU together.
    Nothing moves on a worker without a GPU."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.world_size < 1:
            yield "world_size", "must be >= 1"
        if self.num_cpus_per_worker < 0 or self.num_gpus_per_worker < 0:
            yield "num_cpus_per_worker", "resources must be >= 0"
        if self.torch_threads < 1:
            yield "torch_threads", "must be >= 1"
        if self.infer_batch_size < 1:
            yield "infer_batch_size", "must be >= 1"
        yield from custom_resource_problems(self.resources)
        if self.device_mapping is not None:
            yield from self._validate_device_mapping()

    @property
    def devices(self) -> list[int] | None:
        """device_mapping as a list of GPU indices; None without one. Raises ValueError for a string it cannot
        parse (validate() reports that at load)."""
        return None if self.device_mapping is None else parse_device_mapping(self.device_mapping)

    def _validate_device_mapping(self) -> Iterator[tuple[str, str]]:
        try:
            devices = self.devices or []
        except ValueError as exc:
            yield "device_mapping", str(exc)
            return
        if not devices:
            yield "device_mapping", "must list at least one GPU index (null: no fixed GPUs)"
            return
        bad = [d for d in devices if type(d) is not int or d < 0]
        if bad:
            yield "device_mapping", f"GPU indices must be whole numbers >= 0, got {bad[0]!r}"
            return
        repeated = sorted(d for d, n in Counter(devices).items() if n > 1)
        if repeated:
            yield "device_mapping", f"lists GPU(s) {repeated} more than once; a worker needs GPUs of its own"
        if self.placement != "default":
            yield "placement", "must be default with a device_mapping (the mapping decides where workers go)"
        if self.resources:
            yield "resources", "must be empty with a device_mapping (the GPU pool's bundles decide where workers go)"
        per_worker = self.num_gpus_per_worker
        if per_worker < 1 or per_worker != int(per_worker):
            yield (
                "num_gpus_per_worker",
                "with a device_mapping this is how many of its GPUs each worker uses: a whole number >= 1, "
                f"got {per_worker:g}",
            )
            return
        per_worker = int(per_worker)
        if self.world_size * per_worker != len(devices):
            fix = (
                f"set world_size: {len(devices) // per_worker}"
                if len(devices) % per_worker == 0
                else f"list a multiple of {per_worker} GPUs"
            )
            yield (
                "world_size",
                f"world_size {self.world_size} x num_gpus_per_worker {per_worker} = "
                f"{self.world_size * per_worker} GPU(s), but device_mapping lists {len(devices)}; {fix}",
            )


@dataclass(frozen=True, kw_only=True)
class ActorTrainConfig(ClusterConfig):
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    strategy_args: StrategyArgs = field(default_factory=lambda: StrategyArgs(strategy_name="deepspeed_train"))

    def validate(self) -> Iterator[tuple[str, str]]:
        yield from super().validate()
        if self.strategy_args.strategy_name not in TRAIN_STRATEGIES:
            yield "strategy_args.strategy_name", f"must be one of {list(TRAIN_STRATEGIES)}"

    @property
    def zero_stage(self) -> int:
        """DeepSpeed ZeRO stage of strategy_config.zero_optimization (0 when not set)."""
        return int((self.strategy_args.strategy_config.get("zero_optimization") or {}).get("stage", 0))

    @property
    def samples_per_update(self) -> int:
        """Samples per optimizer step over all ranks: the mini-batch size times world_size."""
        return self.training_args.minibatch_size * self.world_size


@dataclass(frozen=True, kw_only=True)
class ActorInferConfig(ClusterConfig):
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    strategy_args: StrategyArgs = field(default_factory=lambda: StrategyArgs(strategy_name="hf_infer"))

    def validate(self) -> Iterator[tuple[str, str]]:
        yield from super().validate()
        if self.strategy_args.strategy_name not in INFER_STRATEGIES:
            yield "strategy_args.strategy_name", f"must be one of {list(INFER_STRATEGIES)}"


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig(ClusterConfig):
    strategy_args: StrategyArgs = field(default_factory=lambda: StrategyArgs(strategy_name="hf_infer"))


@dataclass(frozen=True, kw_only=True)
class CriticConfig(ActorTrainConfig):
    """The value model: the policy's backbone with a scalar head, trained with the clipped value loss."""

    value_clip: float | None = 0.5
    """PPO's value clipping (arXiv:1707.06347, as in OpenAI baselines' PPO2): a value estimate moves at most this
    far from the one that computed the advantages in one step; None: the plain squared error."""

    def validate(self) -> Iterator[tuple[str, str]]:
        yield from super().validate()
        if self.value_clip is not None and self.value_clip <= 0:
            yield "value_clip", f"must be > 0 (or null for no clipping), got {self.value_clip}"


COMPONENT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True, kw_only=True)
class RewardComponentConfig:
    """One of several rewards of a domain (`rewards.<domain>.workers`): its scorer, its weight in the domain's
    reward, and what its masking does to the sample. Unset resources are the domain's."""

    worker: str
    """A registered reward worker name (`roll rewards list`) or a `package.module:Class` path."""
    weight: float = 1.0
    """The domain's reward of a sample is the weighted sum of its components' scores."""
    name: str | None = None
    """Its metrics' name (`reward/<domain>/<name>/...`) and its Ray cluster's (`reward_<domain>_<name>`); default:
    the worker's registered name (or the class name of a path)."""
    options: dict[str, Any] = field(default_factory=dict)
    on_masked: str = "mask"
    """This component masked a sample (an infrastructure failure, or a sample it cannot judge): `mask` masks the
    sample; `skip` leaves the component out of that sample's sum, the other components' weights scaled up so the
    sum keeps its scale (a sample that every component skips is masked)."""
    world_size: int | None = None
    num_cpus_per_worker: float | None = None
    num_gpus_per_worker: float | None = None
    timeout_s: float | None = None
    num_processes: int | None = None
    resources: dict[str, float] | None = None

    @property
    def label(self) -> str:
        return self.name or self.worker.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


def scoring_budget_s(worker_timeout_s: float) -> float:
    """The most time a scorer with a time budget of its own (code_sandbox's `sample_timeout_s`) may give one
    sample under a reward worker that masks a sample after `worker_timeout_s`: the worker's limit less a margin
    for the scorer's own work around the runs (a sandbox's start, its teardown, the verdict), max(2 s, 20%), and
    never less than half of it. A program that is slow on purpose then ends in a score (timeouts, 0) before the
    worker's limit turns it into a mask, which a policy could learn to prefer to a wrong answer."""
    return max(worker_timeout_s - max(2.0, 0.2 * worker_timeout_s), 0.5 * worker_timeout_s)


def _budget_problems(where: str, options: dict[str, Any], timeout_s: float) -> Iterator[tuple[str, str]]:
    budget = options.get("sample_timeout_s")
    if isinstance(budget, int | float) and not isinstance(budget, bool) and budget > scoring_budget_s(timeout_s):
        yield (
            f"{where}sample_timeout_s",
            f"must be at most {scoring_budget_s(timeout_s):g} (timeout_s {timeout_s:g} less a margin for the "
            f"sandbox's own work): a sample that outlasts the worker's timeout is masked instead of scored, "
            f"got {budget}",
        )


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One domain: the worker(s) that score it and the data tags routed to it."""

    tag_included: list[str]
    """Rows whose `tag` is in this list belong to this domain."""
    worker: str | None = None
    """A registered reward worker name (`roll rewards list`) or a `package.module:Class` path. Or, instead,
    `workers`: several weighted rewards."""
    workers: list[RewardComponentConfig] = field(default_factory=list)
    """Several rewards combined per sample, e.g. `[{worker: math_rule, weight: 1.0}, {worker: reward_model,
    weight: 0.5, options: {model_path: ...}}]`; the first one's `correct` is the domain's accuracy."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options for the worker's scorer (e.g. timeout_s for code_sandbox)."""
    world_size: int = 1
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float = 0.0
    """GPUs each reward worker asks Ray for (a reward model on a GPU); 0: it runs on the CPU."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each reward worker asks for, to pin it to the nodes that offer them, e.g.
    {sandbox: 1} for code_sandbox workers on the nodes that have bubblewrap (`ray start --resources='{"sandbox":
    4}'` there)."""
    timeout_s: float = 30.0
    """Per-sample scoring time limit; a sample that runs past it is masked, never scored 0."""
    num_processes: int = 2
    """Samples scored at once, each in its own process of the worker's pool; for an I/O-bound scorer (llm_judge,
    remote code_sandbox), requests in flight on the worker's asyncio loop (the old name `num_threads` is still
    read, with a warning)."""
    group_filters: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Dynamic sampling: named group filters (schedulers/filters.py) with their parameters, applied in order; a
    dropped group's slot goes to a fresh prompt. `{std_filter: {}}` is DAPO's rule (drop groups whose rewards
    are all equal); `{mean_filter: {low: 0.1, high: 0.9}}` drops too-easy and too-hard prompts."""
    max_prompts_factor: float | None = None
    """This domain's redraw bound, overriding dynamic_sampling.max_prompts_factor (e.g. a domain whose groups
    rarely pass its filters may get a lower bound, so redraws do not hold up the step)."""
    response_filters: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    """Named response filters: a rejected response stays in its group but leaves the loss (sample_mask 0);
    `{truncated: {}}` masks responses cut off by max_new_tokens (DAPO's overlong filtering)."""
    reward_shaping: RewardShapingConfig | None = None
    """This domain's reward shaping, replacing the top-level `reward_shaping` block for it (the whole block: keys
    left out take their defaults, not the top-level values); None: the top-level block."""
    whiten_advantages: bool | None = None
    """This domain's `whiten_advantages` (None: the top-level value); needs advantage_scope: domain."""
    advantage_clip: float | None = None
    """This domain's `advantage_clip` (None: the top-level value); needs advantage_scope: domain."""

    def components(self) -> list[RewardComponentConfig]:
        """The domain's rewards with every resource set: `workers`, or the one `worker` (weight 1)."""
        listed = self.workers or [RewardComponentConfig(worker=self.worker or "", options=self.options)]
        return [
            replace(
                c,
                name=c.label,
                world_size=self.world_size if c.world_size is None else c.world_size,
                num_cpus_per_worker=self.num_cpus_per_worker if c.num_cpus_per_worker is None else c.num_cpus_per_worker,
                num_gpus_per_worker=self.num_gpus_per_worker if c.num_gpus_per_worker is None else c.num_gpus_per_worker,
                timeout_s=self.timeout_s if c.timeout_s is None else c.timeout_s,
                num_processes=self.num_processes if c.num_processes is None else c.num_processes,
                resources=dict(self.resources if c.resources is None else c.resources),
            )
            for c in listed
        ]

    def validate(self) -> Iterator[tuple[str, str]]:
        # Filter names are checked against their registry by the driver (roll_pipeline/driver/names.py).
        if not self.tag_included:
            yield "tag_included", "must list at least one tag"
        if (self.worker is None) == (not self.workers):
            yield "worker", "set either worker (one reward) or workers (several weighted rewards), not both or neither"
        if self.workers and self.options:
            yield "options", "with workers, each component has its own options: move them to workers[i].options"
        if self.num_gpus_per_worker < 0:
            yield "num_gpus_per_worker", "must be >= 0"
        yield from custom_resource_problems(self.resources)
        if self.workers and self.workers[0].on_masked != "mask":
            yield "workers[0].on_masked", "the first component decides `correct` (accuracy), so it must be `mask`"
        names: set[str] = set()
        for i, c in enumerate(self.workers):
            where = f"workers[{i}]"
            if not c.worker:
                yield f"{where}.worker", "must name a reward worker"
            if c.on_masked not in ("mask", "skip"):
                yield f"{where}.on_masked", f"must be one of ['mask', 'skip'], got {c.on_masked!r}"
            if not (c.weight > 0 and math.isfinite(c.weight)):
                yield f"{where}.weight", f"must be a number > 0, got {c.weight}"
            if not COMPONENT_NAME.fullmatch(c.label):
                yield f"{where}.name", f"{c.label!r} must be letters, digits and _ (it names metrics and a Ray cluster)"
            elif c.label in names:
                yield f"{where}.name", f"{c.label!r} names two components: give one a `name`"
            names.add(c.label)
            for key in ("world_size", "num_processes"):
                if getattr(c, key) is not None and getattr(c, key) < 1:
                    yield f"{where}.{key}", "must be >= 1"
            if c.timeout_s is not None and c.timeout_s <= 0:
                yield f"{where}.timeout_s", "must be > 0"
            for key, problem in custom_resource_problems(c.resources or {}):
                yield f"{where}.{key}", problem
        if self.max_prompts_factor is not None and self.max_prompts_factor < 1:
            yield "max_prompts_factor", f"must be >= 1 (a domain must be able to draw its share), got {self.max_prompts_factor}"
        if self.world_size < 1:
            yield "world_size", "must be >= 1"
        if self.timeout_s <= 0:
            yield "timeout_s", "must be > 0"
        for i, c in enumerate(self.components()):
            where = f"workers[{i}].options." if self.workers else "options."
            yield from _budget_problems(where, c.options, c.timeout_s if c.timeout_s is not None else self.timeout_s)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_files: list[str]
    """JSONL, JSON or Parquet files, or local Hugging Face dataset folders; relative to the config file."""
    val_files: list[str] = field(default_factory=list)
    messages_key: str = "messages"
    """Column with chat messages; rows without it use `prompt_key` as a single user message."""
    prompt_key: str = "prompt"
    prompt_length: int = 256
    """Longest prompt in tokens (after the chat template)."""
    on_long_prompt: Literal["error", "drop"] = "error"
    """A prompt longer than `prompt_length`: `error` stops before the run starts, naming its file, line and both
    lengths; `drop` leaves the row out and counts it per domain and split: a warning, the metric
    `data/<domain>/{train,val}_prompts_dropped` (step 0) and a line of `roll run --dry-run`."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if not self.train_files:
            yield "train_files", "must list at least one file"
        if self.prompt_length < 1:
            yield "prompt_length", "must be >= 1"


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    generating_args: GeneratingArgs = field(
        default_factory=lambda: GeneratingArgs(do_sample=False, max_new_tokens=32)
    )
    eval_at_start: bool = True
    """Validate once before the first step, so the run reports where it started."""
    max_prompts: int = 0
    """Use at most this many validation prompts per domain (the first ones); 0 means all."""
    num_samples: int = 1
    """Responses per validation prompt (k): accuracy is their mean; pass@k and maj@k need k > 1 and sampling."""
    regression_alpha: float = 0.05
    """A tag is flagged as regressed (tag `val_regressed`, metric val_change/<tag>/regressed) when fewer of its
    prompts are solved than at the previous validation and McNemar's exact test, Holm-adjusted over the tags,
    gives p below this (roll_pipeline/driver/significance.py)."""
    confidence: float = 0.95
    """Level of the per-tag Wilson intervals (val_ci/<tag>/low and high)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.num_samples < 1:
            yield "num_samples", "must be >= 1"
        if not 0 < self.regression_alpha < 1:
            yield "regression_alpha", "must be between 0 and 1"
        if not 0 < self.confidence < 1:
            yield "confidence", "must be between 0 and 1"
        if self.num_samples > 1 and not self.generating_args.do_sample:
            yield "num_samples", "k > 1 responses per prompt need generating_args.do_sample: true (greedy repeats one)"


@dataclass(frozen=True, kw_only=True)
class LedgerConfig:
    """The difficulty ledger (schedulers/ledger.py): rows whose recent groups were uniform (all right or all
    wrong) are passed over before they are generated, with a re-test probability so they can come back."""

    enabled: bool = False
    streak: int = 1
    """Uniform groups in a row (all right, or all wrong) after which a row is skipped when drawn."""
    retest_prob: float = 0.25
    """Chance that a skipped row is generated anyway, to see whether it is still uniform."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.streak < 1:
            yield "streak", "must be >= 1"
        if not 0 < self.retest_prob <= 1:
            yield "retest_prob", "must be in (0, 1] (0 would never let a skipped row come back)"


@dataclass(frozen=True, kw_only=True)
class DomainMixerConfig:
    """How each step's prompts are divided among the domains (roll_core/algorithms/mixing.py): `static`, the
    shares of domain_interleave_probs every step; `progress`, shares that follow each domain's kept groups per
    second of rollout (and its validation gains), starting from domain_interleave_probs."""

    type: str = "static"
    floor: float = 0.1
    """Smallest probability a domain gets (floor x rollout_batch_size must be at least one prompt)."""
    ceil: float = 0.9
    """Largest probability a domain gets."""
    strength: float = 1.0
    """How strongly the rates move the shares: the exponent of a domain's rate relative to the mean."""
    smoothing: float = 0.7
    """Weight of the past in the moving average of each domain's rate (0: the last step alone)."""
    validation_weight: float = 1.0
    """Extra weight for a domain whose validation accuracy rose at the last validation (times the gain)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        # `type` is checked against DOMAIN_MIXERS by the driver (roll_pipeline/driver/names.py).
        if not 0 <= self.floor < self.ceil <= 1:
            yield "floor", f"need 0 <= floor < ceil <= 1, got floor {self.floor}, ceil {self.ceil}"
        if not 0 <= self.smoothing < 1:
            yield "smoothing", "must be in [0, 1)"
        if self.strength < 0 or self.validation_weight < 0:
            yield "strength", "strength and validation_weight must be >= 0"


@dataclass(frozen=True, kw_only=True)
class RewardAuditConfig:
    """Reward audits during a run (roll_pipeline/driver/reward_audit.py): every reward worker with an audit panel
    scores it at step 0 and every `every_steps` steps; judges are checked against the math rule."""

    every_steps: int = 0
    """0: no audits."""
    on_change: Literal["stop", "warn"] = "stop"
    """When a panel item gets a verdict other than its known one: stop the run with an error naming the items,
    or log a warning and go on."""
    judge_items: int = 8
    """Rule-checkable items (the math panel's right and wrong answers) a judge domain scores, to report how often
    it agrees with the rule; 0: none."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.every_steps < 0:
            yield "every_steps", "must be >= 0 (0: no audits)"
        if self.judge_items < 0:
            yield "judge_items", "must be >= 0"


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """How each domain's scheduler fills its share of a step (the filters themselves are per domain, under
    rewards.<domain>.group_filters and response_filters)."""

    max_running_requests: int = 8
    """Prompts in flight at once per domain, each one request for its whole group; validation sends all of its
    prompts at once."""
    max_prompts_factor: float = 4.0
    """The redraw bound: a domain draws at most ceil(max_prompts_factor * share) prompts in a step."""
    request_mode: Literal["auto", "wave", "prompt"] = "auto"
    """How drawn prompts go to actor_infer. `prompt`: one request per prompt (its whole group), which an engine
    with continuous batching (vLLM) schedules as it goes. `wave`: the prompts drawn together go as requests of as
    many prompts as fill one actor_infer batch (infer_batch_size sequences), so a statically batching engine (hf
    generate) starts at once with the whole wave instead of gathering single requests. `auto`: `prompt` for
    vLLM, `wave` otherwise. Deterministic runs always send one seeded request per prompt."""
    on_bound: Literal["train_on_passed", "error"] = "train_on_passed"
    """At the bound with too few groups passed: `train_on_passed` fills the empty slots with dropped groups whose
    samples are masked out of the loss, logs a warning and scheduler/<domain>/bound_hit = 1; `error` stops the
    run with an error naming the domain and its filters."""
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    """Skip rows whose recent groups were uniform before generating them (off by default)."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_running_requests < 1:
            yield "max_running_requests", "must be >= 1"
        if self.max_prompts_factor < 1:
            yield "max_prompts_factor", f"must be >= 1 (a domain must be able to draw its share), got {self.max_prompts_factor}"


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


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = None
    """An existing Ray cluster to join (else RAY_ADDRESS; else a local cluster is started)."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster. None: enough for every worker's num_cpus_per_worker; the stages run
    one after another, so over-subscribing the logical count does not over-subscribe the cores."""
    num_gpus_per_node: int = 8
    """GPUs per node of the pool that the clusters' device_mapping indices number (ROLL's num_gpus_per_node):
    index i is on node i // num_gpus_per_node. Unused without device mappings."""
    worker_restarts: int = 3
    """Times Ray restarts a dead actor_infer, reference or reward worker; the calls it had in flight are sent
    again (actor_infer gets the current weights first). A reward worker that stays dead has its samples masked
    (reward/<domain>/masked_worker_lost). actor_train and critic hold the training state and are not restarted:
    their death stops the run, which `roll run --resume` continues from the last checkpoint."""
    scheduler_num_cpus: float = 0.05
    """CPUs each domain's scheduler (a coordinating actor: it sends requests and collects results) asks Ray for:
    a fraction, so that it is counted where it runs without holding back a worker's CPU."""
    actor_start_timeout_s: float = 600.0
    """The longest the driver waits for every actor of the run to be placed and started (its model loaded) before
    the run stops with an error naming each one still waiting and what the cluster has free."""
    rpc_timeout_s: float | None = 3600.0
    """The longest the driver waits on any call to a worker (a step's rollout, a training step, a weight sync,
    a checkpoint) before the run stops with an error naming each worker that did not answer; None: no bound."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.rpc_timeout_s is not None and self.rpc_timeout_s <= 0:
            yield "rpc_timeout_s", f"must be > 0 (or null for no bound), got {self.rpc_timeout_s}"
        if self.num_gpus_per_node < 1:
            yield "num_gpus_per_node", "must be >= 1"
        if self.worker_restarts < 0:
            yield "worker_restarts", "must be >= 0"
        if not 0 <= self.scheduler_num_cpus <= 1:
            yield "scheduler_num_cpus", f"must be between 0 and 1 (a fraction of a CPU), got {self.scheduler_num_cpus}"
        if self.actor_start_timeout_s <= 0:
            yield "actor_start_timeout_s", f"must be > 0, got {self.actor_start_timeout_s}"


@dataclass(frozen=True, kw_only=True)
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (Yu et al., arXiv:2503.14476, eq. 13), added to the score: 0 up to
    max_new_tokens - buffer_len response tokens, then falling linearly to -penalty_factor at max_new_tokens."""

    buffer_len: int
    """The soft buffer in tokens before actor_infer.generating_args.max_new_tokens (DAPO: 4096 of 20480)."""
    penalty_factor: float = 1.0
    """The penalty at max_new_tokens."""


@dataclass(frozen=True, kw_only=True)
class DifficultyMaskConfig:
    """Masks out of the loss the groups whose mean score lies outside [low, high]: the meaning of the scheduler's
    `mean_filter` (schedulers/filters.py), applied to the batch as it is instead of drawing other prompts."""

    low: float = 0.0
    high: float = 1.0


@dataclass(frozen=True, kw_only=True)
class LengthMaskConfig:
    """Masks out of the loss the responses longer than max_tokens tokens."""

    max_tokens: int
    only_incorrect: bool = False
    """Mask only long responses the reward worker did not judge correct (ROLL's error_max_len_clip)."""


@dataclass(frozen=True, kw_only=True)
class RewardShapingConfig:
    """What happens to the reward workers' scores before advantages (roll_core/algorithms/shaping.py), per
    domain: statistics never mix domains. Order: sample masks (on the raw scores), overlong penalty,
    normalisation, scaling, clipping. Truncated responses are masked by the scheduler instead:
    rewards.<domain>.response_filters: {truncated: {}} (DAPO's overlong filtering)."""

    norm_mean_type: str | None = None
    """Subtract the mean of the sample's `group` (prompt group), its domain's `batch`, or the domain's `running`
    moments over every step so far (kept per domain and checkpointed); None: no centring. ROLL's reward_norm."""
    norm_std_type: str | None = None
    """Divide by the std (+1e-6) of `group`, `batch` or `running`, as norm_mean_type; None: no division."""
    reward_scale: float = 1.0
    """Multiply the (normalised) scores by this."""
    reward_clip: float | None = None
    """Clip the scaled scores to [-reward_clip, reward_clip]; None: no clipping."""
    overlong_penalty: OverlongPenaltyConfig | None = None
    difficulty_mask: DifficultyMaskConfig | None = None
    length_mask: LengthMaskConfig | None = None

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.reward_clip is not None and self.reward_clip <= 0:
            yield "reward_clip", f"must be > 0 (or null), got {self.reward_clip}"
        if self.overlong_penalty is not None and self.overlong_penalty.buffer_len < 1:
            yield "overlong_penalty.buffer_len", "must be >= 1"
        if self.difficulty_mask is not None and self.difficulty_mask.low > self.difficulty_mask.high:
            yield "difficulty_mask", f"low ({self.difficulty_mask.low}) must be <= high ({self.difficulty_mask.high})"
        if self.length_mask is not None and self.length_mask.max_tokens < 1:
            yield "length_mask.max_tokens", "must be >= 1"


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
    """0: synchronous, each step generates with the weights it trains. 1: the next step's rollout is generated
    while this step trains, with the weights from before this step's update, so every batch is one update old
    (staleness exactly 1; more is not supported). Pair it with infer_is_cap."""
    infer_is_cap: float | None = None
    """Truncated importance sampling between the policy that generated a batch (actor_infer's log-probs of the
    tokens it sampled) and actor_train's policy before the update: each token's policy-gradient term is weighted
    by min(exp(old_log_prob - infer_log_prob), infer_is_cap) (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"). None: off. 2.0 is the usual cap. The offpolicy/* metrics are
    logged whenever actor_infer returns log-probs (async runs, or a cap set)."""
    deterministic: bool = False
    """Repeatable runs: the same config and seed give the same metrics bitwise on CPU, and a resumed run goes on
    exactly as the uninterrupted one would have. Each prompt's group is then generated on its own with a sampling
    seed of its own (no batching across prompts), and a domain's scheduler waits for every prompt it drew before
    it fills its share in draw order (no aborts). Slower; for debugging and for tests."""
    adv_estimator: str = "grpo"
    """Advantage estimator (roll_core/algorithms/advantages.py): `grpo` (group mean and std; DeepSeekMath,
    arXiv:2402.03300), `dr_grpo` (group mean only; Dr. GRPO, arXiv:2503.20783), `rloo` (leave-one-out group mean;
    arXiv:2402.14740), `reinforce_plus_plus` (discounted returns whitened over the batch; arXiv:2501.03262),
    `reinforce_plus_plus_baseline` (group mean, then batch whitening; arXiv:2501.03262) or `gae` (with the critic;
    arXiv:1506.02438)."""
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
        if self.async_generation_ratio not in (0.0, 1.0):
            yield "async_generation_ratio", f"must be 0 (synchronous) or 1 (one step ahead), got {self.async_generation_ratio}"
        if self.infer_is_cap is not None and self.infer_is_cap <= 0:
            yield "infer_is_cap", "must be > 0 (or null: off)"
        yield from self._validate_domains()
        if self.ppo_epochs < 1:
            yield "ppo_epochs", "must be >= 1"
        yield from self._validate_algorithms()
        yield from self._validate_batch_division()

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
                "cannot be on with async_generation_ratio 1: generation runs during the update, on its own GPUs",
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
    def needs_infer_log_probs(self) -> bool:
        """actor_infer returns the log-probs of what it samples (for the correction and the offpolicy metrics)."""
        return self.async_generation_ratio > 0 or self.infer_is_cap is not None

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
        others = [self.actor_train, self.reference if self.needs_reference else None, self.critic]
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
