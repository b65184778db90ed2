"""Dask serializers for torch tensors: raw bytes with dtype and shape, so bf16 and CUDA tensors travel too.

distributed's own torch serializer goes through NumPy, which has no bfloat16 and cannot read CUDA
memory; this one sends a CPU copy of the bytes and rebuilds the tensor on the same device kind.
"""

from __future__ import annotations

import distributed.protocol.torch  # noqa: F401  (registers distributed's serializer first, so ours wins)
import torch
from distributed.protocol.serialize import dask_deserialize, dask_serialize


@dask_serialize.register(torch.Tensor)
def serialize_tensor(tensor: torch.Tensor) -> tuple[dict, list[memoryview]]:
    detached = tensor.detach()
    host = detached.cpu().contiguous() if detached.device.type != "cpu" else detached.contiguous()
    header = {
        "dtype": str(host.dtype).removeprefix("torch."),
        "shape": list(host.shape),
        "device": str(tensor.device),
        "requires_grad": tensor.requires_grad,
    }
    frame = host.reshape(-1).view(torch.uint8).numpy().data if host.numel() else memoryview(b"")
    return header, [frame]


@dask_deserialize.register(torch.Tensor)
def deserialize_tensor(header: dict, frames: list) -> torch.Tensor:
    dtype = getattr(torch, header["dtype"])
    data = bytearray(frames[0]) if not isinstance(frames[0], bytearray) else frames[0]
    if len(data):
        flat = torch.frombuffer(data, dtype=torch.uint8)
        tensor = flat.view(dtype).reshape(header["shape"])
    else:
        tensor = torch.empty(header["shape"], dtype=dtype)
    device = torch.device(header["device"])
    if device.type != "cpu":
        tensor = tensor.to(device)
    return tensor.requires_grad_(header["requires_grad"])
