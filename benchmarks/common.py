"""What the benchmarks share: the state they save."""

import torch

MiB = 1 << 20


def make_state(mib: int, n: int = 32) -> dict:
    """``mib`` MiB of float32 in ``n`` tensors, the same bytes in every run."""
    per = mib * MiB // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}
