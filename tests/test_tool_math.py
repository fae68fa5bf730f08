"""The tool-use example's data (roll_pipeline/data/tool_math.py) and how the embedded model's warm-up reads a row
taught as a trajectory (roll_pipeline/models/tiny.py)."""

from __future__ import annotations

import json
import re

import pytest

from roll_pipeline.data.tool_math import TOOL_SHARE, call_text, write_tool_math_data
from roll_pipeline.models.tiny import _collate, _encode, _taught_start, build_tokenizer
from schedulers.trajectory import tool_answer_text
from tests.conftest import EXAMPLES
from workers.environments.tool_calls import parse_call

FILES = ("tool_math_train.jsonl", "tool_math_val.jsonl", "tool_math_warmup.jsonl")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]


def test_regeneration_reproduces_the_committed_files(tmp_path):
    write_tool_math_data(tmp_path, seed=0)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


def test_splits_are_disjoint_products_and_a_share_of_the_warm_up_calls_the_tool():
    train, val, warmup = (rows(name) for name in FILES)
    problems = [re.search(r"(\d+) \* (\d+)", r["messages"][0]["content"]).groups() for r in train + val + warmup]
    assert len(set(problems)) == len(problems) == 6200
    for i, (row, (a, b)) in enumerate(zip(train + val + warmup, problems, strict=True)):
        product = str(int(a) * int(b))
        in_warmup = i >= len(train) + len(val)
        # RL's rows and the trajectories hold the product, the warm-up's direct answers the sentence they teach
        assert row["ground_truth"] == (f"The answer is {product}." if in_warmup and len(row["messages"]) == 1
                                       else product)
        assert row["tag"] == "mul" and 100 <= int(a) <= 999 and 100 <= int(b) <= 999
    assert all(len(r["messages"]) == 1 for r in train + val)
    taught = [r for r in warmup if len(r["messages"]) > 1]
    assert abs(len(taught) / len(warmup) - TOOL_SHARE) < 0.03
    for row in taught:
        user, call, tool = row["messages"]
        assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool"]
        parsed = parse_call(call["content"], "plain")  # the call the python environment runs
        assert parsed is not None and parsed.problem is None
        product = eval(parsed.code.removeprefix("print(").removesuffix(")"))
        assert row["ground_truth"] == str(product) and tool["content"] == f"{product}\n"  # what print writes


@pytest.fixture(scope="module")
def tokenizer():
    warmup = rows("tool_math_warmup.jsonl")
    return build_tokenizer([m["content"] for r in warmup for m in r["messages"]] + [r["ground_truth"] for r in warmup],
                           512)


def test_a_row_taught_as_a_trajectory_is_encoded_the_way_the_rollout_builds_one(tokenizer):
    direct = {"messages": [{"role": "user", "content": "What is 123 * 456?"}], "ground_truth": "56088"}
    taught = {**direct, "messages": [*direct["messages"], {"role": "assistant", "content": call_text("123 * 456")},
                                     {"role": "tool", "content": "56088\n"}]}
    (p1, r1, t1), (p2, r2, t2) = _encode(tokenizer, [direct, taught])
    assert p1 == p2  # the prompt is the question alone
    assert r1 == tokenizer.encode("56088", add_special_tokens=False) + [tokenizer.eos_token_id] and t1 == [1] * len(r1)
    call = tokenizer.encode(call_text("123 * 456"), add_special_tokens=False)
    tool = tokenizer.encode(tool_answer_text(tokenizer, "56088\n", "template"), add_special_tokens=False)
    assert r2 == call + tool + r1
    assert t2 == [1] * len(call) + [0] * len(tool) + [1] * len(r1)  # the tool's answer is read, not learned
    assert tokenizer.decode(tool) == "<|im_end|>\n<|im_start|>tool\n56088\n<|im_end|>\n<|im_start|>assistant\n"
    labels = _collate([(p2, r2, t2)], tokenizer.pad_token_id)["labels"][0]
    assert (labels[len(p2) : len(p2) + len(call)] >= 0).all()
    assert (labels[len(p2) + len(call) : len(p2) + len(call) + len(tool)] == -100).all()
    assert (labels[len(p2) + len(call) + len(tool) :] >= 0).all() and (labels[: len(p2)] == -100).all()


def test_the_build_counts_a_trajectory_row_right_when_the_model_starts_its_call():
    row = rows("tool_math_warmup.jsonl")
    taught = next(r for r in row if len(r["messages"]) > 1)
    direct = next(r for r in row if len(r["messages"]) == 1)
    assert _taught_start(taught["messages"][1]["content"] + "tool\n...", taught)
    assert not _taught_start(taught["ground_truth"], taught)
    assert _taught_start(f" {direct['ground_truth']} ", direct) and not _taught_start("1", direct)


def test_math_rule_scores_the_taught_answer_sentence_by_its_number():
    from workers.rewards.math_rule import MathRuleScorer

    scorer = MathRuleScorer()
    assert scorer.score("The answer is 56088.", "56088").score == 1.0
    assert scorer.score("The answer is 56089.", "56088").score == 0.0
    assert scorer.score("<python>\nprint(123 * 456)\n</python>", "56088").score == 0.0  # a call is no answer
