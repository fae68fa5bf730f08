"""The per-step batch digests of a deterministic run (roll_pipeline/driver/digests.py)."""

from __future__ import annotations

import torch

from roll_pipeline.driver.digests import (
    append_step_digests,
    first_difference,
    read_step_digests,
    tensor_digest,
)


def test_a_digest_tells_apart_one_ulp_a_shape_and_a_dtype():
    t = torch.linspace(-3, 3, 12).reshape(3, 4)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) == tensor_digest(t.t().contiguous().t())  # the values, not the strides
    nudged = t.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(10.0))
    assert tensor_digest(nudged) != tensor_digest(t)
    assert tensor_digest(t.reshape(4, 3)) != tensor_digest(t)
    assert tensor_digest(t.double()) != tensor_digest(t)
    assert tensor_digest(t.bfloat16()).startswith("3x4:bfloat16:")
    assert tensor_digest(torch.zeros(0, 5)).startswith("0x5:float32:")


def test_a_resumed_runs_last_line_of_a_step_wins_and_the_first_difference_is_named(tmp_path):
    ids = torch.arange(6).reshape(2, 3)
    ref = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for step in (1, 2, 3):
        append_step_digests(a, step, {"prompt_ids": ids, "ref_log_probs": ref, "values": ref})
    append_step_digests(b, 1, {"prompt_ids": ids, "ref_log_probs": ref})
    append_step_digests(b, 2, {"prompt_ids": ids, "ref_log_probs": ref + 1})  # killed after this one
    assert first_difference(a, b) == "step 2: ref_log_probs differ (of prompt_ids, ref_log_probs)"
    append_step_digests(b, 2, {"prompt_ids": ids, "ref_log_probs": ref})  # the resume computes step 2 again
    assert set(read_step_digests(b)[2]) == {"prompt_ids", "ref_log_probs"}  # only the batch keys it digests
    assert first_difference(a, b) == f"step 3 only in {a}"
    append_step_digests(b, 3, {"prompt_ids": ids, "ref_log_probs": ref})
    assert first_difference(a, b) == "the batch tensors of every step are equal (3 steps)"
