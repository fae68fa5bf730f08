"""One update of a real actor_train worker (DeepSpeed, one rank) against the plain-loop objective of
tests/test_objective.py on the same model: the weights move by exactly AdamW's first step on that objective's
gradient. This holds the wiring of train_step (sampling temperature, old, reference and importance weights, masks,
mini- and micro-batches, the normaliser) and not only the objective's formula."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll_core.config import load_config
from roll_core.models.forward import response_logits
from roll_pipeline.distributed.cluster import Cluster
from tests.conftest import EXAMPLES
from tests.test_objective import objective_overrides, reference_objective
from tests.test_zero import SAMPLES, training_batch

TEMPERATURE = 0.7



def reference_log_probs(model, batch):
    """Log-probs and entropies of the response tokens under softmax(logits / T), one token at a time."""
    logits = response_logits(model, batch).float() / TEMPERATURE
    rows, width = batch["response_ids"].shape
    lp, ent = [], []
    for i in range(rows):
        lp_row, ent_row = [], []
        for t in range(width):
            logp = torch.log_softmax(logits[i, t], dim=-1)
            lp_row.append(logp[batch["response_ids"][i, t]])
            ent_row.append(-(logp.exp() * logp).sum())
        lp.append(torch.stack(lp_row))
        ent.append(torch.stack(ent_row))
    return torch.stack(lp), torch.stack(ent)


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "estimator", "mode"), [("ppo_clip", "k3", "seq-mean-token-mean"), ("cispo", "k2", "token-mean")])
def test_an_update_is_adams_first_step_on_the_plain_loop_gradient(loss, estimator, mode, local_ray, tiny_model):
    from workers.actor_train import ActorTrainWorker
    from workers.strategies.loading import load_tokenizer

    cfg = load_config(
        EXAMPLES / "math_code.yaml",
        [
            *objective_overrides(loss, estimator, mode),
            "rollout_batch_size=4",
            "num_return_sequences_in_group=4",
            # one mini-batch of 16 in two micro-batches of 8
            f"actor_train.training_args.per_device_train_batch_size={SAMPLES // 2}",
            "actor_train.training_args.gradient_accumulation_steps=2",
            "actor_train.training_args.warmup_steps=0",
            # AdamW's first step is then lr * g / (|g| + eps) with g the gradient: eps 1 makes it grow with |g|
            # (see tests/test_zero.py); no clipping, no weight decay
            "actor_train.training_args.learning_rate=1.0",
            "actor_train.training_args.adam_epsilon=1.0",
            "actor_train.training_args.max_grad_norm=1e9",
            "actor_train.training_args.weight_decay=0.0",
            "actor_train.torch_threads=1",
            f"actor_infer.generating_args.temperature={TEMPERATURE}",
        ],
    ).config
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.train()
    batch = training_batch(cfg, load_tokenizer(cfg.actor_train.model_args))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        current, _ = reference_log_probs(model, batch)
    shape = current.shape
    in_loss = torch.ones(SAMPLES)
    in_loss[5] = 0.0
    batch = batch.update(
        {
            "old_log_probs": (current + torch.randn(shape, generator=g) * 0.3) * batch["response_mask"],
            "ref_log_probs": (current + torch.randn(shape, generator=g) * 0.5) * batch["response_mask"],
            "infer_is_weights": torch.rand(shape, generator=g) * 1.5 + 0.2,
            "in_loss": in_loss,
        }
    )

    # the reference: the plain-loop objective's gradient, then AdamW's first step
    lp, ent = reference_log_probs(model, batch)
    objective, _ = reference_objective(loss, estimator, mode, lp, ent, batch)
    objective.backward()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    expected = {k: start[k] - p.grad / (p.grad.abs() + 1.0) for k, p in model.named_parameters()}

    cluster = Cluster(
        "actor_train", ActorTrainWorker, world_size=1, num_cpus=0, num_gpus=0,
        worker_kwargs={"pipeline_config": cfg, "total_optimizer_steps": 1}, env_vars={"OMP_NUM_THREADS": "1"},
    )
    try:
        cluster.init_process_group()
        cluster.call("initialize")
        cluster.dispatch("train_step", batch)
        weights = cluster.call_rank0("get_weights")
    finally:
        cluster.shutdown()
    moved = max(float((expected[k] - start[k]).abs().max()) for k in expected)
    assert moved > 1e-2, "the reference step moves the weights"
    worst = max(float((weights[k] - expected[k]).abs().max()) for k in expected)
    # Measured 2026-11-24 (deterministic; 3 runs): 3.0e-7 (ppo_clip), 2.0e-7 (cispo), float32 rounding of a
    # gradient summed in another order, on steps up to 0.67. Broken on purpose, each fails: the temperature left
    # out of train_step, its own log-probs taken as old although the batch brings them, the micro-batch's count as
    # the normaliser, in_loss left out of the loss mask.
    assert worst < 1e-5, worst
