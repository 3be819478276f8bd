"""Re-check every checksum of a step on every tier that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_dcp.storage.codec import ChecksumMismatch, raw_length, read_item

from .catalog import load_metadata, views
from .config import TieredConfig


@dataclass
class TierCheck:
    """The outcome of verifying one step on one tier."""

    tier_index: int
    tier: str
    step: int
    items: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(config: TieredConfig, step: int, node: int = 0, rank: int = 0) -> list[TierCheck]:
    """Read and check every chunk of ``step`` on each tier with a commit marker for it."""
    checks = []
    for view in views(config, node, rank):
        copy = view.committed().get(step)
        if copy is None:
            continue
        check = TierCheck(view.index, view.tier.path, step)
        checks.append(check)
        check.problems.extend(view.missing(copy.store, copy.marker))
        try:
            md = load_metadata(copy)
        except (OSError, ChecksumMismatch) as e:
            check.problems.append(f"metadata: {e}")
            continue
        for index, rec in sorted(md.storage_data.items(), key=lambda kv: (kv[1]["rank"], kv[1]["offset"])):
            store = view.part_store(copy.marker, rec["rank"])
            key = view.part_key(step, rec["rank"])
            try:
                read_item(store, key, rec, memoryview(bytearray(raw_length(rec))))
            except (OSError, ChecksumMismatch) as e:
                check.problems.append(f"{store.describe(key)}: item {index.fqn!r}: {e}")
            check.items += 1
            check.bytes_read += rec["length"]
    return checks
