"""The `reward_model` reward worker on the embedded tiny reward model (`make reward-model` builds it): it scores
through the generic RewardWorker in the worker's own process, reads the conversation through its own chat
template, and masks only what the policy cannot cause."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from roll_core.rewards.scored import MASK_ERROR
from roll_pipeline.models.tiny_reward import pairs
from tests.conftest import EXAMPLES
from workers.devices import NoGPUError
from workers.rewards.reward_model import RewardModelScorer, render_conversation
from workers.rewards.worker import RewardWorker

RM = EXAMPLES / "models" / "tiny-qwen2-rm"


@pytest.fixture(scope="module")
def reward_model():
    if not (RM / "config.json").exists():
        pytest.fail(f"{RM} is missing: run `roll model build tiny-qwen2-rm` (make test does it) before the tests")
    return RM


@pytest.fixture(scope="module")
def val_pairs():
    rows = [json.loads(line) for line in (EXAMPLES / "data" / "math_val.jsonl").read_text().splitlines()]
    return pairs(rows[:60], random.Random(7), max_shift=10)


def samples(pairs_, which: int) -> list[dict]:
    return [{"response": answers[which], "ground_truth": None, "prompt_messages": messages}
            for messages, *answers in pairs_]


def test_the_worker_scores_right_sums_above_wrong_ones(reward_model, val_pairs):
    with RewardWorker("math", "reward_model", {"model_path": str(reward_model), "batch_size": 16}) as worker:
        right = worker.score_batch(samples(val_pairs, 0))
        wrong = worker.score_batch(samples(val_pairs, 1))
        assert worker.stats()["scored"] == 2 * len(val_pairs)
    assert not any(r.masked for r in right + wrong)
    above = sum(r.score > w.score for r, w in zip(right, wrong, strict=True)) / len(val_pairs)
    # The build's own held-out pairwise accuracy (300 pairs, build_info.json) was 0.87-0.93 over seeds 0-3
    # (2026-11-26); these 60 pairs gave 0.93 on seed 0's build. An untrained head (the build's step 0) scores
    # pairs at chance, 0.51 held-out.
    assert above >= 0.75, above
    assert all(r.metrics["rm_logit"] == r.score for r in right)  # scale 1, shift 0
    assert sum(r.correct for r in right) > sum(w.correct for w in wrong)  # correct: logit >= 0


def test_the_token_head_reads_the_last_valid_tokens_logit_as_the_sequence_head_pools_it(reward_model, val_pairs):
    """Read as a token-classification model (its head has the same name and shape), the logit of the last valid
    token of each right-padded row is the sequence head's pooled score."""
    batch = samples(val_pairs[:20], 0)
    scores = {}
    for head in ("sequence", "token"):
        scorer = RewardModelScorer(model_path=str(reward_model), head=head, batch_size=7)
        scorer.load(torch.device("cpu"))
        scores[head] = [r.score for r in scorer.score_batch(batch)]
    assert scores["token"] == pytest.approx(scores["sequence"], abs=1e-5)
    assert len(set(scores["sequence"])) > 1


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_packed_conversations_score_as_padded_ones(reward_model, val_pairs, head):
    """options.packing: each micro-batch's conversations as one row, positions restarting, attention row by row;
    the scores those of the padded micro-batches (7 rows of unequal lengths each, so every packed row holds
    several conversations and every padded one padding). Measured (2026-12-07): at most 9.5e-7 apart (2 float32 ulps at the largest score, 4.3)."""
    from roll_core.models.row_attention import ROW_ATTENTION

    batch = samples(val_pairs[:20], 0) + samples(val_pairs[20:30], 1)
    scores = {}
    for packing in (False, True):
        scorer = RewardModelScorer(model_path=str(reward_model), head=head, batch_size=7, packing=packing)
        scorer.load(torch.device("cpu"))
        assert (scorer.model.config._attn_implementation == ROW_ATTENTION) is packing
        scores[packing] = torch.tensor([r.score for r in scorer.score_batch(batch)])
    assert torch.allclose(scores[True], scores[False], rtol=0, atol=2e-6), (scores[True] - scores[False]).abs().max()
    assert len(set(scores[True].tolist())) > 1


def test_packing_runs_one_row_a_micro_batch_and_keeps_rows_apart_under_eager_attention(reward_model, val_pairs):
    """The packed path is the one that runs (one row per forward, 7 conversations in it), and with eager attention
    (transformers' block-diagonal mask, found from the restarting positions only without a cache) the scores are
    the padded ones too."""
    batch = samples(val_pairs[:14], 0)
    scores, rows = {}, {}
    for packing, kernel in ((False, None), (True, "eager")):
        scorer = RewardModelScorer(model_path=str(reward_model), head="sequence", batch_size=7, packing=packing,
                                   attn_implementation=kernel)
        scorer.load(torch.device("cpu"))
        rows[packing] = []
        scorer.model.base_model.register_forward_pre_hook(
            lambda _, args, kwargs, seen=rows[packing]: seen.append(kwargs.get("input_ids", args[0] if args else None).shape[0]),
            with_kwargs=True,
        )
        scores[packing] = torch.tensor([r.score for r in scorer.score_batch(batch)])
    assert rows == {False: [7, 7], True: [1, 1]}
    assert torch.allclose(scores[True], scores[False], rtol=0, atol=2e-6), (scores[True] - scores[False]).abs().max()


@pytest.mark.parametrize("head", ["sequence", "token"])
def test_packing_a_sequence_head_needs_its_score_layer(reward_model, monkeypatch, head):
    """A sequence head is read through the model's `score` layer when packed: a model without one is refused at
    load, naming the option, and loads unpacked; a token head reads its logits and needs no such layer."""
    import transformers

    for auto in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification"):
        loader = getattr(transformers, auto).from_pretrained

        def without_score(*args, _loader=loader, **kwargs):
            model = _loader(*args, **kwargs)
            model.classifier = model.score  # as BERT-like heads name it
            del model.score
            return model

        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", without_score)
    RewardModelScorer(model_path=str(reward_model), head=head).load(torch.device("cpu"))
    packed = RewardModelScorer(model_path=str(reward_model), head=head, packing=True)
    if head == "token":
        packed.load(torch.device("cpu"))
        return
    with pytest.raises(ValueError, match="set options.packing to false") as error:
        packed.load(torch.device("cpu"))
    assert "Qwen2ForSequenceClassification lacks" in str(error.value)


def test_the_conversation_goes_through_the_reward_models_own_template():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLES / "models" / "tiny-qwen2")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert render_conversation(tokenizer, messages, "", "5") == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )
    tokenizer.chat_template = None  # a reward model without a template reads plain text
    assert render_conversation(tokenizer, None, "What is 2 + 3?", "5") == "What is 2 + 3?\n5"


def test_every_response_gets_a_score_and_only_a_failing_model_masks(reward_model, monkeypatch):
    with RewardWorker("math", "reward_model", {"model_path": str(reward_model)}) as worker:
        (empty,) = worker.score_batch([{"response": "", "ground_truth": None, "prompt": "What is 2 + 3?"}])
        assert not empty.masked  # whatever the policy writes is judged
        model = worker._scorer.model

        def broken(**inputs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(worker._scorer, "model", broken)
        masked = worker.score_batch([{"response": "5", "ground_truth": None, "prompt": "2 + 3"}] * 3)
        assert [r.mask_reason for r in masked] == [MASK_ERROR] * 3
        monkeypatch.setattr(worker._scorer, "model", model)
        nan = worker._scorer.model.score.weight.data
        monkeypatch.setattr(worker._scorer.model.score.weight, "data", torch.full_like(nan, float("nan")))
        assert [r.mask_reason for r in worker.score_batch([{"response": "5", "ground_truth": None}])] == [MASK_ERROR]
        assert worker.stats()["masked_error"] == 4


def test_bad_options_and_devices_are_named(tmp_path, reward_model):
    with pytest.raises(ValueError, match="options.model_path must name"):
        RewardModelScorer()
    with pytest.raises(ValueError, match=r"not a model folder .*: build it with `roll model build tiny-qwen2-rm`"):
        RewardModelScorer(model_path=str(tmp_path / "tiny-qwen2-rm"))
    with pytest.raises(ValueError, match=r"not a model folder .*: a folder written by save_pretrained"):
        RewardModelScorer(model_path=str(tmp_path))
    with pytest.raises(ValueError, match="head must be one of"):
        RewardModelScorer(model_path=str(reward_model), head="pooled")
    policy = RewardModelScorer(model_path=str(EXAMPLES / "models" / "tiny-qwen2"))
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM.*not a \.\.\.ForSequenceClassification"):
        policy.load(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(NoGPUError, match=r"reward worker 'math': .*num_gpus_per_worker=1"):
            RewardWorker("math", "reward_model", {"model_path": str(reward_model)}, num_gpus=1)


def built(name: str) -> str:
    """`name` as a string of its own, as a YAML file's options give it (not the interned literal)."""
    return "".join(list(name))


def test_the_documented_defaults_and_the_option_checks(reward_model):
    """The module docstring's defaults; each bound refused just past it and taken at it; options by keyword only."""
    scorer = RewardModelScorer(model_path=str(reward_model))
    assert (scorer.batch_size, scorer.max_length, scorer.head, scorer.dtype) == (16, 1024, "auto", "float32")
    assert (scorer.scale, scorer.shift, scorer.correct_threshold) == (1.0, 0.0, 0.0)
    assert (scorer.packing, scorer.attn_implementation) == (False, None)
    with pytest.raises(ValueError, match="packing must be true or false, got 'yes'"):
        RewardModelScorer(model_path=str(reward_model), packing="yes")
    with pytest.raises(ValueError, match="attn_implementation must be a kernel's name, got 2"):
        RewardModelScorer(model_path=str(reward_model), attn_implementation=2)
    RewardModelScorer(model_path=str(reward_model), batch_size=1, max_length=2)
    for bad in ({"batch_size": 0}, {"max_length": 1}, {"batch_size": -1, "max_length": 1}):
        with pytest.raises(ValueError, match="batch_size must be >= 1 and max_length >= 2"):
            RewardModelScorer(model_path=str(reward_model), **bad)
    for name in ("scale", "shift", "correct_threshold"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number, got nan"):
            RewardModelScorer(model_path=str(reward_model), **{name: float("nan")})
    with pytest.raises(TypeError):
        RewardModelScorer(str(reward_model))  # type: ignore[misc]
    assert list(RewardModelScorer.check_row({"prompt": "2 + 3"})) == []  # no ground truth needed


@pytest.mark.parametrize(("head", "expected"), [("auto", "sequence"), ("sequence", "sequence"), ("token", "token")])
def test_the_head_option_as_a_config_file_gives_it(reward_model, head, expected):
    scorer = RewardModelScorer(model_path=str(reward_model), head=built(head))
    scorer.load(torch.device("cpu"))
    assert scorer.head == expected
    assert type(scorer.model).__name__ == f"Qwen2For{expected.capitalize()}Classification"
    (result,) = scorer.score_batch([{"response": "5", "prompt": "What is 2 + 3?"}])
    assert math.isfinite(result.score)


def test_scale_shift_and_the_correct_threshold(reward_model, val_pairs):
    batch = samples(val_pairs[:6], 0)
    plain = RewardModelScorer(model_path=str(reward_model))
    plain.load(torch.device("cpu"))
    logits = [r.metrics["rm_logit"] for r in plain.score_batch(batch)]
    threshold = sorted(logits)[2]
    scorer = RewardModelScorer(model_path=str(reward_model), scale=2.0, shift=0.5, correct_threshold=threshold)
    scorer.load(torch.device("cpu"))
    results = scorer.score_batch(batch)
    assert [r.score for r in results] == pytest.approx([2.0 * v + 0.5 for v in logits], abs=1e-5)
    assert [r.correct for r in results] == [v >= threshold for v in logits]  # at the threshold counts
    assert sum(r.correct for r in results) == 4


@pytest.mark.parametrize("packing", [False, True])
def test_a_long_conversation_keeps_its_end(reward_model, packing):
    """Over max_length tokens, the model reads the last max_length tokens (the score is read at the end)."""
    scorer = RewardModelScorer(model_path=str(reward_model), max_length=12, packing=packing)
    scorer.load(torch.device("cpu"))
    sample = {"response": "The answer is 5.", "prompt": "What is 2 + 3? " * 6}
    text = render_conversation(scorer.tokenizer, None, sample["prompt"], sample["response"])
    ids = scorer.tokenizer(text)["input_ids"]
    assert len(ids) > 12
    with torch.no_grad():
        tail = float(scorer.model(input_ids=torch.tensor([ids[-12:]])).logits[0, 0])
    (result,) = scorer.score_batch([sample])
    assert result.score == pytest.approx(tail, abs=1e-5)


def test_a_model_without_a_pad_token_id_takes_the_tokenizers(reward_model, tmp_path):
    """Padding a batch of several lengths needs the model's pad_token_id (the sequence head pools at the last
    non-pad token): a folder whose config has none gets the tokenizer's, and scores as the original does."""
    import shutil

    copy = tmp_path / "rm"
    shutil.copytree(reward_model, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("pad_token_id", None)
    (copy / "config.json").write_text(json.dumps(config))
    batch = [{"response": "5", "prompt": "2 + 3"}, {"response": "The answer is 5.", "prompt": "What is 2 + 3?"}]
    scores = []
    for path in (reward_model, copy):
        scorer = RewardModelScorer(model_path=str(path))
        scorer.load(torch.device("cpu"))
        scores.append([r.score for r in scorer.score_batch(batch)])
    assert scorer.model.config.pad_token_id == scorer.tokenizer.pad_token_id
    assert scores[1] == pytest.approx(scores[0], abs=1e-5)


def test_non_finite_logits_name_the_first_five_samples(reward_model):
    scorer = RewardModelScorer(model_path=str(reward_model))
    scorer.load(torch.device("cpu"))
    scorer.model.score.weight.data.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"non-finite logits for samples \[0, 1, 2, 3, 4\] of "):
        scorer.score_batch([{"response": str(i), "prompt": "2 + 3"} for i in range(7)])
