"""The clusters' sections (`actor_train`, `actor_infer`, `reference`, `critic`): the model, the training and
generating arguments, the strategy, and where each cluster's workers go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from roll_core.config.devices import parse_device_mapping


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    model_name_or_path: str | None = None
    """A local Hugging Face model folder (or a hub id where the hub is reachable). None: the top-level `pretrain`.
    A relative path is taken relative to the config file's folder; write it as ./dir/name when it could be
    mistaken for a hub id (an `org/name` that does not exist there)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = False
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] | None = None
    """transformers' attention kernel for this model (`from_pretrained(attn_implementation=...)`); None: its default
    (sdpa; with the section's use_sequence_packing, sdpa row by row). flash_attention_2 needs the flash-attn package
    and a CUDA GPU (`roll run --dry-run` checks); with use_sequence_packing it runs packed rows through its
    variable-length kernel."""


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
    max_tokens_per_microbatch: int | None = None
    """Cut each mini-batch (per_device_train_batch_size x gradient_accumulation_steps rows, one optimizer step) into
    micro-batches by tokens instead of per_device_train_batch_size rows (ROLL's max_tokens_per_microbatch_in_train
    with use_dynamic_batching_in_train, verl's ppo_max_token_len_per_gpu): rows longest first, each micro-batch
    padded only to its own longest prompt and response and holding at most this many tokens, padding included; a
    row longer than it runs alone (counted in `<worker>/rows_over_token_budget`). The loss and its gradient are
    those of fixed micro-batches under every loss_agg_mode (each micro-batch's loss is divided by its mini-batch's
    count). Data-parallel ranks run as many micro-batches as the rank that needs most. Must hold one row of
    data.prompt_length + max_new_tokens (checked at load). None: per_device_train_batch_size rows at a time."""
    sequence_length_round: int = 1
    """With max_tokens_per_microbatch: each micro-batch's width (its longest prompt + longest response) padded up to
    a multiple of this (ROLL's sequence_length_round_in_train): fewer distinct shapes, and widths GPU kernels
    prefer (e.g. 64 or 128); the budget counts the rounded width. 1: no rounding. Not with use_sequence_packing (a
    packed micro-batch has no padding to round)."""
    max_grad_norm: float = 1.0

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.learning_rate <= 0:
            yield "learning_rate", f"must be > 0, got {self.learning_rate}"
        if self.per_device_train_batch_size < 1:
            yield "per_device_train_batch_size", "must be >= 1"
        if self.gradient_accumulation_steps < 1:
            yield "gradient_accumulation_steps", "must be >= 1"
        if self.max_tokens_per_microbatch is not None and self.max_tokens_per_microbatch < 1:
            yield "max_tokens_per_microbatch", "must be >= 1 (or null: per_device_train_batch_size rows at a time)"
        yield from rounding_problems(self.sequence_length_round, self.max_tokens_per_microbatch,
                                     "sequence_length_round", "max_tokens_per_microbatch")
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


#: The linear layers of a Llama/Qwen2-style decoder block: attention's four projections and the MLP's three.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


#: The ranks vLLM's engine can be sized for (`max_lora_rank`); an adapter of a smaller rank fits a larger slot.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True, kw_only=True)
class LoraArgs:
    """LoRA adapters (arXiv:2106.09685, with the `peft` package) on a trained cluster: the base weights stay frozen
    and only the adapters (and, for the critic, its value head) are trained. The reference is then the base model
    with the adapter disabled, computed by actor_train (no reference cluster, no second copy of the weights)."""

    rank: int = 8
    """The adapters' rank r (each targeted linear layer W gains B @ A, with A of r x in and B of out x r)."""
    alpha: float = 16.0
    """The adapters' scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0: none, so that a training forward gives the same
    log-probs as the generator's)."""
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS
    """Names (last component) of the linear layers that get an adapter."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if type(self.rank) is not int or self.rank < 1:
            yield "rank", f"must be a whole number >= 1, got {self.rank!r}"
        if not self.alpha > 0:
            yield "alpha", f"must be > 0, got {self.alpha}"
        if not 0 <= self.dropout < 1:
            yield "dropout", f"must be in [0, 1), got {self.dropout}"
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            yield "target_modules", f"must be a non-empty list of layer names, got {list(self.target_modules)!r}"

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True)
class GeneratingArgs:
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    do_sample: bool = True
    """False is greedy decoding (temperature, top_p and top_k are then ignored)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response where its text first ends with one of them (kept in the response, finish
    reason `stop`), as an end-of-sequence token does; a multi-turn rollout ends a turn at its tool call's closing
    tag this way."""

    def validate(self) -> Iterator[tuple[str, str]]:
        if self.max_new_tokens < 1:
            yield "max_new_tokens", "must be >= 1"
        if not all(isinstance(s, str) and s for s in self.stop):
            yield "stop", f"must be a list of non-empty strings, got {list(self.stop)!r}"
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


WEIGHT_TRANSPORTS = {"rpc": None, "nccl": "nccl", "ipc": "roll_ipc", "gloo": "roll_gloo"}
"""vLLM's strategy_config.weight_transport: how weight syncs reach the engine, and the backend of vLLM's
weight-transfer API each one uses (rpc: none, the weights go through Ray and collective_rpc; roll_ipc is vLLM's
IPC engine taking handles without pickle, workers/strategies/ipc_transfer.py)."""


def custom_resource_problems(resources: dict[str, float]) -> Iterator[tuple[str, str]]:
    """Problems of a section's `resources` (custom Ray resources per worker)."""
    for name, amount in resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            yield "resources", f"{name!r} is set by num_cpus_per_worker / num_gpus_per_worker, not resources"
        elif not isinstance(amount, int | float) or isinstance(amount, bool) or not amount > 0:
            yield "resources", f"{name}: must be a number > 0, got {amount!r}"


def rounding_problems(round_to: int, budget: int | None, key: str, budget_key: str) -> Iterator[tuple[str, str]]:
    """A sequence-length rounding: at least 1, and above 1 only where micro-batches are cut by a token budget
    (fixed micro-batches run the whole batch's width)."""
    if round_to < 1:
        yield key, f"must be >= 1 (1: no rounding), got {round_to}"
    elif round_to > 1 and budget is None:
        yield key, f"rounds the micro-batches of a token budget: set {budget_key}, or 1"


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
    infer_max_tokens_per_microbatch: int | None = None
    """Cut those forward passes' micro-batches by tokens instead (ROLL's max_tokens_per_microbatch_in_infer with
    use_dynamic_batching_in_infer, verl's log_prob_max_token_len_per_gpu): rows longest first, each micro-batch
    padded only to its own longest prompt and response and holding at most this many tokens, padding included; a
    row longer than it runs alone. Must hold one row of data.prompt_length + max_new_tokens (checked at load).
    None: infer_batch_size rows at a time, padded to the batch's longest row."""
    infer_sequence_length_round: int = 1
    """With infer_max_tokens_per_microbatch: each of those micro-batches' width padded up to a multiple of this
    (ROLL's sequence_length_round_in_infer; see training_args.sequence_length_round). 1: no rounding."""
    use_sequence_packing: bool = False
    """Run each micro-batch's rows packed into one sequence of the tokens they read, no padding (ROLL's
    use_sequence_packing, verl's use_remove_padding): position ids restart at each row, and attention stays inside
    each row: FlashAttention's variable-length kernel with model_args.attn_implementation flash_attention_2 (GPU);
    with no kernel named, or sdpa, the model loads with sdpa row by row (one sdpa call per packed row; eager and other
    named kernels are kept and mask across rows). For the forward passes without gradient and, on actor_train and
    critic, the train step. A token budget then counts the tokens read; a packed micro-batch runs each row's prompt
    (no prompt shared among a group's rows). The results equal those of padded micro-batches up to rounding
    (docs/micro-batches.md)."""
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
        if self.infer_max_tokens_per_microbatch is not None and self.infer_max_tokens_per_microbatch < 1:
            yield "infer_max_tokens_per_microbatch", "must be >= 1 (or null: infer_batch_size rows at a time)"
        yield from rounding_problems(self.infer_sequence_length_round, self.infer_max_tokens_per_microbatch,
                                     "infer_sequence_length_round", "infer_max_tokens_per_microbatch")
        if self.use_sequence_packing and self.infer_sequence_length_round > 1:
            yield "infer_sequence_length_round", "use_sequence_packing runs no padding to round: set 1"
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
    lora: LoraArgs | None = None
    """Train LoRA adapters instead of the full weights (null: full weights). See LoraArgs."""

    def validate(self) -> Iterator[tuple[str, str]]:
        yield from super().validate()
        if self.strategy_args.strategy_name not in TRAIN_STRATEGIES:
            yield "strategy_args.strategy_name", f"must be one of {list(TRAIN_STRATEGIES)}"
        if self.use_sequence_packing and self.training_args.sequence_length_round > 1:
            yield "training_args.sequence_length_round", "use_sequence_packing runs no padding to round: set 1"
        if self.lora is not None and self.zero_stage == 3:
            yield "lora", "LoRA runs with DeepSpeed ZeRO stages 0-2 (zero_optimization.stage 3 shards the frozen base too)"

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

    @property
    def weight_bucket_bytes(self) -> int:
        """vLLM's strategy_config.weight_bucket_mb (256 when unset) in bytes: the most tensor data one part of a
        weight sync carries."""
        return int(float(self.strategy_args.strategy_config.get("weight_bucket_mb", 256)) * 2**20)

    @property
    def weight_transport(self) -> str:
        """strategy_config.weight_transport (vLLM; `rpc` when unset or for the transformers engine)."""
        return self.strategy_args.strategy_config.get("weight_transport", "rpc")

    def validate(self) -> Iterator[tuple[str, str]]:
        yield from super().validate()
        if self.strategy_args.strategy_name not in INFER_STRATEGIES:
            yield "strategy_args.strategy_name", f"must be one of {list(INFER_STRATEGIES)}"
        if self.use_sequence_packing:
            yield "use_sequence_packing", (
                "actor_infer generates, and its engine batches the sequences itself: packing is for actor_train, "
                "reference and critic"
            )
        transport = self.weight_transport
        key = "strategy_args.strategy_config.weight_transport"
        if transport not in WEIGHT_TRANSPORTS:
            yield key, f"must be one of {list(WEIGHT_TRANSPORTS)}, got {transport!r}"
        elif transport != "rpc" and self.strategy_args.strategy_name != "vllm":
            yield key, f"{transport} is vLLM's weight-transfer API: it needs strategy_name vllm"
        elif transport in ("nccl", "ipc") and self.num_gpus_per_worker <= 0:
            yield key, f"{transport} moves GPU tensors: actor_infer needs GPUs (num_gpus_per_worker > 0)"


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
