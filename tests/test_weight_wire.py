"""The rpc weight sync's wire form (workers/inference/weight_wire.py): every tensor comes back bit for bit, with its
dtype and shape, through Ray's object store too."""

from __future__ import annotations

import pytest
import torch

from workers.inference.weight_wire import PackedWeights, pack, unpack


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 4, generator=g)
    return {
        "f32": base,
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # no numpy twin
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "i64": torch.arange(-3, 9).reshape(3, 4),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous: packed as a copy
        "tied": base,  # the same tensor under a second name (tied embeddings)
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_pack_and_unpack_give_every_tensor_back():
    state = weights()
    packed = pack(state)
    assert isinstance(packed, PackedWeights) and len(packed) == len(state)
    assert_same(unpack(packed), state)
    # contiguous CPU tensors are not copied: the bytes are the tensor's own
    assert packed.data["f32"].ctypes.data == state["f32"].data_ptr()


def test_unpack_passes_a_state_dict_through():
    state = weights()
    assert_same(unpack(state), state)


def test_pack_refuses_a_tensor_off_the_cpu_and_names_it():
    with pytest.raises(ValueError, match="'w' is on meta"):
        pack({"ok": torch.ones(2), "w": torch.empty(2, device="meta")})


def test_packed_weights_cross_the_object_store_unchanged(local_ray):
    import ray

    state = weights()
    received = ray.get(ray.put(pack(state)))
    assert_same(unpack(received), state)
    # what load_state_dict does with them: a copy into the receiver's own parameters
    model = torch.nn.Linear(4, 6, bias=False)
    model.load_state_dict({"weight": unpack(received)["f32"]})
    assert torch.equal(model.weight.detach(), state["f32"])
