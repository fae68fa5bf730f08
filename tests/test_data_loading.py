"""Loading data with `datasets`, routing rows to domains by tag, prompt encoding and the prompt sampler."""

from __future__ import annotations

import json

import datasets
import pytest

from roll_pipeline.config import DataConfig, RewardConfig
from roll_pipeline.data.loading import DataError, collate_prompts, load_rows, prompt_messages, route_by_domain
from schedulers.dynamic_sampling import PromptSampler

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
    assert loaded[0]["prompt"] == "1+1" and loaded[0]["_source"] == f"{path}:1"


def test_load_rows_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "d.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DataError, match=r"d.csv: unsupported format '.csv'"):
        load_rows(str(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": 1}\n{not json\n')
    with pytest.raises(DataError, match="cannot load data file .*broken.jsonl"):
        load_rows(str(broken))


def test_routing_by_tag(tmp_path, caplog):
    rows = load_rows(str(write_jsonl(tmp_path / "d.jsonl", ROWS)))
    routed = route_by_domain(rows, REWARDS)
    assert [r["id"] for r in routed["math"]] == ["a"]
    assert [r["id"] for r in routed["code"]] == ["b"]
    assert routed["code"][0]["domain"] == "code"
    assert "left out 1 rows" in caplog.text and "poetry" in caplog.text


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
