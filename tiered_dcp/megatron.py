"""Megatron-core ``dist_checkpointing`` through the tiers (the ``tiered-dcp[megatron]`` extra).

    from tiered_dcp.megatron import TieredLoadStrategy, TieredSaveStrategy, load_latest

    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=TieredSaveStrategy(config))
    dist_checkpointing.load(sharded_sd, ckpt_dir, sharded_strategy=TieredLoadStrategy(config))
    state, step = load_latest(sharded_sd, save_dir, config)  # the resume call

Megatron (0.19+) keeps no strategy registry, and ``serialization.save`` swaps any strategy
that is not a ``TorchDistSaveShardedStrategy`` for a stock one, so the save strategy is a
subclass of it. The tensors go to the tiers as one step of ``config``; ``ckpt_dir`` keeps
only the small files Megatron reads itself before it calls a strategy: ``metadata.json``
(written by Megatron), the common (non-sharded) state as a one-item DCP checkpoint (the
way Megatron stores it), and ``tiered_dcp.json``, naming the namespace and step saved
there, which a load with ``step=None`` follows.

An async save (``async_sharded_save=True``) returns Megatron's ``AsyncRequest``: the state
is staged into reusable host buffers (the loop's only stall), the step is written by a
thread of this process over a gloo group of its own, and the request's ``async_fn`` (run in
the process Megatron's ``AsyncCallsQueue`` starts) only waits for that thread, so that the
queue's "done on every rank" means committed on the fastest tier. The finalize step raises
the save's error, if any, and writes the small files.

``load_latest`` is the resume: the newest step of the tiers that loads, through the
checkpoint directory under ``save_dir`` that names it (a step can only be loaded through
the directory it was saved to: Megatron reads the common state from there).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import io
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

try:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner,
        MCoreSavePlanner,
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
        _replace_sharded_keys_with_state_dict_keys,
        _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types,
        _unwrap_pyt_sharded_tensor,
        get_async_strategy,
        mcore_to_pyt_state_dict,
    )
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tiered_dcp.megatron needs megatron-core >= 0.19: pip install 'tiered-dcp[megatron]'"
    ) from e
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from tiered_dcp.storage.forks import ThreadPool, renew_in_child
from tiered_dcp.storage.owners import pid_alive

from .config import TieredConfig
from .errors import NoCheckpointError
from .load.discovery import broadcast_bytes
from .load.reader import TieredReader
from .load.resume import resume
from .ranks import worlds
from .save.writer import TieredWriter

POINTER = "tiered_dcp.json"  # in ckpt_dir: which namespace and step were saved there
COMMON_KEY = ShardedObject("common_state", None, (1,), (0,)).unique_key  # Megatron's own key


def step_from_dir(ckpt_dir: str | os.PathLike) -> int:
    """The step a directory's name ends with: Megatron-LM's ``iter_0000100`` -> 100."""
    name = Path(ckpt_dir).name
    m = re.search(r"(\d+)$", name)
    if m is None:
        raise ValueError(
            f"TieredSaveStrategy: cannot take the step from the directory name {name!r} (it "
            "does not end with a number, as Megatron-LM's iter_0000100 does); pass "
            "TieredSaveStrategy(config, step=N)"
        )
    return int(m.group(1))


def read_pointer(ckpt_dir: str | os.PathLike) -> dict | None:
    """The namespace and step a TieredSaveStrategy saved into ``ckpt_dir``, or None."""
    try:
        return json.loads((Path(ckpt_dir) / POINTER).read_text())
    except (OSError, ValueError):
        return None


def _check_step(step: int | None, who: str) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"{who}: step must be None or an integer >= 0, got {step!r}")


def _check_config(config: Any, who: str) -> None:
    if not isinstance(config, TieredConfig):
        raise ValueError(f"{who}: config must be a TieredConfig, got {type(config).__name__}")


def _save_planner() -> MCoreSavePlanner:
    """The planner Megatron's own torch_dist save uses (its BytesIO objects kept as they are)."""
    return MCoreSavePlanner(
        dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False
    )


class TieredSaveStrategy(TorchDistSaveShardedStrategy):
    """Saves Megatron's sharded state dict as one step of ``config``, on its tiers.

    ``step=None`` takes the step from ``ckpt_dir``'s name (``iter_0000100`` -> 100).
    ``writer_options`` go to ``TieredWriter`` (``staging_slots``, ``max_pending``,
    ``handle_sigterm``; ``background_staging`` has no effect here). Only the main replica of
    each shard is saved, as with Megatron's default.
    """

    def __init__(self, config: TieredConfig, step: int | None = None, **writer_options: Any) -> None:
        _check_config(config, "TieredSaveStrategy")
        _check_step(step, "TieredSaveStrategy")
        try:  # an unknown option fails here, not at the first save
            inspect.signature(TieredWriter).bind(config, 0, **writer_options)
        except TypeError as e:
            raise ValueError(f"TieredSaveStrategy: {e} (options are TieredWriter's)") from e
        super().__init__(backend="torch_dist", version=1, keep_only_main_replica=True)
        self.config = config
        self.step = step
        self.writer_options = writer_options

    def _writer(self, ckpt_dir: str | os.PathLike) -> TieredWriter:
        step = self.step if self.step is not None else step_from_dir(ckpt_dir)
        return TieredWriter(self.config, step, **self.writer_options)

    def save(self, sharded_state_dict: dict, checkpoint_dir: str | os.PathLike) -> None:
        """Write the step (committed on its fastest tier when this returns), then ckpt_dir's files."""
        writer = self._writer(checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, False)
        # an async save still writing first: saves agree on their store keys by call order
        wait(list(_IN_FLIGHT))
        dcp.save(pyt_state_dict, storage_writer=writer, planner=_save_planner())
        _write_small_files(self.config, writer.step, pyt_state_dict.get(COMMON_KEY), checkpoint_dir)

    def async_save(
        self, sharded_state_dict: dict, checkpoint_dir: str | os.PathLike, async_strategy: str = "nvrx"
    ) -> Any:
        """Stage the state, start the step's write in a thread, return the request to schedule.

        The request is NVRx's ``AsyncRequest`` when ``async_strategy="nvrx"`` and NVRx is
        installed, else Megatron's own: schedule it on the matching ``AsyncCallsQueue``.
        """
        writer = self._writer(checkpoint_dir)
        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        staged_flat, staged = _stage(flat, writer)
        pyt_state_dict = mcore_to_pyt_state_dict(staged_flat, False)
        common = pyt_state_dict.get(COMMON_KEY)  # what finalize writes; the rest is the thread's
        group = _save_group()
        done = _done_dir() / f"{uuid.uuid4().hex}.done"
        future = _executor().submit(_save_in_thread, pyt_state_dict, writer, group, done, staged)
        del staged
        _IN_FLIGHT.add(future)
        future.add_done_callback(_IN_FLIGHT.discard)

        def finalize() -> None:
            try:
                future.result()  # the save's error, if any: DCP raises it on every rank
            finally:
                done.unlink(missing_ok=True)
            _write_small_files(self.config, writer.step, common, checkpoint_dir)

        request_cls = AsyncRequest
        if async_strategy == "nvrx":
            # without NVRx: Megatron's own request, for its own AsyncCallsQueue
            with contextlib.suppress(ModuleNotFoundError):
                _, request_cls = get_async_strategy("nvrx", module="AsyncRequest")
        return request_cls(wait_for_save, (str(done), os.getpid()), [finalize])


class TieredLoadStrategy(TorchDistLoadShardedStrategy):
    """Loads Megatron's sharded state dict from the tiers of ``config``.

    ``step=None`` loads the step that ``TieredSaveStrategy`` saved into ``ckpt_dir`` (its
    ``tiered_dcp.json``). Resharding (another world size or parallel layout) works as with
    Megatron's torch_dist format. ``load_tensors_metadata`` / ``load_sharded_metadata`` read
    the step's metadata without collectives, so one rank may call them alone.
    """

    def __init__(self, config: TieredConfig, step: int | None = None) -> None:
        _check_config(config, "TieredLoadStrategy")
        _check_step(step, "TieredLoadStrategy")
        super().__init__()
        self.config = config
        self.step = step
        self._reader: TieredReader | None = None  # load_latest's reader of ``step``, used once

    def _step(self, ckpt_dir: str | os.PathLike) -> int:
        """The step to load: ``step``, else the one ``ckpt_dir`` names.

        Megatron has read the common state from ``ckpt_dir`` before it calls the strategy,
        so an explicit step that differs from the one saved there would mix two steps.
        """
        pointer = read_pointer(ckpt_dir)
        if self.step is not None:
            if pointer is not None and (pointer.get("namespace"), pointer.get("step")) != (
                self.config.namespace,
                self.step,
            ):
                raise ValueError(
                    f"TieredLoadStrategy: {ckpt_dir} holds the common state of step "
                    f"{pointer.get('step')} of namespace {pointer.get('namespace')!r}, which Megatron "
                    f"has already read; load step {self.step} through the directory it was saved to"
                )
            return self.step
        if pointer is None:
            raise NoCheckpointError(
                f"{ckpt_dir} has no {POINTER}: it was not saved by TieredSaveStrategy; pass "
                "TieredLoadStrategy(config, step=N) to load a step of the tiers by number"
            )
        if pointer.get("namespace") != self.config.namespace:
            raise NoCheckpointError(
                f"{ckpt_dir} was saved under namespace {pointer.get('namespace')!r}, not "
                f"{self.config.namespace!r}: use that run's TieredConfig"
            )
        return int(pointer["step"])

    def load(self, sharded_state_dict: dict, checkpoint_dir: str | os.PathLike, *args: Any) -> dict:
        """Megatron's torch_dist load, reading from the tiers instead of ``checkpoint_dir``."""
        step = self._step(checkpoint_dir)
        reader, self._reader = self._reader, None
        if reader is None or reader.step != step:
            reader = TieredReader(self.config, step).open()  # collective: every rank
        flexible = [t for t in _sharded_tensors(sharded_state_dict) if not t.allow_shape_mismatch]
        mismatch = {t.key: t for t in _sharded_tensors(sharded_state_dict) if t.allow_shape_mismatch}
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=flexible,
            allow_shape_mismatch_sharded_tensors=mismatch,
            stream_ckpt_dequant=self.stream_ckpt_dequant,
            flatten_state_dict=False,
            flatten_sharded_tensors=False,
        )
        dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded

    def _metadata(self, checkpoint_dir: str | os.PathLike) -> Metadata:
        return TieredReader(self.config, self._step(checkpoint_dir), no_dist=True).read_metadata()

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None) -> dict:
        """Global shape and dtype of every tensor of the step (ShardedTensors without data)."""
        return super().load_tensors_metadata(checkpoint_dir, metadata or self._metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: Path) -> dict:
        """As ``load_tensors_metadata``, plus the step's ShardedObjects."""
        metadata = self._metadata(checkpoint_dir)
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        raise NotImplementedError("TieredLoadStrategy: a committed step of the tiers is never rewritten")


def load_latest(
    sharded_state_dict: dict | Callable[[str], dict],
    save_dir: str | os.PathLike,
    config: TieredConfig,
    **load_kwargs: Any,
) -> tuple[Any, int]:
    """Megatron's resume: load the newest step of ``config`` that loads completely, through
    the checkpoint directory under ``save_dir`` that names it (``iter_0000100/tiered_dcp.json``),
    on every rank the same step; return what ``dist_checkpointing.load`` returns, and the step.

    The steps are chosen as ``tiered_dcp.load_latest`` chooses them (``resume``): quarantined
    and non-finite steps are passed over, and so is a step whose load fails for its data
    (quarantined by that load) and a step that no complete checkpoint directory under
    ``save_dir`` names (gone, or its save stopped before Megatron wrote ``metadata.json``);
    one warning (rank 0) names each newer step passed over, and why. ``NoCheckpointError``
    when none loads. Megatron's tracker file is not read: a directory newer than the one it
    names loads if its step does.

    ``sharded_state_dict`` is the one to load into, or a callable that makes it from the
    checkpoint directory about to be loaded (Megatron-LM builds it from what the checkpoint
    holds: ``dist_checkpointing.load_content_metadata(ckpt_dir)``). ``load_kwargs`` go to
    ``dist_checkpointing.load`` (``strict``, ``validate_access_integrity``...); an error that
    is not about the step's data is raised as is.
    """
    _check_config(config, "load_latest")
    if "sharded_strategy" in load_kwargs:
        raise ValueError("tiered_dcp.megatron.load_latest: the strategy is TieredLoadStrategy(config)")
    dirs, why_not = _checkpoint_dirs(save_dir, config.namespace)

    def unusable(step: int) -> str | None:
        if step in dirs:
            return None
        return why_not.get(step) or f"no checkpoint directory under {save_dir} names it ({POINTER})"

    def load(reader: TieredReader) -> Any:
        ckpt_dir = dirs[reader.step]
        strategy = TieredLoadStrategy(config, step=reader.step)
        strategy._reader = reader  # the step's reader, chosen and leased: not a second one
        target = sharded_state_dict(ckpt_dir) if callable(sharded_state_dict) else sharded_state_dict
        return dist_checkpointing.load(target, ckpt_dir, sharded_strategy=strategy, **load_kwargs)

    step, loaded = resume(config, load, caller="tiered_dcp.megatron.load_latest", unusable=unusable)
    return loaded, step


def _checkpoint_dirs(save_dir: str | os.PathLike, namespace: str) -> tuple[dict[int, str], dict[int, str]]:
    """Step -> the checkpoint directory under ``save_dir`` to load it through; step -> why the
    directories naming it cannot be. Rank 0's look, the same on every rank (its error too)."""
    blob = None
    if not worlds.dist_up() or dist.get_rank() == 0:
        try:
            blob = json.dumps([*_scan(Path(save_dir), namespace), None]).encode()
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            blob = json.dumps([{}, {}, f"{type(e).__name__}: {e}"]).encode()
    if worlds.dist_up():
        blob = broadcast_bytes(blob)
    dirs, why_not, error = json.loads(blob)
    if error is not None:
        raise ValueError(f"tiered_dcp.megatron.load_latest: {save_dir}: {error}")
    return {int(s): d for s, d in dirs.items()}, {int(s): w for s, w in why_not.items()}


def _scan(save_dir: Path, namespace: str) -> tuple[dict[int, str], dict[int, str]]:
    """The checkpoint directories directly under ``save_dir`` saved under ``namespace``: each
    step's, where ``metadata.json`` says Megatron finished it (two naming one step: the one
    written last, whose common state goes with the step's newest save)."""
    if (save_dir / POINTER).exists():
        raise ValueError(
            f"it is a checkpoint directory itself (it holds {POINTER}): pass the directory that "
            "holds the iter_... directories (Megatron-LM's --save / --load)"
        )
    found: dict[int, tuple[int, str]] = {}
    why_not: dict[int, str] = {}
    try:
        children = sorted(p for p in save_dir.iterdir() if p.is_dir())
    except FileNotFoundError:  # no save_dir yet: no directory names any step
        return {}, {}
    for d in children:
        pointer = read_pointer(d)
        if not isinstance(pointer, dict) or pointer.get("namespace") != namespace:
            continue
        step = pointer.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        try:
            json.loads((d / CONFIG_FNAME).read_text())
            written = (d / POINTER).stat().st_mtime_ns
        except (OSError, ValueError) as e:
            why_not[step] = f"{d} is not a complete Megatron checkpoint ({CONFIG_FNAME}: {e})"
            continue
        if step not in found or written >= found[step][0]:
            found[step] = (written, str(d))
    return {s: d for s, (_, d) in found.items()}, {s: w for s, w in why_not.items() if s not in found}


def _sharded_tensors(tree: Any) -> list[ShardedTensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _sharded_tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _sharded_tensors(v)]
    return [tree] if isinstance(tree, ShardedTensor) else []


def _write_small_files(
    config: TieredConfig, step: int, common: io.BytesIO | None, checkpoint_dir: str | os.PathLike
) -> None:
    """On rank 0: the common state (a one-item DCP checkpoint, Megatron's layout) and the pointer.

    Called once the step is committed on its fastest tier; Megatron writes ``metadata.json``
    after this, last.
    """
    if dist.get_rank() != 0:
        return
    ckpt = Path(checkpoint_dir)
    if common is not None:  # Megatron's save() always adds it; a direct strategy call may not
        dcp.save(
            {COMMON_KEY: io.BytesIO(common.getvalue())},
            storage_writer=dcp.FileSystemWriter(ckpt),
            planner=_save_planner(),
            no_dist=True,
        )
    tmp = ckpt / f".{POINTER}.tmp"
    tmp.write_text(json.dumps({"format": 1, "namespace": config.namespace, "step": step}))
    os.replace(tmp, ckpt / POINTER)


def _stage(flat: dict[str, list], writer: TieredWriter) -> tuple[dict[str, list], Any]:
    """Copies of the ShardedTensors whose data is staged in the writer's reusable buffers.

    The staged dict holds a staging slot until it is dropped, which the save thread does
    when the step is committed (a SIGTERM waits for that, see ``preemption``).
    """
    tensors = {
        f"{key}/{i}": sh.data
        for key, items in flat.items()
        for i, sh in enumerate(items)
        if isinstance(sh, ShardedTensor) and sh.data is not None
    }
    staged = writer.stage(tensors)
    if isinstance(staged, Future):
        staged = staged.result()
    out: dict[str, list] = {}
    for key, items in flat.items():
        out[key] = []
        for i, sh in enumerate(items):
            if f"{key}/{i}" in staged:
                sh = copy.copy(sh)
                sh.data = staged[f"{key}/{i}"]
            out[key].append(sh)
    return out, staged


def _save_in_thread(pyt_state_dict: dict, writer: TieredWriter, group: Any, done: Path, staged: Any) -> None:
    try:
        dcp.save(pyt_state_dict, storage_writer=writer, planner=_save_planner(), process_group=group)
    finally:
        del staged
        done.touch()


def wait_for_save(done: str, owner_pid: int, poll: float = 0.01) -> None:
    """The ``async_fn`` Megatron's queue runs: returns once the save thread has finished.

    Runs in the process the queue starts (forked, or its persistent worker); it also ends
    if the trainer that owns the save is gone.
    """
    while not os.path.exists(done) and pid_alive(owner_pid):
        time.sleep(poll)


_IN_FLIGHT: set[Future] = set()  # this process's async saves whose thread has not finished
_GROUPS: dict[int, Any] = {}
_EXECUTOR: ThreadPoolExecutor | None = None
_DONE_DIR: Path | None = None


def _save_group() -> Any:
    """A gloo group over every rank for the save thread's collectives (one per world group).

    The training loop keeps the default group (NCCL, or gloo on CPU) for itself, Megatron's
    queue included; collectives from two threads on one group would interleave.
    """
    world = dist.group.WORLD
    if id(world) not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[id(world)] = dist.new_group(backend="gloo")
    return _GROUPS[id(world)]


_executor = ThreadPool("tiered-dcp-megatron", 1)


@renew_in_child
def _forget_saves() -> None:
    """A child's saves are its own: its parent's futures and groups are not waited for here."""
    global _DONE_DIR
    _IN_FLIGHT.clear()
    _GROUPS.clear()
    _DONE_DIR = None


def _done_dir() -> Path:
    global _DONE_DIR
    if _DONE_DIR is None:
        _DONE_DIR = Path(tempfile.mkdtemp(prefix="tdcp-megatron-"))
        atexit.register(_remove_in, os.getpid(), _DONE_DIR)
    return _DONE_DIR


def _remove_in(pid: int, path: Path) -> None:
    """At exit, the directory this process made (a forked child runs its parent's atexit too)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "POINTER",
    "TieredLoadStrategy",
    "TieredSaveStrategy",
    "load_latest",
    "read_pointer",
    "step_from_dir",
]
