"""The non-finite screen's verdicts are reused: one screen object per dtype, so an unchanged
dedup block is screened once, not on every save (issue 45, item 6)."""

import torch
from tiered_dcp.storage import blocks
from tiered_dcp.storage.blocks import BLOCK_BYTES, block_id, fingerprints

from tiered_dcp.tensors import CHECKED_DTYPES, finite_screen


def test_one_screen_object_per_dtype():
    for dtype in CHECKED_DTYPES:
        assert finite_screen(dtype) is finite_screen(dtype)
    assert finite_screen(torch.float32) is not finite_screen(torch.float16)
    assert finite_screen(torch.int64) is None


def test_an_unchanged_block_is_screened_once_across_saves(monkeypatch):
    """Each save asks ``finite_screen`` for its items' screens anew (``save.writer.resolve_items``)
    and the planner names the unchanged blocks; the second save screens none of them."""
    screened: list[int] = []
    real_fed = blocks._fed

    def counting_fed(hasher, buf, screen):
        if screen is not None:
            screened.append(len(buf))
        return real_fed(hasher, buf, screen)

    monkeypatch.setattr(blocks, "_fed", counting_fed)
    tensors = [torch.full((BLOCK_BYTES // 4,), float(v)) for v in range(3)]
    tensors[2][7] = float("nan")
    chunks = [memoryview(t.numpy()).cast("B") for t in tensors]
    ids = [block_id(c) for c in chunks]

    def save() -> list[bool]:
        screens = [finite_screen(t.dtype) for t in tensors]  # one call per item and save
        return [p.passed for p in fingerprints(chunks, [True] * 3, ids, screens)]

    assert save() == [True, True, False] and len(screened) == 3
    screened.clear()
    assert save() == [True, True, False]
    assert screened == [], f"{len(screened)} unchanged block(s) screened again"
