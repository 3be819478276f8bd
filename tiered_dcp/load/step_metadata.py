"""StepMetadata: the opened step's DCP metadata, per copy, each loaded at most once.

The copies of one save hold the same metadata bytes (their markers carry its checksum):
the cluster's, broadcast when the step is opened (``open_step``), serves every node-local
tier; a shared tier's copy is loaded (or was broadcast by rank 0) once, and a copy whose
checksum was loaded already is not read again. A copy whose metadata cannot be read, or is
damaged, is remembered with the reason, for the error raised when no copy is usable. One
per opened step, used by the opening and by the reads (``step_reads``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch.distributed.checkpoint.metadata import Metadata

from tiered_dcp.storage.codec import ChecksumMismatch

from ..errors import NoCheckpointError
from ..steps import metadata as md_blob
from ..steps.catalog import StepCopy, TierView
from .peer_exchange import ClusterCopy

log = logging.getLogger(__name__)


class StepMetadata:
    """The metadata of ``step``'s copies, as far as it was loaded, and why a copy's was not."""

    def __init__(self, step: int, views: Mapping[int, TierView]) -> None:
        self.step = step
        self._views = views
        self.cluster: Metadata | None = None  # the cluster's copy's: the same on every node-local tier
        self._cluster_ident: int | None = None  # its checksum
        self._cluster_tiers: set[int] = set()  # the node-local tiers it serves
        self._by_tier: dict[int, Metadata | None] = {}  # tier -> its copy's (None: unusable)
        self._bad: dict[int, str] = {}  # tier -> why its copy's is unusable
        self._by_ident: dict[int, Metadata] = {}  # metadata checksum -> the metadata loaded from it

    def set_cluster(self, md: Metadata, cluster: list[ClusterCopy]) -> None:
        """The cluster's metadata (``cluster``: the step's copies on node-local tiers)."""
        self.cluster = md
        self._cluster_ident = cluster[0].ident
        self._cluster_tiers = {cc.tier_index for cc in cluster}

    def known(self, copy: StepCopy) -> Metadata | None:
        """Metadata already loaded from bytes with this copy's checksum (the same on every tier)."""
        ident = copy.marker.metadata_xxh3
        if self.cluster is not None and self._cluster_ident == ident:
            return self.cluster
        return self._by_ident.get(ident)

    def unusable(self, copy: StepCopy, e: Exception) -> str:
        """Why ``copy``'s metadata could not be loaded (``e``): removed, or ``e`` itself."""
        view = self._views[copy.tier_index]
        removed = isinstance(e, FileNotFoundError) and view.read_marker(copy.store, self.step) is None
        return f"removed from tier {copy.tier_index} (no longer committed there)" if removed else str(e)

    def remember(self, copy: StepCopy, md: Metadata | None, why: str) -> None:
        """``copy``'s metadata, loaded (``md``) or not (None, and ``why``)."""
        if md is None:
            self._bad[copy.tier_index] = why
            log.warning("step %d: metadata unusable (%s); trying the next tier", self.step, why)
        if md is not None:
            self._by_ident[copy.marker.metadata_xxh3] = md
        self._by_tier[copy.tier_index] = md

    def of(self, copy: StepCopy) -> Metadata | None:
        """``copy``'s metadata, loaded on first use; None when it is unusable there."""
        if self.cluster is not None and copy.tier_index in self._cluster_tiers:
            return self.cluster  # the same bytes on every node and node-local tier
        if copy.tier_index not in self._by_tier:
            md, why = self.known(copy), ""
            try:
                md = md or md_blob.load_metadata(copy)
            except (OSError, ChecksumMismatch) as e:
                why = self.unusable(copy, e)
            self.remember(copy, md, why)
        return self._by_tier[copy.tier_index]

    def first(self, copies: list[StepCopy], quarantine: Callable[[str], Exception]) -> Metadata:
        """The step's metadata: the cluster's, else the first of ``copies``' that is usable.

        None usable: ``NoCheckpointError`` when every copy was removed meanwhile, else the
        error ``quarantine`` gives (it marks the step damaged).
        """
        if self.cluster is not None:
            return self.cluster
        for copy in copies:
            md = self.of(copy)
            if md is not None:
                return md
        why = "; ".join(self._bad.values())
        if all(w.startswith("removed") for w in self._bad.values()):
            raise NoCheckpointError(
                f"step {self.step} was removed from every tier holding it while it was opened: {why}"
            )
        raise quarantine(f"step {self.step}: metadata damaged on every tier holding it: {why}")
