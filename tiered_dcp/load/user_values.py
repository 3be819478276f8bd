"""The non-tensor values a user saved (DCP's byte items): handed on only if they are data.

DCP's default planner loads them with ``torch.load(weights_only=False)``, so whoever can
write a tier could run code in every rank that loads a step. The reader first loads each
with ``weights_only=True`` (plain data, tensors, and the classes a user allowed with
``torch.serialization.add_safe_globals``) and refuses one that does not load so, before
the planner sees it; the reader then treats it as a damaged copy and reads another.
"""

from __future__ import annotations

import io

import torch

from tiered_dcp.storage.codec import ChecksumMismatch


def checked(raw: bytes | bytearray) -> io.BytesIO:
    """``raw`` for ``planner.load_bytes``; raises ChecksumMismatch if it is not plain data."""
    try:
        torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        raise ChecksumMismatch(
            f"refused: it does not load with torch.load(weights_only=True) ({_why(e)}); a value "
            "of a class of your own loads once you allow it with "
            "torch.serialization.add_safe_globals([YourClass])"
        ) from e
    return io.BytesIO(raw)


def _why(e: Exception) -> str:
    """The line of torch's many-line refusal that names what was refused (one line for users)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = ("WeightsUnpickler error", "GLOBAL", "global")
    return next((ln for ln in lines if any(n in ln for n in named)), lines[0] if lines else type(e).__name__)
