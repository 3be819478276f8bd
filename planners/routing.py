"""Read routing: which stored bytes serve a DCP ReadItem.

A stored item is a whole chunk of a tensor as one rank saved it; a ReadItem may want a
sub-box of it (resharding). These helpers decide whether the stored chunk can be read
straight into the destination, or must be narrowed first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.planner import ReadItem


def whole_item_request(req: ReadItem, stored_shape: Sequence[int]) -> bool:
    """True when the request covers the stored chunk exactly (no narrowing needed)."""
    return all(o == 0 for o in req.storage_offsets) and list(req.lengths) == list(stored_shape)


def holds_stored_bytes(req: ReadItem, target: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> bool:
    """True when ``target`` is the stored item's raw bytes as they lie: the whole item, in
    its dtype and shape, contiguous host memory. Such a target is read (or received) into
    directly, with no scratch buffer and no second pass."""
    return (
        whole_item_request(req, shape)
        and target.dtype == dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and list(target.shape) == list(shape)
    )


def narrow_to_request(full: torch.Tensor, req: ReadItem) -> torch.Tensor:
    """The part of a stored chunk that ``req`` asks for."""
    out = full
    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
        out = out.narrow(dim, start, length)
    return out
