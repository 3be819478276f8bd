"""Zero-copy byte views of CPU tensors, and the way back."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
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


# Per checked dtype: the signed and unsigned integers of its width and its exponent's bits.
# A value is NaN or Inf exactly when every exponent bit is set (IEEE 754; bfloat16 is
# float32's top half). Other dtypes (float8, complex, integers) are not checked.
EXPONENT_BITS = {
    torch.float16: (np.int16, np.uint16, 0x7C00),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80),
    torch.float32: (np.int32, np.uint32, 0x7F800000),
    torch.float64: (np.int64, np.uint64, 0x7FF0000000000000),
}
CHECKED_DTYPES = tuple(EXPONENT_BITS)


def finite_screen(dtype: torch.dtype) -> Callable[[memoryview], bool] | None:
    """Whether a piece of a tensor's bytes holds no NaN/Inf, for ``storage.blocks.fingerprints``
    to run beside the hash (None for dtypes it does not check). One object per dtype: a
    block's answer is remembered per screen."""
    return _SCREENS.get(dtype)


def _finite_bytes(signed: type, unsigned: type, exponent: int, piece: memoryview) -> bool:
    """No value in ``piece`` with every exponent bit set: exact, whatever the values (no sum
    to overflow), in two reductions that make no array of their own. Read as signed
    integers, the positive NaN/Inf are exactly the words from ``exponent`` up; read as
    unsigned, the negative ones are exactly those from sign bit | ``exponent`` up.

    In numpy, one thread per call with the GIL released, so the hashing pool's threads
    screen in parallel; a torch op here would start a parallel region over every core from
    each of those threads (3x slower with 16 cores' worth of threads)."""
    if not len(piece):
        return True
    sign = 1 << (8 * np.dtype(unsigned).itemsize - 1)
    if int(np.frombuffer(piece, dtype=signed).max()) >= exponent:
        return False
    return int(np.frombuffer(piece, dtype=unsigned).max()) < sign | exponent


# The screens, made once: ``fingerprints`` remembers a block's answer per screen object, so a
# new object per call would screen every unchanged block again on every save.
_SCREENS = {dtype: functools.partial(_finite_bytes, *bits) for dtype, bits in EXPONENT_BITS.items()}
