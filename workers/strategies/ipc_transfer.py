"""CUDA IPC handles in a form vLLM's RPC carries without pickle (weight_transport: ipc).

vLLM's IPC weight-transfer engine takes each handle as the argument tuple of torch's `reduce_tensor`, which holds
Python classes (the tensor's and the storage's) and a torch dtype. vLLM's msgpack RPC between the engine process
and its workers refuses those unless VLLM_ALLOW_INSECURE_SERIALIZATION turns on pickle for everything (vLLM's own
IPC example sets it). Here they travel as plain values instead: each class by a name from a closed list, the dtype
by its name, sizes as lists; the rest of the tuple (device index, CUDA handles as bytes, offsets, flags) is
msgpack's own. actor_train's client encodes (`encode_update_info`); `IPCHandleEngine`, vLLM's IPC engine
registered as `roll_ipc`, decodes before vLLM's code sees them, and refuses anything outside the list.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

BACKEND = "roll_ipc"

TENSOR_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
STORAGE_CLASSES = {"TypedStorage": torch.TypedStorage, "UntypedStorage": torch.UntypedStorage}
ARGS = 15
"""Length of reduce_tensor's argument tuple for a CUDA tensor (rebuild_cuda_tensor's parameters)."""


def _name(cls: type, known: dict[str, type]) -> str:
    for name, value in known.items():
        if cls is value:
            return name
    raise ValueError(f"IPC handle: {cls!r} is none of {list(known)}")


def encode_ipc_args(args: tuple) -> list:
    """reduce_tensor's argument tuple as msgpack-native values."""
    if len(args) != ARGS:
        raise ValueError(f"IPC handle: expected reduce_tensor's {ARGS} CUDA arguments, got {len(args)}")
    tensor_cls, size, stride, offset, storage_cls, dtype, *rest = args
    return [
        _name(tensor_cls, TENSOR_CLASSES), list(size), list(stride), offset,
        _name(storage_cls, STORAGE_CLASSES), str(dtype).removeprefix("torch."), *rest,
    ]


def decode_ipc_args(values: list) -> tuple:
    """`encode_ipc_args`'s values back as the argument tuple of rebuild_cuda_tensor; anything but the listed
    classes and a torch dtype is refused."""
    if len(values) != ARGS:
        raise ValueError(f"IPC handle: expected {ARGS} values, got {len(values)}")
    tensor_name, size, stride, offset, storage_name, dtype_name, *rest = values
    if tensor_name not in TENSOR_CLASSES or storage_name not in STORAGE_CLASSES:
        raise ValueError(f"IPC handle: unknown tensor or storage class {tensor_name!r}, {storage_name!r}")
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"IPC handle: {dtype_name!r} is not a torch dtype")
    return (
        TENSOR_CLASSES[tensor_name], torch.Size(size), tuple(stride), offset, STORAGE_CLASSES[storage_name], dtype,
        *rest,
    )


def _map_handles(handles: Any, convert) -> Any:
    """Apply `convert` to every {GPU uuid: args} of an update's ipc_handles (one dict when packed, else a list)."""
    if isinstance(handles, dict):
        return {uuid: convert(args) for uuid, args in handles.items()}
    return [_map_handles(h, convert) for h in handles]


def encode_update_info(update_info: dict[str, Any]) -> dict[str, Any]:
    """An update of vLLM's IPC trainer engine with its handles encoded; any other update unchanged."""
    if update_info.get("ipc_handles") is None:
        return update_info
    return {**update_info, "ipc_handles": _map_handles(update_info["ipc_handles"], encode_ipc_args)}


class IPCHandleEngine(IPCWeightTransferEngine):
    """vLLM's IPC engine, taking the handles `encode_update_info` wrote."""

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        if update_dict.get("ipc_handles") is not None:
            update_dict = {**update_dict, "ipc_handles": _map_handles(update_dict["ipc_handles"], decode_ipc_args)}
        return super().parse_update_info(update_dict)
