"""Zero-copy byte views of CPU tensors, and the way back."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(byte_tensor(t).numpy()).cast("B")


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor (any device) as a flat uint8 tensor, no copy."""
    return t.reshape(-1).view(torch.uint8)


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


FINITE_ROW = 1024  # float16 elements summed together when screening a tensor for NaN/Inf
CHECKED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a CPU tensor holds no NaN/Inf (True for dtypes it does not check).

    A sum is non-finite whenever one of its terms is (IEEE: NaN and Inf propagate), so a
    sum screens the tensor at memory speed; only a non-finite sum (a NaN/Inf, or finite
    values that overflowed) is checked element by element. float16 is summed in rows of
    ``FINITE_ROW``, so that ordinary values do not overflow its range. Other dtypes
    (float8, complex, integers) are not checked.
    """
    if t.dtype not in CHECKED_DTYPES or t.numel() == 0:
        return True
    flat = t.reshape(-1)
    if t.dtype == torch.float16:
        cut = flat.numel() // FINITE_ROW * FINITE_ROW
        sums = [flat[:cut].view(-1, FINITE_ROW).sum(dim=1)] if cut else []
        if cut < flat.numel():
            sums.append(flat[cut:].sum().reshape(1))
        screened = all(bool(torch.isfinite(s).all()) for s in sums)
    else:
        screened = bool(flat.sum().isfinite())
    return screened or bool(torch.isfinite(flat).all())


@functools.cache
def finite_screen(dtype: torch.dtype) -> Callable[[memoryview], bool] | None:
    """``all_finite`` of a piece of a tensor's bytes, for ``storage.blocks.fingerprints`` to
    run beside the hash (None for dtypes it does not check). One object per dtype: a block's
    answer is remembered per screen."""
    if dtype not in CHECKED_DTYPES:
        return None
    return functools.partial(_finite_bytes, dtype)


def _finite_bytes(dtype: torch.dtype, piece: memoryview) -> bool:
    return all_finite(torch.frombuffer(piece, dtype=dtype)) if len(piece) else True
