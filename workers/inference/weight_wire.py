"""actor_train's weights as they cross Ray in the rpc weight sync: each tensor's bytes as a numpy array.

Ray hands numpy arrays from its object store to the receiver without a copy (pickle protocol 5's out-of-band
buffers) and pickles torch tensors one storage at a time. Measured on 2 cores (2026-12-07, the tiny model's 51
tensors, one actor to another, median of 15): producing the weights as torch tensors took 11-14 ms until they were
in the store and 10-12 ms more until the receiver had loaded them; as numpy arrays 3-5 ms and 4 ms. In
bench_trl's pipeline that is most of the weight sync's time each step.

`pack` keeps each tensor's dtype and shape beside its bytes (any dtype: bfloat16 has no numpy twin); `unpack`
gives torch tensors again, viewing the received bytes. They are read-only (the object store's memory): whoever
takes them copies them into its own parameters (`load_state_dict`) and never writes into them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackedWeights:
    """Tensors by name, each as its raw bytes (`data`) and the dtype and shape to view them as (`layout`)."""

    data: dict[str, np.ndarray]
    layout: dict[str, tuple[str, tuple[int, ...]]]

    def __len__(self) -> int:
        return len(self.data)


def pack(state_dict: Mapping[str, torch.Tensor]) -> PackedWeights:
    """CPU tensors to their bytes, without a copy where a tensor is contiguous already (a copy otherwise)."""
    data, layout = {}, {}
    for name, tensor in state_dict.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"pack: {name!r} is on {tensor.device}; the rpc weight sync sends CPU tensors")
        flat = tensor.detach().contiguous().reshape(-1)
        data[name] = flat.view(torch.uint8).numpy()
        layout[name] = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    return PackedWeights(data, layout)


def unpack(weights: PackedWeights | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Torch tensors viewing packed weights' bytes; a mapping of tensors is returned as a dict, as it is."""
    if not isinstance(weights, PackedWeights):
        return dict(weights)
    out = {}
    with warnings.catch_warnings():  # the object store's arrays are read-only; nobody writes into them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, raw in weights.data.items():
            dtype, shape = getattr(torch, weights.layout[name][0]), weights.layout[name][1]
            if raw.size == 0:  # numpy gives an empty array stride 0, which a dtype view refuses
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.from_numpy(raw).view(dtype).reshape(shape)
    return out
