"""The non-finite screen's verdicts are reused: one screen object per dtype, so an unchanged
dedup block is screened once, not on every save."""

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
    """Each save asks ``finite_screen`` for its items' screens anew (``save.parts.resolve_items``)
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


def _verdicts(dtype: torch.dtype, words: torch.Tensor) -> list[bool]:
    """The screen's verdict on each word alone, beside a finite one (pieces of two values)."""
    screen = finite_screen(dtype)
    assert screen is not None
    pairs = torch.stack([words, torch.zeros_like(words)], 1).contiguous().view(dtype)
    view = memoryview(pairs.view(torch.uint8).numpy()).cast("B")
    size = 2 * words.element_size()
    return [screen(view[i * size : (i + 1) * size]) for i in range(len(words))]


def test_the_screen_is_exact_for_every_16_bit_pattern():
    """Every float16 and bfloat16 word: the screen says non-finite exactly where torch does
    (NaN and Inf of either sign, payloads included); the two reductions leave none out."""
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        expected = torch.isfinite(words.view(dtype).float()).tolist()
        assert _verdicts(dtype, words) == expected


def test_the_screen_is_exact_at_the_edges_of_wide_floats():
    """float32 and float64: the largest finite values of both signs, zeros, subnormals pass;
    NaN and Inf of both signs, with any payload, fail; random words agree with torch."""
    for dtype, itype in ((torch.float32, torch.int32), (torch.float64, torch.int64)):
        info = torch.finfo(dtype)
        values = torch.tensor(
            [info.max, -info.max, 0.0, -0.0, info.tiny / 2, -info.tiny / 2, float("inf"), float("-inf")],
            dtype=dtype,
        )
        nan = torch.tensor([float("nan")], dtype=dtype).view(itype)
        words = torch.cat([values.view(itype), nan, nan | 1, nan | (1 << (itype.itemsize * 8 - 1)), nan - 1])
        g = torch.Generator().manual_seed(1)
        words = torch.cat([words, torch.randint(-(1 << 62), 1 << 62, (4096,), generator=g).to(itype)])
        expected = torch.isfinite(words.view(dtype)).tolist()
        assert _verdicts(dtype, words) == expected
        assert expected[:6] == [True] * 6 and expected[6:12] == [False] * 6
