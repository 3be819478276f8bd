"""tiered-dcp in torchtitan: a CheckpointManager whose saves and loads go through the tiers.

torchtitan (checked with 0.3.0) has no config key for a custom DCP StorageWriter or
StorageReader, so this subclass overrides the two places where its CheckpointManager calls
DCP (``dcp_save``, ``dcp_load``) and the search for the newest step (``_find_load_step``),
which otherwise looks for ``step-N/.metadata`` files. Copy this file into your project and
set your trainer config's checkpoint section to it:

    checkpoint=TieredCheckpointManager.Config(
        enable=True, interval=100, async_mode="async", keep_latest_k=0,
        tiered=TieredConfig("llama3-8b", [Tier("/dev/shm/tdcp/{node}", every=1, keep=2),
                                          Tier("gs://bucket/ckpt", every=500)]),
    )

- ``async_mode="async"``: ``dcp.async_save`` with ``TieredWriter`` as the stager (reusable
  shared-memory buffers; the loop waits for one copy). ``"async_with_pinned_mem"``: the
  same with ``background_staging=True`` (the copy runs in a thread; torchtitan waits on
  ``staging_completion`` before the next optimizer step). ``"disabled"``: ``dcp.save``.
- Retention is each tier's ``keep``: set ``keep_latest_k=0`` (torchtitan's purge only
  deletes the empty ``step-N`` directories this manager leaves in ``folder``).
- ``folder`` (a local path here) holds only those empty directories, which torchtitan's
  own resume logic checks for; no checkpoint bytes land there.
- A Hugging Face export (``last_save_in_hf``) and ``initial_load_path`` still read and
  write files the stock way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager

from tiered_dcp import NoCheckpointError, TieredConfig, TieredReader, TieredWriter, load_latest


class TieredCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with its DCP checkpoints kept on tiered-dcp tiers."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tiered: TieredConfig | None = None
        """The tiers; None keeps torchtitan's own file checkpoints."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.tiered = config.tiered
        if self.enable and self.tiered is not None:
            os.makedirs(self.folder, exist_ok=True)  # torchtitan loads only if the folder exists

    def _tiered_step(self, checkpoint_id: str) -> int | None:
        """The step of ``folder/step-N``, or None for any other path (an initial load)."""
        parent, name = os.path.split(os.path.normpath(checkpoint_id))
        if self.tiered is None or parent != os.path.normpath(self.folder) or not name.startswith("step-"):
            return None
        return int(name.removeprefix("step-"))

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        path = super()._create_checkpoint_id(step, folder)
        if self.tiered is not None and not folder:
            os.makedirs(path, exist_ok=True)  # torchtitan checks that a step it loads is a directory
        return path

    def _find_load_step(self, folder: str = "") -> int:
        if self.tiered is None or folder:
            return super()._find_load_step(folder)
        try:  # every rank agrees on the newest good step complete on some tier (or in the cluster)
            self._resume_step = TieredReader(self.tiered).step
        except NoCheckpointError:
            return -1
        return self._resume_step

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        step = self._tiered_step(checkpoint_id)
        if to_hf or step is None:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.DISABLED:
            return dcp.save(state_dict, storage_writer=TieredWriter(self.tiered, step=step))
        writer = TieredWriter(
            self.tiered, step=step, background_staging=async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
        )
        # AsyncSaveResponse with background staging, else a Future, as torchtitan expects
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)

    def dcp_load(
        self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool
    ) -> None:
        step = self._tiered_step(checkpoint_id)
        if from_hf or step is None:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if step == getattr(self, "_resume_step", None):  # a resume: the newest step that loads
            load_latest(state_dict, self.tiered, process_group=self.pg)  # (its train state says which)
        else:
            dcp.load(state_dict, storage_reader=TieredReader(self.tiered, step=step))
        if MODEL in self.states:  # as torchtitan does: its model states are flattened in
            self.states[MODEL].load_state_dict(state_dict)
