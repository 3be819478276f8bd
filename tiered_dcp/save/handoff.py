"""Before a save stages or writes: wait until the rank's writer process has room for it.

The trainer's side of the hand-off's back-pressure (``TieredWriter(max_pending=)``): the
writer is started early (ready by the hand-off), its reported failures raised, and a save
waits while the writer lags more than ``max_pending`` steps behind on a slower tier taking
the step. With ``on_lagging_tier="wait"`` on a RAM first tier the save also waits for the
step leaving the tier's keep window (its file is the one this save stages into); with
``"skip"`` it waits for nothing (retention drops the step, the copy is recorded skipped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import TieredConfig, node_of
from ..steps import part_file
from ..steps.catalog import TierView
from ..writer_process.client import writer_handle


@dataclass(frozen=True)
class Handoff:
    """One save's hand-off to ``rank``'s writer: the step, its tiers (fastest first), the
    trainer's pid and the writer's allowed lag."""

    config: TieredConfig
    step: int
    tier_indexes: list[int]
    rank: int
    owner: int | None  # the trainer's pid (None: this process)
    max_pending: int

    def first(self) -> TierView:
        return TierView(self.config, self.tier_indexes[0], node_of(self.rank), self.rank)

    def wait_for_room(self) -> float:
        """Start the writer if it is not running, raise what it reported failed, and wait
        while it lags too far behind; the seconds waited."""
        if len(self.config.tiers) < 2:
            return 0.0
        owner = self.owner or os.getpid()
        handle = writer_handle(self.config, self.rank)
        handle.ensure(owner)  # started early, ready by the hand-off
        handle.report_failures()
        if self.skips_lagging():
            return 0.0
        # the window's wait covers every slower tier, whatever this step goes to: a step
        # taken by the RAM tier alone still needs the file an older pinned step holds
        below = range(self.tier_indexes[0] + 1, len(self.config.tiers))
        lagging = {t: self.max_pending for t in self.tier_indexes[1:]}
        return handle.wait_for_room(self.step, lagging, owner, self.leaving_window(), below)

    def skips_lagging(self) -> bool:
        """Whether no save waits for the slower tiers (``on_lagging_tier="skip"`` on a RAM
        first tier): the steps they lag behind on leave it all the same."""
        return part_file.drops_pinned(self.config, self.first().own)

    def leaving_window(self) -> int | None:
        """With ``on_lagging_tier="wait"`` on a RAM first tier: the oldest step it keeps now.
        An older one a slower tier still has queued is waited for before this save stages:
        its file is the one this save needs, with the kept steps' and this one's making
        ``keep + 1``."""
        first = self.first()
        keep = first.tier.keep
        if keep is None or not part_file.recycles(self.config, first.own):
            return None
        kept = sorted(s for s in first.committed() if s < self.step)[-keep:]
        return kept[0] if kept else None
