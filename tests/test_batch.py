"""The batch type: declared keys, selection, splitting and padded concatenation."""

from __future__ import annotations

import pytest
import torch

from roll_core.batch import Batch


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


def test_an_empty_batch_and_a_batch_of_meta_only_have_their_length():
    assert len(Batch()) == 0 and Batch().keys() == []
    assert len(Batch(meta={"tag": ["a", "b"]})) == 2


def test_update_adds_and_replaces_entries_without_touching_the_original():
    b = make(2)
    out = b.update({"advantages": torch.ones(2, 3), "scores": torch.zeros(2)}, domain=["m", "m"])
    assert out["advantages"].shape == (2, 3) and out["scores"].tolist() == [0.0, 0.0] and out.meta["domain"] == ["m"] * 2
    assert "advantages" not in b and b["scores"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(("n", "pieces", "sizes"), [(7, 2, [4, 3]), (10, 3, [3, 4, 3]), (5, 3, [2, 1, 2]), (4, 1, [4])])
def test_chunk_gives_exactly_pieces_near_equal_consecutive_parts(n, pieces, sizes):
    parts = make(n).chunk(pieces)
    assert [len(p) for p in parts] == sizes  # bounds round(i * n / pieces)
    assert [t for p in parts for t in p.meta["tag"]] == [f"t{i}" for i in range(n)]


def test_concat_refuses_batches_whose_keys_differ_either_way():
    base = make(2)
    more = base.update({"advantages": torch.zeros(2, 3)})
    other_meta = base.update(domain=["m", "m"])
    for batches in ([base, more], [more, base], [base, other_meta], [other_meta, base], [base, base, more]):
        with pytest.raises(KeyError, match="cannot concatenate batches with different keys"):
            Batch.concat(batches)
    assert len(Batch.concat([base, Batch(), base])) == 4  # empty batches are left out


def test_concat_pads_each_part_by_its_own_shortfall():
    parts = [Batch({"response_ids": torch.full((1, w), w)}) for w in (1, 2, 5)]
    assert Batch.concat(parts)["response_ids"].tolist() == [[1, 0, 0, 0, 0], [2, 2, 0, 0, 0], [5] * 5]
    prompts = [Batch({"prompt_ids": torch.full((1, w), w)}) for w in (2, 5)]
    assert Batch.concat(prompts)["prompt_ids"].tolist() == [[0, 0, 0, 2, 2], [5] * 5]


def test_loss_mask_leaves_out_the_tokens_the_offpolicy_rejection_took_out():
    from roll_core.batch import loss_mask

    b = Batch(
        {
            "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
            "in_loss": torch.tensor([1.0, 1.0, 0.0]),
            "offpolicy_keep": torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        }
    )
    assert loss_mask(b).tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_loss_mask_is_the_response_mask_of_the_samples_in_the_loss():
    from roll_core.batch import loss_mask

    b = Batch({"response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), "in_loss": torch.tensor([1.0, 0.0])})
    assert loss_mask(b).tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


def test_a_missing_tool_mask_is_all_zeros_when_batches_are_joined():
    from roll_core.batch import sequence_mask

    single = Batch({"response_mask": torch.tensor([[1.0, 1.0, 0.0]])})
    multi = Batch({"response_mask": torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "tool_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]])})
    for parts, expected in [
        ([single, multi], [[0, 0, 0, 0], [0, 1, 1, 0]]),
        ([multi, single, single], [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]),
    ]:
        joined = Batch.concat(parts)
        assert joined["tool_mask"].tolist() == expected
    assert "tool_mask" not in Batch.concat([single, single]).tensors  # nobody has one: none is made
    assert sequence_mask(multi).tolist() == [[1, 1, 1, 1]] and sequence_mask(single).tolist() == [[1, 1, 0]]
    with pytest.raises(KeyError, match="different keys"):  # the fill is for tool_mask only
        Batch.concat([single, multi.update({"advantages": torch.zeros(1, 4)})])


def test_a_single_turn_batch_beside_a_multi_turn_one_gets_one_turn_no_tool_calls_and_no_trajectory():
    single = Batch({"scores": torch.tensor([1.0])}, {"tag": ["a"]})
    used = {"turns": [3.0, 2.0], "tool_calls": [2.0, 1.0], "tool_errors": [1.0, 0.0], "tool_s": [0.5, 0.25]}
    multi = Batch(
        {"scores": torch.tensor([0.0, 1.0]), **{k: torch.tensor(v) for k, v in used.items()}},
        {"tag": ["b", "b"], "trajectory": [[{"role": "tool", "content": "6"}], []]},
    )
    joined = Batch.concat([single, multi])
    assert {k: joined[k].tolist() for k in used} == {
        "turns": [1.0, 3.0, 2.0], "tool_calls": [0.0, 2.0, 1.0], "tool_errors": [0.0, 1.0, 0.0], "tool_s": [0.0, 0.5, 0.25],
    }
    assert joined.meta["trajectory"] == [None, [{"role": "tool", "content": "6"}], []]
    assert Batch.concat([single, single]).meta == {"tag": ["a", "a"]}
