"""Zero-copy byte views of CPU tensors, and the way back."""

from __future__ import annotations

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def as_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype
