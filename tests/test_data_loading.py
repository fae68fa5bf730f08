"""Loading data with `datasets`, routing rows to domains by tag, prompt encoding and the prompt sampler."""

from __future__ import annotations

import json

import datasets
import pytest

from roll_core.config import DataConfig, RewardConfig
from roll_core.data.loading import (
    MAX_LISTED,
    DataError,
    check_rows,
    collate_prompts,
    fit_prompts,
    load_rows,
    prompt_messages,
    require_rows,
    require_unique_ids,
    route_by_domain,
)
from schedulers.draws import PromptSampler

ROWS = [
    {"id": "a", "tag": "add", "messages": [{"role": "user", "content": "1+1"}], "ground_truth": "2"},
    {"id": "b", "tag": "string", "prompt": "reverse", "ground_truth": "x"},
    {"id": "c", "tag": "poetry", "prompt": "a poem", "ground_truth": ""},
]
REWARDS = {
    "math": RewardConfig(worker="math_rule", tag_included=["add"]),
    "code": RewardConfig(worker="code_sandbox", tag_included=["string"]),
}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved"])
def test_load_rows_from_every_format(tmp_path, fmt):
    rows = [{"id": "a", "tag": "add", "prompt": "1+1", "ground_truth": "2"}]
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "d.jsonl", rows)
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    loaded = load_rows(str(path))
    assert loaded[0]["prompt"] == "1+1"
    assert loaded[0]["_source"] == (f"{path}:1" if fmt == "jsonl" else f"{path} row 1")


def test_jsonl_rows_name_their_line_past_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "tag": "add"}\n\n  \n{"id": "b", "tag": "add"}')
    assert [r["_source"] for r in load_rows(str(path))] == [f"{path}:1", f"{path}:4"]


def test_load_rows_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "d.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DataError, match=r"d.csv: unsupported format '.csv'"):
        load_rows(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": 1}\n{not json\n')
    with pytest.raises(
        DataError, match=r"broken.jsonl:2: not valid JSON: Expecting property name .* \(column 2\)"
    ):
        load_rows(str(broken))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"id": 1}\n{"id": "caf\xe9"}\n')
    with pytest.raises(DataError, match="latin.jsonl:2: not UTF-8 text"):
        load_rows(str(latin))
    broken_json = tmp_path / "broken.json"
    broken_json.write_text("[{")
    with pytest.raises(DataError, match="cannot load data file .*broken.json"):
        load_rows(str(broken_json))


def test_routing_by_tag(tmp_path):
    rows = load_rows(str(write_jsonl(tmp_path / "d.jsonl", ROWS[:2])))
    routed = route_by_domain(rows, REWARDS)
    assert [r["id"] for r in routed["math"]] == ["a"]
    assert [r["id"] for r in routed["code"]] == ["b"]
    assert routed["code"][0]["domain"] == "code"


def test_a_tag_no_domain_claims_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS + [{**ROWS[2], "id": "d"}] + [{"id": "e", "prompt": "x"}])
    rows = load_rows(str(path))
    with pytest.raises(DataError) as info:
        route_by_domain(rows[:4], REWARDS)
    assert str(info.value) == (
        "1 tag(s) claimed by no domain "
        "(rewards.math.tag_included: ['add']; rewards.code.tag_included: ['string']):\n"
        f"  {path}:3: tag 'poetry' (2 rows)"
    )
    with pytest.raises(DataError, match=f"{path}:5: field 'tag' is missing"):
        route_by_domain(rows, REWARDS)


def test_row_checks_list_the_first_problems_and_count_the_rest(tmp_path):
    rows = load_rows(str(write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "ground_truth": ""}] * 7)))
    routed = route_by_domain(rows, REWARDS)
    check_rows(routed, {"code": lambda row: [("x", "never called")]})  # no code rows: passes
    with pytest.raises(DataError) as info:
        check_rows(routed, {"math": lambda row: [("ground_truth", "empty")]})
    lines = str(info.value).splitlines()
    assert lines[0] == "7 problem(s) in rows the reward scorers cannot use:"
    assert lines[1] == f"  {tmp_path / 'd.jsonl'}:1: field 'ground_truth': empty (domain math)"
    assert lines[-1] == "  ... and 2 more" and len(lines) == 2 + MAX_LISTED


def test_require_rows_names_the_domain_and_the_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:1])
    routed = route_by_domain(load_rows(str(path)), REWARDS)
    with pytest.raises(DataError) as info:
        require_rows(routed, REWARDS, [str(path)])
    assert str(info.value) == (
        "rewards.code: no training row has a tag in its tag_included ['string']\n"
        f"  searched data.train_files: {path} (tags found there: ['add'])"
    )


def test_validation_ids_must_be_unique_within_a_domain(tmp_path):
    """Validation groups a prompt's responses by id: two rows with one id would be scored as one prompt."""
    first = write_jsonl(tmp_path / "a.jsonl", [ROWS[0], {**ROWS[1], "id": "a"}, {**ROWS[0], "id": 7}])
    second = write_jsonl(tmp_path / "b.jsonl", [{**ROWS[0], "id": "7"}, {k: v for k, v in ROWS[0].items() if k != "id"}])
    ok = route_by_domain(load_rows(str(first))[:2] + load_rows(str(second))[1:], REWARDS)
    require_unique_ids(ok)  # "a" in math and in code; a row without an id is named by its line
    routed = route_by_domain(load_rows(str(first)) + load_rows(str(second)) + load_rows(str(first))[:1], REWARDS)
    with pytest.raises(DataError) as info:
        require_unique_ids(routed)
    assert str(info.value) == (
        "2 id(s) given to more than one validation row of a domain (each prompt needs its own id):\n"
        f"  id 'a' (domain math) in 2 rows: {first}:1, {first}:1\n"
        f"  id '7' (domain math) in 2 rows: {first}:3, {second}:1"
    )
    many = route_by_domain(load_rows(str(write_jsonl(tmp_path / "c.jsonl", [ROWS[0]] * 5))), REWARDS)
    with pytest.raises(DataError, match=r"in 5 rows: .*c.jsonl:1, .*c.jsonl:2, .*c.jsonl:3 and 2 more$"):
        require_unique_ids(many)
    ids = [{**ROWS[0], "id": f"p{i}"} for i in range(MAX_LISTED + 2)]
    crowded = route_by_domain(load_rows(str(write_jsonl(tmp_path / "d.jsonl", ids + ids))), REWARDS)
    with pytest.raises(DataError) as info:
        require_unique_ids(crowded)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"{MAX_LISTED + 2} id(s)") and lines[-1] == "  ... and 2 more"
    assert len(lines) == 2 + MAX_LISTED


class CharTokenizer:
    """One token per character of the last message, so prompt lengths are easy to reason about."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return list(range(len(messages[-1]["content"])))


def test_fit_prompts_errors_or_drops_by_config(tmp_path, caplog):
    rows = [{**ROWS[1], "prompt": "x" * n, "id": str(n)} for n in (3, 9, 4, 12)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    routed = route_by_domain(load_rows(str(path)), REWARDS)
    with pytest.raises(DataError) as info:
        fit_prompts(CharTokenizer(), routed, DataConfig(train_files=["x"], prompt_length=5), "train")
    assert str(info.value).splitlines()[1:] == [
        f"  {path}:2: field 'prompt': 9 tokens",
        f"  {path}:4: field 'prompt': 12 tokens",
    ]
    fitted = fit_prompts(
        CharTokenizer(),
        routed,
        DataConfig(train_files=["x"], prompt_length=5, on_long_prompt="drop"),
        "train",
    )
    assert [r["id"] for r in fitted["code"].rows] == ["3", "4"]
    assert fitted["code"].prompt_ids == [[0, 1, 2], [0, 1, 2, 3]]
    assert fitted["code"].dropped == 2 and fitted["math"].dropped == 0
    assert "left out 2 of 4 train prompts of domain code" in caplog.text
    with pytest.raises(
        DataError, match="rewards.code: all 4 training prompts are longer than data.prompt_length=2"
    ):
        fit_prompts(
            CharTokenizer(),
            routed,
            DataConfig(train_files=["x"], prompt_length=2, on_long_prompt="drop"),
            "train",
        )


def test_prompt_messages_from_messages_or_prompt():
    data = DataConfig(train_files=["x"])
    assert prompt_messages({**ROWS[0], "_source": "f:1"}, data) == [{"role": "user", "content": "1+1"}]
    assert prompt_messages({**ROWS[1], "_source": "f:2"}, data) == [{"role": "user", "content": "reverse"}]
    with pytest.raises(DataError, match="f:3: row has neither 'messages' nor a 'prompt' string"):
        prompt_messages({"tag": "x", "_source": "f:3"}, data)


def test_collate_left_pads():
    ids, mask = collate_prompts([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_prompt_sampler_covers_each_epoch_once_and_is_seeded():
    s = PromptSampler(5, seed=3)
    first = s.take(5)
    assert sorted(first) == [0, 1, 2, 3, 4]
    second = s.take(7)
    assert sorted(second[:5]) == [0, 1, 2, 3, 4]
    assert s.state_dict() == {"epoch": 2, "position": 2, "seed": 3, "size": 5}
    again = PromptSampler(5, seed=3)
    assert again.take(12) == first + second
