"""The choice of a step to load: a pure function of what is held and how it is marked.

Every rank calls it on the same pooled facts (``TieredReader`` gathers them first), so
every rank makes the same choice with no further talk. A step is passed over when it is
*quarantined* (a load found an item of it with no good copy left, ``format.quarantine_key``)
or *non-finite* (its save found NaN/Inf, ``Marker.nonfinite_items``), or when the caller
excludes it (``load_latest``: it failed to load just now, or cannot be loaded through its
caller, with the reason given). Falling back after a failed load
is choosing again. Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StepMarks:
    """What loads must know of one step beyond its being complete somewhere."""

    step: int
    quarantined: str | None = None  # why a load quarantined it (None: it was not)
    nonfinite_items: int = 0  # items its save found holding NaN/Inf
    nonfinite: tuple[str, ...] = ()  # the first of them, by name

    @property
    def good(self) -> bool:
        return self.quarantined is None and self.nonfinite_items == 0

    def why(self) -> str:
        """Why the step is passed over, in a few words ("" when it is good)."""
        reasons = []
        if self.quarantined is not None:
            reasons.append(f"quarantined ({self.quarantined})")
        if self.nonfinite_items:
            more = self.nonfinite_items - len(self.nonfinite)
            names = ", ".join(self.nonfinite) + (f" and {more} more" if more > 0 else "")
            reasons.append(f"non-finite (NaN/Inf in {names})")
        return "; ".join(reasons)

    def merged(self, other: StepMarks) -> StepMarks:
        """The step as two copies of it say: a mark on either counts."""
        return StepMarks(
            self.step,
            self.quarantined if self.quarantined is not None else other.quarantined,
            max(self.nonfinite_items, other.nonfinite_items),
            self.nonfinite or other.nonfinite,
        )


def pool_marks(marks: Iterable[StepMarks]) -> dict[int, StepMarks]:
    """step -> its marks over every copy seen (every tier, every rank's root)."""
    out: dict[int, StepMarks] = {}
    for m in marks:
        out[m.step] = out[m.step].merged(m) if m.step in out else m
    return out


@dataclass(frozen=True)
class Choice:
    """The step to load (None: no step qualifies) and the newer steps passed over, with why."""

    step: int | None
    skipped: Mapping[int, str]


def choose(
    candidates: Mapping[int, StepMarks],
    requested: int | None = None,
    exclude: Collection[int] | Mapping[int, str] = (),
) -> Choice:
    """``requested`` if it is among the complete ``candidates`` (marked or not: asked for by
    number, it is loaded anyway); else the newest good candidate not in ``exclude`` (a
    mapping gives the reason each is excluded; "" or a plain collection: it failed to load)."""
    if requested is not None:
        return Choice(requested if requested in candidates else None, {})
    skipped: dict[int, str] = {}
    for step in sorted({*candidates, *exclude}, reverse=True):  # an excluded step is named even
        if step in exclude:  # where the look that found the candidates left it out (a shared tier's)
            why = exclude.get(step) if isinstance(exclude, Mapping) else None
            skipped[step] = why or "it failed to load just now"
        elif not candidates[step].good:
            skipped[step] = candidates[step].why()
        else:
            return Choice(step, skipped)
    return Choice(None, skipped)


def describe_skipped(skipped: Mapping[int, str]) -> str:
    """One clause per step passed over, newest first, for warnings and errors."""
    return "; ".join(f"step {s}: {why}" for s, why in sorted(skipped.items(), reverse=True))
