"""Re-check every checksum of a step on every tier that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_dcp.storage.codec import ChecksumMismatch, read_item
from tiered_dcp.storage.format import IndexCache, ItemInfo, ItemKey, part_key

from .catalog import views
from .config import TieredConfig
from .metadata import item_key, legacy_index, load_metadata


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
    """Read and check every chunk of ``step`` on each tier with a commit marker for it.

    Every item of the metadata is read where its part is found whole (own root first), as
    that root's index records it, and checked against the metadata's checksums as well.
    """
    checks = []
    for view in views(config, node, rank, IndexCache()):
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
        by_part: dict[int, list[tuple[str, ItemKey, ItemInfo]]] = {}
        for index, d in md.storage_data.items():
            info = ItemInfo.from_dict(d)
            by_part.setdefault(info.rank, []).append((index.fqn, item_key(index), info))
        for part, items in sorted(by_part.items()):
            store = view.part_store(copy.marker, part)
            index = view.part_index(store, copy.marker, part)
            if index is None and not copy.marker.has_indexes:  # format 1/2: the metadata's records
                index = legacy_index(md, config.namespace, step, part)
            if index is None:
                key = part_key(config.namespace, step, part)
                check.problems.append(f"{store.describe(key)}: no readable index next to it")
                continue
            found = [(fqn, info, index.records.get(key)) for fqn, key, info in items]
            for fqn, info, rec in sorted(found, key=lambda f: (f[2].file, f[2].offset) if f[2] else ("", 0)):
                if rec is None:
                    check.problems.append(f"item {fqn!r} of rank {part}'s part: not in its index")
                    continue
                if rec.raw_chunks != info.raw_chunks:
                    check.problems.append(f"item {fqn!r}: its index and the metadata disagree on its chunks")
                try:
                    read_item(store, rec, memoryview(bytearray(rec.raw_length)))
                except (OSError, ChecksumMismatch) as e:
                    check.problems.append(f"{store.describe(rec.file)}: item {fqn!r}: {e}")
                check.items += 1
                check.bytes_read += rec.length
    return checks
