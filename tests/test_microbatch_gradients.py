"""The train step cut by a token budget (training_args.max_tokens_per_microbatch) computes what fixed micro-batches
and one pass over the whole mini-batch compute: actor_train's and the critic's real objectives through the real
training loop, on the embedded model, with a stand-in for DeepSpeed that only runs backward (so the gradients
accumulate over the micro-batches as DeepSpeed's do before its step): the same loss and metrics, and every
parameter's gradient, under each loss_agg_mode, over long-tailed rows with a multi-turn row's tool tokens, a row out
of the loss, the KL loss and the entropy bonus."""

from __future__ import annotations

import pytest
import torch

from roll_core.config import ModelArgs, load_config
from roll_core.models.forward import batched_log_probs
from roll_core.models.microbatches import row_lengths, token_budget_plan
from roll_core.models.sampling import SamplingDistribution
from tests.conftest import EXAMPLES
from tests.test_microbatches import long_tailed_batch

ROWS = 12
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class BackwardOnly:
    """What the training loop calls on DeepSpeedTrainStrategy, with the model itself as the engine: backward
    accumulates into .grad, and nothing steps."""

    device = torch.device("cpu")

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = self.engine = model
        self.boundaries: list[bool] = []

    def reload(self) -> None:
        pass

    def set_boundary(self, last: bool) -> None:
        self.boundaries.append(last)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def grad_norm(self) -> float:
        return 0.0

    def lr(self) -> float:
        return 0.0


# (per_device_train_batch_size, gradient_accumulation_steps, max_tokens_per_microbatch, use_sequence_packing,
# sequence_length_round): one padded pass over the whole mini-batch, fixed micro-batches of 4 rows, and token budgets
# (60: a row of the longest response and the longest prompt is 52 tokens; the rows' plan is 6 micro-batches of 1-5
# rows), padded or packed; rounded up to multiples of 16 columns (the widest micro-batch then runs past the batch's
# 52 columns: zeros appended).
ONE_PASS = (ROWS, 1, None, False, 1)
# Measured 2026-12-07 (AMD EPYC Zen 4, 2 threads, 3 runs, bitwise the same each run) over every case here: the
# largest gradient difference 1.08e-6 of the largest gradient (actor_train, seq-mean-token-mean, budget 150), the
# largest loss or metric difference 1.9e-7 of its value (or of 1); the order of the sums and the attention's shapes
# (each micro-batch's own padding) change the rounding. The same on an Intel Xeon, where the packed cuts (sdpa row by
# row, as a packing section loads the model) came within 1.08e-6 and 1.7e-7 (2026-12-07, twice, the same each
# time). About 10x room for another processor's kernels. A micro-batch's loss divided by its own count instead of its mini-batch's is off by a factor (grad above 1e-1).
GRAD_RTOL = 1e-5
LOSS_RTOL = 2e-6
CUTS = {
    "fixed": (4, 3, None, False, 1), "budget_60": (4, 3, 60, False, 1), "budget_150": (4, 3, 150, False, 1),
    "packed": (4, 3, None, True, 1), "packed_budget_60": (4, 3, 60, True, 1), "budget_64_round_16": (4, 3, 64, False, 16),
}


def config(example: str, mode: str, cut: tuple[int, int, int | None, bool, int], section: str):
    rows, accumulation, budget, packed, round_to = cut
    return load_config(EXAMPLES / example, [
        "rollout_batch_size=3", "num_return_sequences_in_group=4", "ppo_epochs=1",
        f"loss_agg_mode={mode}", "data.prompt_length=9", "actor_infer.generating_args.max_new_tokens=43",
        "use_kl_loss=true", "kl_loss_coef=0.1", "entropy_loss_coef=0.01",
        f"{section}.training_args.per_device_train_batch_size={rows}",
        f"{section}.training_args.gradient_accumulation_steps={accumulation}",
        f"{section}.training_args.max_tokens_per_microbatch={'null' if budget is None else budget}",
        f"{section}.use_sequence_packing={str(packed).lower()}",
        f"{section}.training_args.sequence_length_round={round_to}",
        f"{section}.torch_threads={torch.get_num_threads()}",
        *(() if section == "actor_train" else (  # actor_train's own mini-batch must divide the step too
            f"actor_train.training_args.per_device_train_batch_size={ROWS}",
            "actor_train.training_args.gradient_accumulation_steps=1",
        )),
    ]).config


def training_batch(model: torch.nn.Module) -> tuple:
    """long_tailed_batch's 12 rows with what a train step reads: old log-probs off the model's by noise (so ratios
    clip), reference log-probs, advantages, values and returns; row 7 out of the loss."""
    g = torch.Generator().manual_seed(7)
    batch = long_tailed_batch(rows=ROWS, seed=3)
    with torch.no_grad():
        log_probs = batched_log_probs(model, batch, ROWS, SamplingDistribution())
    mask = batch["response_mask"]
    shape = mask.shape
    in_loss = torch.ones(ROWS)
    in_loss[7] = 0
    return batch.update({
        "old_log_probs": (log_probs + 0.3 * torch.randn(shape, generator=g)) * mask,
        "ref_log_probs": (log_probs - 0.2 * torch.randn(shape, generator=g)) * mask,
        "advantages": torch.randn(shape, generator=g) * mask,
        "values": torch.randn(shape, generator=g) * mask,
        "returns": torch.randn(shape, generator=g) * mask,
        "in_loss": in_loss,
    })


def train_once(worker_cls, cfg, model: torch.nn.Module, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One train_loop of `batch`; its metrics and every parameter's accumulated gradient."""
    worker = worker_cls(pipeline_config=cfg, total_optimizer_steps=1, name="t", rank=0, world_size=1)
    worker.strategy = BackwardOnly(model)
    model.zero_grad(set_to_none=True)
    metrics = worker.train_loop(batch)
    assert worker.strategy.boundaries[-1] and not any(worker.strategy.boundaries[:-1])
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.fixture(scope="module")
def models(tiny_model):
    """The policy and the value model as a section loads them, by use_sequence_packing (packed: sdpa row by row)."""
    from workers.strategies.loading import load_causal_lm, load_value_model

    args = ModelArgs(model_name_or_path=str(tiny_model))
    loaded = {}
    for packed in (False, True):
        torch.manual_seed(0)  # the value head is fresh: the same on both
        loaded[packed] = load_causal_lm(args, packed).train(), load_value_model(args, packed).train()
    return loaded


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cut_name", list(CUTS))
@pytest.mark.parametrize("section", ["actor_train", "critic"])
def test_a_step_cut_any_way_has_the_loss_and_gradient_of_one_pass(models, section, mode, cut_name):
    from workers.actor_train import ActorTrainWorker
    from workers.critic import CriticWorker

    packed = CUTS[cut_name][3]
    batch = training_batch(models[False][0])
    example, worker_cls, which = (
        ("math_code.yaml", ActorTrainWorker, 0) if section == "actor_train" else ("ppo_gae.yaml", CriticWorker, 1)
    )
    model = models[False][which]
    whole, whole_grads = train_once(worker_cls, config(example, mode, ONE_PASS, section), model, batch)
    model = models[packed][which]
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        cut, cut_grads = train_once(worker_cls, config(example, mode, CUTS[cut_name], section), model, batch)
    finally:
        hook.remove()
    rows_seen = [rows for rows, _ in shapes]
    assert (set(rows_seen) == {1}) == packed and len(rows_seen) >= 3, rows_seen  # packed: one row a micro-batch
    round_to = CUTS[cut_name][4]
    if round_to > 1:  # every width a multiple, one past the batch's own (zeros appended)
        widths = {width for _, width in shapes}
        assert all(width % round_to == 0 for width in widths) and max(widths) > 52, widths
    if packed and CUTS[cut_name][2]:  # one forward a micro-batch, cut by the tokens read
        assert len(rows_seen) == len(token_budget_plan(*row_lengths(batch), CUTS[cut_name][2], packed=True))
    assert whole_grads.keys() == cut_grads.keys() and len(whole_grads) == len(list(model.parameters()))
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    worst = max(float((whole_grads[k] - cut_grads[k]).abs().max()) for k in whole_grads)
    assert scale > 0.1, "the step has a gradient"
    reported = [k for k in whole if k.endswith(("loss", "entropy", "clipfrac", "kl"))]
    assert len(reported) >= (5 if section == "actor_train" else 2), reported
    loss_diff = max(abs(whole[k] - cut[k]) / max(abs(whole[k]), 1.0) for k in reported)
    assert worst / scale < GRAD_RTOL and loss_diff < LOSS_RTOL, (worst / scale, loss_diff)
    assert cut.keys() - whole.keys() == ({f"{worker_cls.metric_prefix}/rows_over_token_budget"} if CUTS[cut_name][2] else set())
    pad = f"{worker_cls.metric_prefix}/pad_frac"
    if packed:  # the tokens read alone
        assert cut[pad] == 0.0 < whole[pad]
    elif CUTS[cut_name][2] is None:  # fixed micro-batches run the batch's full widths, like the one pass
        assert cut[pad] == whole[pad] > 0.5
    else:
        assert cut[pad] < whole[pad] / 2, (cut[pad], whole[pad])
