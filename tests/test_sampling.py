"""The distribution generation samples from is the one the losses' log-probs describe (temperature, top-k, top-p).

The embedded model samples many first tokens for one fixed chat prompt through actor_infer's strategy; the
empirical frequencies are compared with the probabilities `batched_log_probs` (what actor_train and the reference
compute for the PPO ratio, the off-policy weights and the KL) gives every token of the vocabulary, by a chi-square
test."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from roll_core.batch import Batch
from roll_core.config import load_config
from roll_core.config.clusters import GeneratingArgs
from roll_core.models.forward import batched_log_probs
from roll_core.models.sampling import OUTSIDE_LOG_PROB, SamplingDistribution
from tests.conftest import EXAMPLES

SAMPLES = 4000


def chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, over the tokens expected >= 5 times plus one bin for all
    the others (left out when its own expectation is under 5)."""
    expected = probs.double() * n
    big = expected >= 5
    observed = [counts[big].double()]
    wanted = [expected[big]]
    if expected[~big].sum() >= 5:
        observed.append(counts[~big].sum().double()[None])
        wanted.append(expected[~big].sum()[None])
    obs, exp = torch.cat(observed), torch.cat(wanted)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def chi_square_quantile(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at the normal quantile `z` (3.719: 1 - 1e-4), by Wilson and Hilferty's cube
    approximation (within 1% of the exact value at dof 8: 32.3 against 31.8)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.fixture(scope="module")
def strategy(tiny_model):
    from workers.strategies.hf_infer import HFInferStrategy

    cfg = load_config(EXAMPLES / "math_code.yaml", [f"actor_infer.model_args.model_name_or_path={tiny_model}"])
    return HFInferStrategy(cfg.config.actor_infer)


@pytest.mark.parametrize(
    "temperature, top_p, top_k",
    [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 8)],
    ids=["full", "top_p", "top_k"],
)
def test_sampled_token_frequencies_match_the_log_probs_the_losses_use(strategy, temperature, top_p, top_k):
    assert_sampling_matches_the_log_probs(strategy, temperature, top_p, top_k)


def assert_sampling_matches_the_log_probs(strategy, temperature: float, top_p: float, top_k: int, model=None) -> None:
    """The check itself, on the strategy's device (tests/test_gpu_device_paths.py runs it on a GPU). The
    log-probs come from `model` (default: the strategy's own; tests/test_vllm_engine.py gives the trainer's
    model, vLLM holding its own)."""
    model = strategy.model if model is None else model
    args = GeneratingArgs(max_new_tokens=1, temperature=temperature, top_p=top_p, top_k=top_k)
    ids = strategy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True, tokenize=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    prompt = torch.tensor([list(ids)])
    mask = torch.ones_like(prompt)
    vocab = model.config.vocab_size
    every_token = Batch(
        {
            "prompt_ids": prompt.repeat(vocab, 1),
            "prompt_mask": mask.repeat(vocab, 1),
            "response_ids": torch.arange(vocab)[:, None],
            "response_mask": torch.ones(vocab, 1),
        }
    )
    log_probs = batched_log_probs(model, every_token, 512, SamplingDistribution.of(args))[:, 0]
    probs = log_probs.exp() * (log_probs > OUTSIDE_LOG_PROB)
    assert abs(float(probs.sum()) - 1.0) < 1e-4

    out = strategy.generate(prompt, mask, args, SAMPLES, seed=0)
    counts = torch.bincount(out["response_ids"][:, 0], minlength=vocab)
    assert not bool((counts[probs == 0] > 0).any()), "a token the log-probs call impossible was sampled"
    statistic, dof = chi_square(counts, probs, SAMPLES)
    # Measured 2026-11-26 over seeds 0-5 (4000 samples each; the test's seed 0 is deterministic): full 5.6-13.8
    # (dof 8), top_p 0.0-4.3 (dof 1), top_k 3.4-14.7 (dof 8). With the log-probs of the full tempered softmax (the
    # truncation left out of the losses): top_p 74.7-79.1, top_k 1075-1089; with the temperature left out as well,
    # 441-444 and 458-621. The bound is the chi-square quantile at 1 - 1e-4: 15.7 (dof 1), 32.3 (dof 8). Seen to
    # fail with the truncation left out of SamplingDistribution.log_probs: top_p 74.7 (dof 5), top_k 1089 (dof 22).
    assert statistic < chi_square_quantile(dof), (statistic, dof)


def test_a_token_outside_the_kept_set_gets_the_floor_and_no_gradient():
    logits = torch.tensor([[[4.0, 3.0, 0.0, -2.0]]], requires_grad=True)
    dist = SamplingDistribution(top_k=2)
    log_probs, entropy = dist.log_probs(logits, torch.tensor([[3]]), with_entropy=True)
    assert float(log_probs.detach()) == OUTSIDE_LOG_PROB
    assert torch.isfinite(entropy).all()
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 0, 2:].abs().sum() == 0  # the dropped tokens take no part
    kept, _ = dist.log_probs(logits, torch.tensor([[0]]))
    assert math.isclose(float(kept.detach()), -math.log1p(math.exp(-1.0)), rel_tol=1e-6)  # renormalised over the top 2


def test_sharing_the_prefill_samples_what_generate_samples(strategy):
    """actor_infer prefills each prompt once for its whole group (generate_sharing_prefill). On left-padded
    prompts of different lengths, with the same seed, it must give generate's own tokens and, at every step, the
    same sampling distribution (scores): a cache at the wrong positions or repeated in the wrong order would not."""
    from transformers import GenerationConfig

    from roll_core.data.loading import collate_prompts
    from workers.strategies.hf_infer import generate_sharing_prefill

    tok = strategy.tokenizer
    texts = ["What is 3 + 4?", "Add 12 and 30, then tell me the sum.", "7 * 6?"]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    prompts = [tok(chat)["input_ids"] for chat in chats]
    assert len({len(p) for p in prompts}) == 3  # different lengths: the batch is left-padded
    ids, mask = collate_prompts(prompts, strategy.pad_id)
    gen = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=4,
        eos_token_id=strategy.eos_ids, pad_token_id=strategy.pad_id,
    )
    outs = []
    for run in (strategy.model.generate, lambda **kw: generate_sharing_prefill(strategy.model, **kw)):
        torch.manual_seed(7)
        outs.append(
            run(input_ids=ids, attention_mask=mask, generation_config=gen, return_dict_in_generate=True,
                output_scores=True)
        )
    plain, shared = outs
    assert shared.sequences.shape[0] == 12
    assert torch.equal(shared.sequences, plain.sequences)
    # measured 2026-11-26, seeds 7-9: tokens equal, scores within 2.1e-6 to 2.9e-6 (a batch of 3 prefilled instead
    # of 12 sums in another order); the bound leaves room for another processor
    for a, b in zip(plain.scores, shared.scores, strict=True):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        assert torch.allclose(a[finite], b[finite], atol=1e-4)


def test_the_floor_is_the_documented_minus_30():
    # -30 nats, probability ~9.4e-14: low enough never to stand for a token the sampler could draw, high enough
    # that exp(new - old) and the KL of a floored token stay finite in float32 (its docstring).
    assert OUTSIDE_LOG_PROB == -30.0
    assert torch.exp(torch.tensor(0.0) - OUTSIDE_LOG_PROB).isfinite()  # a kept token over a floored one, float32


def test_the_defaults_are_the_full_tempered_softmax():
    """No top-k (0) and no top-p (1.0) by default: nothing truncated, so no floor either; a token with log-prob
    below the floor keeps its own value there."""
    assert SamplingDistribution() == SamplingDistribution(temperature=1.0, top_k=0, top_p=1.0)
    assert not SamplingDistribution().truncates and not SamplingDistribution(temperature=0.5).truncates
    assert SamplingDistribution(top_k=1).truncates and SamplingDistribution(top_p=0.99).truncates
    logits = torch.tensor([[[0.0, -60.0, 1.0], [2.0, 0.0, -45.0]]])
    tokens = torch.tensor([[1, 2]])
    log_probs, entropy = SamplingDistribution().log_probs(logits, tokens)
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert expected.max() < OUTSIDE_LOG_PROB  # both far below the floor
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=0)
    assert entropy is None  # only computed when asked
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingDistribution().top_k = 4  # a distribution shared by the losses cannot be changed under them


def test_top_k_of_one_keeps_only_the_most_likely_token():
    logits = torch.tensor([[[1.0, 3.0, 2.0], [5.0, 0.0, 4.9]]])
    log_probs, _ = SamplingDistribution(top_k=1).log_probs(logits, torch.tensor([[1, 2]]))
    assert log_probs.tolist() == [[0.0, OUTSIDE_LOG_PROB]]
    assert SamplingDistribution(top_k=1).kept(logits).tolist() == [[[False, True, False], [True, False, False]]]


def test_log_probs_and_entropies_of_a_batch_are_taken_per_position():
    """(B, R, V) logits, (B, R) tokens with B != R: each position's log-prob of its own token and the entropy
    of its own distribution, truncated or not (renormalised over the kept tokens; dropped ones add nothing)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=gen) * 2
    tokens = torch.randint(0, 7, (2, 3), generator=gen)
    for dist in (SamplingDistribution(temperature=0.7), SamplingDistribution(temperature=0.7, top_k=3)):
        dropped = 0
        log_probs, entropy = dist.log_probs(logits, tokens, with_entropy=True)
        assert log_probs.shape == entropy.shape == (2, 3)
        for b in range(2):
            for r in range(3):
                scaled = logits[b, r] / 0.7
                if dist.top_k:
                    scaled = scaled.masked_fill(scaled < scaled.topk(3).values[-1], float("-inf"))
                p = torch.softmax(scaled, -1)
                kept = p > 0
                dropped += int(p[tokens[b, r]] == 0)
                want_lp = math.log(float(p[tokens[b, r]])) if p[tokens[b, r]] > 0 else OUTSIDE_LOG_PROB
                want_h = -float((p[kept] * p[kept].log()).sum())
                assert math.isclose(float(log_probs[b, r]), want_lp, rel_tol=1e-5, abs_tol=1e-6), (dist, b, r)
                assert math.isclose(float(entropy[b, r]), want_h, rel_tol=1e-5, abs_tol=1e-6), (dist, b, r)
        # the truncated pass meets tokens outside the kept set (the floor's branch), the full one none
        assert (dropped > 0) == dist.truncates, (dist, dropped)


def test_the_entropy_carries_a_gradient_only_when_asked():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    dist = SamplingDistribution(top_p=0.9)
    assert dist.log_probs(logits, tokens, with_entropy=True)[1].requires_grad  # the default: an entropy bonus trains
    assert not dist.log_probs(logits, tokens, with_entropy=True, entropy_grad=False)[1].requires_grad  # logging
    with torch.no_grad():
        assert not dist.log_probs(logits, tokens, with_entropy=True)[1].requires_grad


# ---------------------------------------------------------------------------------------------- stop strings


def first_end(tokenizer, tokens: list[int], stops: tuple[str, ...]) -> int | None:
    """The response length at which the whole decoded text first ends with a stop string (None: never)."""
    for j in range(1, len(tokens) + 1):
        if any(tokenizer.decode(tokens[:j]).endswith(stop) for stop in stops):
            return j
    return None


def assert_cut_at_the_stop(tokenizer, plain, stopped, stops):
    """`stopped` (generated with `stops`) is `plain` (greedy, without them) up to each row's first stop."""
    met = 0
    for row in range(plain["response_ids"].shape[0]):
        tokens = plain["response_ids"][row][plain["response_mask"][row] > 0].tolist()
        end = first_end(tokenizer, tokens, stops)
        kept = stopped["response_ids"][row][stopped["response_mask"][row] > 0].tolist()
        if end is None:
            assert kept == tokens and stopped["finish_reason"][row] == plain["finish_reason"][row]
        else:
            met += 1
            assert kept == tokens[:end] and stopped["finish_reason"][row] == "stop", (row, end)
            assert int(stopped["response_mask"][row].sum()) == end
    return met


def test_a_stop_string_ends_a_response_where_its_text_first_ends_with_it(strategy):
    args = GeneratingArgs(do_sample=False, max_new_tokens=24)
    chat = [[{"role": "user", "content": text}] for text in ("12+7=", "3+4=", "40+2=", "9+9=")]
    encoded = strategy.tokenizer.apply_chat_template(chat, add_generation_prompt=True, padding=True,
                                                     return_tensors="pt", return_dict=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    plain = strategy.generate(ids, mask, args, 1, with_log_probs=True)
    first = plain["response_ids"][0][plain["response_mask"][0] > 0].tolist()
    assert len(first) >= 3  # two tokens and the end of the answer
    # stops taken from row 0's own text: its second token's text, its first two tokens' (a stop across tokens),
    # and one that never occurs
    for stops in [
        (strategy.tokenizer.decode(first[1:2]), "\x00never"),
        (strategy.tokenizer.decode(first[:2]),),
    ]:
        stopped = strategy.generate(ids, mask, dataclasses.replace(args, stop=stops), 1, with_log_probs=True)
        assert assert_cut_at_the_stop(strategy.tokenizer, plain, stopped, stops) >= 1
        # the stopped batch is as wide as its longest row, which may be narrower than the plain one's
        kept, width = stopped["response_mask"] > 0, stopped["response_ids"].shape[1]
        assert torch.equal(stopped["infer_log_probs"][kept], plain["infer_log_probs"][:, :width][kept])
        assert not stopped["infer_log_probs"][~kept].any()
        assert (stopped["response_ids"][~kept] == strategy.pad_id).all()
