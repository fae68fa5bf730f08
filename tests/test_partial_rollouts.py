"""Partial rollouts on actor_infer (hf): a weight sync that comes while a batch generates is loaded between two of
its tokens; the tokens before keep the version that sampled them, the ones after come from the new weights, and
the log-probs actor_infer returns for each token are those of the weights that sampled it.

The new weights here have the final norm's weight at zero: every logit is then 0 whatever the context (the KV
cache of the tokens before the sync included), so each token sampled after the sync has log-probability exactly
-log(vocabulary) under temperature 1: an independent value to check the returned log-probs against."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from roll_core.config import load_config
from roll_core.config.clusters import GeneratingArgs
from tests.conftest import EXAMPLES

SWAP_AT = 3
"""The sync lands after this many tokens."""


@pytest.fixture
def worker(tiny_model):
    from workers.actor_infer import ActorInferWorker

    threads = torch.get_num_threads()
    cfg = load_config(EXAMPLES / "math_code.yaml", [
        f"pretrain={tiny_model}", "async_generation_ratio=2", "infer_is_cap=2.0", "actor_infer.torch_threads=1",
    ]).config
    try:
        yield ActorInferWorker(pipeline_config=cfg, name="actor_infer", rank=0, world_size=1)
    finally:
        torch.set_num_threads(threads)  # the worker set its own


def code_prompt(worker) -> list[int]:
    tok = worker.strategy.tokenizer
    chat = [{"role": "user", "content": "Write a Python function `f(xs)` that returns the sum of xs plus 4."}]
    return tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))["input_ids"]


def flat_weights(worker) -> dict[str, torch.Tensor]:
    state = {k: v.clone() for k, v in worker.strategy.model.state_dict().items()}
    state["model.norm.weight"].zero_()
    return state


ARGS = GeneratingArgs(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0)


def generate_with_a_sync_after(worker, tokens: int | None, seed: int = 5) -> dict:
    """A seeded request of 3 samples; with `tokens`, a sync to version 1 (flat weights) is offered from another
    thread once the batch has sampled that many tokens, and the batch is held there until the offer is in."""
    real_apply = worker.swap.apply
    asked = []
    reached, flat = threading.Event(), flat_weights(worker)

    def apply(token: int | None = None) -> int:
        asked.append(token)
        if tokens is not None and len(asked) == tokens + 1:  # asked before the first token and after each
            reached.set()
            while worker.swap._pending is None:
                threading.Event().wait(0.001)
        return real_apply()

    worker.swap.apply = apply
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(worker.generate_request("r", [code_prompt(worker)], ARGS, 3, seed=seed))
    )
    thread.start()
    if tokens is not None:
        assert reached.wait(60)
        worker.update_weights(flat, 1)  # returns once the batch has loaded them
    thread.join(120)
    worker.swap.apply = real_apply
    return result


def test_a_sync_lands_between_two_tokens_of_the_generating_batch(worker):
    before = {k: v.clone() for k, v in worker.strategy.model.state_dict().items()}
    plain = generate_with_a_sync_after(worker, None)
    worker.strategy.model.load_state_dict(before)
    swapped = generate_with_a_sync_after(worker, SWAP_AT)
    mask = swapped["response_mask"]
    assert int((mask[:, SWAP_AT:].sum(-1) > 0).sum()) >= 2  # samples that went on past the sync (seed 5: two of 3)

    assert worker.weights_version == 1
    versions = swapped["token_versions"]
    assert versions.shape == mask.shape
    assert versions[:, :SWAP_AT].eq(0).all() and versions[:, SWAP_AT:].eq(1).all()
    assert plain["token_versions"].eq(0).all()
    # Before the sync: the same tokens and log-probs as without one (same seed, same weights).
    assert torch.equal(swapped["response_ids"][:, :SWAP_AT], plain["response_ids"][:, :SWAP_AT])
    assert torch.equal(swapped["infer_log_probs"][:, :SWAP_AT], plain["infer_log_probs"][:, :SWAP_AT])
    # After it: each token's log-prob is the flat weights' (uniform over the vocabulary), not the old ones'.
    vocabulary = worker.strategy.model.config.vocab_size
    after = swapped["infer_log_probs"][:, SWAP_AT:][mask[:, SWAP_AT:] > 0]
    assert torch.allclose(after, torch.full_like(after, -math.log(vocabulary)), atol=1e-5)
    assert not torch.allclose(plain["infer_log_probs"][:, SWAP_AT:SWAP_AT + 1], after.new_full((3, 1), -math.log(vocabulary)))


def test_a_request_naming_an_older_version_is_served_and_a_newer_one_is_refused(worker):
    from workers.actor_infer import StaleWeightsError

    worker.update_weights({k: v.clone() for k, v in worker.strategy.model.state_dict().items()}, 2)
    out = worker.generate_request("old", [code_prompt(worker)], ARGS, 1, seed=1, weights_version=1)
    assert out["token_versions"][out["response_mask"] > 0].eq(2).all()
    with pytest.raises(StaleWeightsError, match="holds weights version 2, the request needs 3"):
        worker.generate_request("new", [code_prompt(worker)], ARGS, 1, seed=1, weights_version=3)


def test_actor_infer_touches_its_model_on_one_thread_only(tiny_model, monkeypatch):
    """The model's load, every sync's load, generation and offloading all run on the batcher's thread, whichever Ray
    thread calls (workers/inference/request_batcher.py: a second thread that runs torch work makes OpenMP stop
    spinning, and each decoding step 35-40% slower on 2 cores)."""
    import workers.actor_infer as actor_infer

    seen: list[tuple[str, str]] = []

    def recorded(name, fn):
        def run(*args, **kwargs):
            seen.append((name, threading.current_thread().name))
            return fn(*args, **kwargs)
        return run

    def make(pipeline_config):
        strategy = real_make(pipeline_config)
        for name in ("load_state_dict", "generate", "sleep"):
            setattr(strategy, name, recorded(name, getattr(strategy, name)))
        return strategy

    real_make = actor_infer.make_infer_strategy
    monkeypatch.setattr(actor_infer, "make_infer_strategy", recorded("load", make))
    threads = torch.get_num_threads()
    cfg = load_config(EXAMPLES / "math_code.yaml", [f"pretrain={tiny_model}", "actor_infer.torch_threads=1"]).config
    try:
        worker = actor_infer.ActorInferWorker(pipeline_config=cfg, name="actor_infer", rank=0, world_size=1)
        worker.update_weights({k: v.clone() for k, v in worker.strategy.model.state_dict().items()}, 1)
        caller = threading.Thread(target=lambda: worker.generate_request("r", [code_prompt(worker)], ARGS, 2),
                                  name="ray-call")
        caller.start()
        caller.join(60)
        worker.offload()
    finally:
        torch.set_num_threads(threads)
    assert [name for name, _ in seen] == ["load", "load_state_dict", "generate", "sleep"]
    assert {thread for _, thread in seen} == {"actor_infer"}


# --------------------------------------------------------------------------- deterministic: partial_rollout_token


@pytest.fixture
def rule_worker(tiny_model):
    from workers.actor_infer import ActorInferWorker

    threads = torch.get_num_threads()
    cfg = load_config(EXAMPLES / "math_code.yaml", [
        f"pretrain={tiny_model}", "async_generation_ratio=2", "infer_is_cap=2.0", "actor_infer.torch_threads=1",
        "deterministic=true", f"partial_rollout_token={SWAP_AT}",
    ]).config
    try:
        yield ActorInferWorker(pipeline_config=cfg, name="actor_infer", rank=0, world_size=1)
    finally:
        torch.set_num_threads(threads)


def test_the_rule_places_the_switch_at_its_token_whenever_the_sync_arrives(rule_worker):
    """partial_rollout_token: a request launched with version 0 samples its first SWAP_AT tokens with 0 and the
    rest with 1, waiting at token SWAP_AT when 1 has not come; the same tokens and log-probs whether the sync came
    long after the request started or before it."""
    w = rule_worker
    start = {k: v.clone() for k, v in w.strategy.model.state_dict().items()}
    w.update_weights(start, 0)  # the driver's first sync under the rule (kept, not loaded: the model holds it)
    plain = w.generate_request("plain", [code_prompt(w)], ARGS, 3, seed=5, weights_version=0)
    assert plain["token_versions"].eq(0).all()

    late: dict = {}
    thread = threading.Thread(
        target=lambda: late.update(w.generate_request("late", [code_prompt(w)], ARGS, 3, 5, 0, SWAP_AT))
    )
    thread.start()
    thread.join(2.0)
    assert thread.is_alive() and not late  # waiting at token SWAP_AT for version 1
    w.update_weights(flat_weights_of(start), 1, 0)  # returns at once: the request loads them
    thread.join(120)
    assert w.weights_version == 1
    early = w.generate_request("early", [code_prompt(w)], ARGS, 3, 5, 0, SWAP_AT)  # both versions already held

    for key in ("response_ids", "response_mask", "infer_log_probs", "token_versions"):
        assert torch.equal(late[key], early[key]), key
    mask, versions = late["response_mask"], late["token_versions"]
    assert int((mask[:, SWAP_AT:].sum(-1) > 0).sum()) >= 2  # responses that went on past the switch
    assert versions[:, :SWAP_AT].eq(0).all() and versions[:, SWAP_AT:].eq(1).all()
    assert torch.equal(late["response_ids"][:, :SWAP_AT], plain["response_ids"][:, :SWAP_AT])
    assert torch.equal(late["infer_log_probs"][:, :SWAP_AT], plain["infer_log_probs"][:, :SWAP_AT])
    vocabulary = w.strategy.model.config.vocab_size
    after = late["infer_log_probs"][:, SWAP_AT:][mask[:, SWAP_AT:] > 0]
    assert torch.allclose(after, torch.full_like(after, -math.log(vocabulary)), atol=1e-5)
    # Version 0 is loaded again for a request that names it: the plain request's output comes back.
    again = w.generate_request("again", [code_prompt(w)], ARGS, 3, seed=5, weights_version=0)
    assert torch.equal(again["response_ids"], plain["response_ids"])
    # A sync that drops version 0 (no rollout in flight names it): a request naming it is an error, not served.
    w.update_weights(flat_weights_of(start), 2, 2)
    assert w.generate_request("newest", [code_prompt(w)], ARGS, 1, seed=5, weights_version=2)["token_versions"].eq(2).all()
    with pytest.raises(RuntimeError, match=r"weights version 0 was dropped \(versions held: \[2\]\)"):
        w.generate_request("dropped", [code_prompt(w)], ARGS, 1, seed=5, weights_version=0)


def flat_weights_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    flat = {k: v.clone() for k, v in state.items()}
    flat["model.norm.weight"].zero_()
    return flat
