"""The batch type: declared keys, selection, splitting and padded concatenation."""

from __future__ import annotations

import pytest
import torch

from roll_pipeline.batch import Batch


def make(n: int, width: int = 3) -> Batch:
    return Batch(
        {"response_ids": torch.arange(n * width).reshape(n, width), "scores": torch.arange(n, dtype=torch.float)},
        {"tag": [f"t{i}" for i in range(n)]},
    )


def test_undeclared_key_is_refused():
    with pytest.raises(KeyError, match="undeclared batch tensor key"):
        Batch({"respons_ids": torch.zeros(2, 2)})


def test_disagreeing_sizes_are_refused():
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        Batch({"scores": torch.zeros(2)}, {"tag": ["a"]})


def test_require_names_missing_keys():
    with pytest.raises(KeyError, match=r"actor_train needs key\(s\) \['advantages'\]"):
        make(2).require("scores", "advantages", where="actor_train")


def test_select_split_chunk_keep_rows_together():
    b = make(5)
    picked = b.select([4, 1])
    assert picked["scores"].tolist() == [4.0, 1.0] and picked.meta["tag"] == ["t4", "t1"]
    assert [len(p) for p in b.split(2)] == [2, 2, 1]
    assert [len(p) for p in b.chunk(2)] == [2, 3]
    assert Batch.concat(b.split(2))["response_ids"].tolist() == b["response_ids"].tolist()


def test_concat_pads_responses_right_and_prompts_left():
    a = Batch({"prompt_ids": torch.ones(1, 2, dtype=torch.long), "response_ids": torch.ones(1, 2, dtype=torch.long)})
    b = Batch({"prompt_ids": torch.full((1, 3), 2), "response_ids": torch.full((1, 3), 2)})
    out = Batch.concat([a, b])
    assert out["prompt_ids"].tolist() == [[0, 1, 1], [2, 2, 2]]
    assert out["response_ids"].tolist() == [[1, 1, 0], [2, 2, 2]]
