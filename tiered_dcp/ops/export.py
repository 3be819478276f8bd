"""Export a step out of the tiers: as a stock DCP directory, or as Hugging Face safetensors.

One flow (``run_export``): choose the step (the newest that loads, as ``load_latest`` picks
it, or the one asked for), select its items (``only``: the items under a name prefix, the
prefix removed), and hand them to a format. A format is an object with ``write``; it reads
what it needs through ``Items`` (DCP loads from the tiers: resharded from every rank's
shards, every byte checked) and writes into a fresh directory that replaces nothing until
the whole export is written, so an export that fails (damage found midway, a full disk)
leaves ``dest`` as it was.

- ``DcpFormat``: one ``dcp.save`` of the selected state with torch's ``FileSystemWriter``,
  holding it whole in memory (a stock DCP directory has one ``.metadata`` for every item).
- ``SafetensorsFormat``: what inference stacks load. Tensors are packed in state-dict order
  into files of at most ``max_shard_size`` bytes (one file: ``model.safetensors``; more:
  ``model-0000i-of-0000n.safetensors`` and the ``model.safetensors.index.json`` Hugging Face
  writes); each file's tensors are read whole by one load of just those items and written by
  the ``safetensors`` package (``save_file``, which writes from the tensors' memory), then
  dropped: memory holds one output file's tensors at a time, never the whole state.
  Non-tensor items have no place in safetensors; they are left out and named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import TieredConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's "5GB"


@dataclass(frozen=True)
class Written:
    """What a format wrote."""

    files: tuple[str, ...]  # names in the directory, in the order they are to appear
    tensors: int
    bytes: int  # tensor bytes
    left_out: tuple[str, ...] = ()  # selected items the format cannot hold (their names)


@dataclass(frozen=True)
class Exported:
    """What an export wrote, and where: the summary the CLI prints."""

    step: int
    dest: str
    format: str
    written: Written


Progress = Callable[[str, int, int, int], None]  # (file written, its bytes, files done, files in all)


class Items:
    """The selected items of one step, read through one reader of it; ``progress`` is told
    of each file a format has written."""

    def __init__(self, reader: Any, only: str | None, progress: Progress | None = None) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.progress = progress or (lambda name, size, done, total: None)
        self.reader = reader
        self.step: int = reader.step
        self.metadata = reader.read_metadata()
        self.prefix = "" if only is None else only.rstrip(".") + "."
        entries = self.metadata.state_dict_metadata
        self.fqns = [k for k in entries if k.startswith(self.prefix) and len(k) > len(self.prefix)]
        if not self.fqns:
            tops = sorted({k.split(".", 1)[0] for k in entries})
            raise ValueError(
                f"step {self.step} holds no item under {self.prefix!r}: its names start with "
                f"{', '.join(tops) or 'nothing'} (--only takes one of those, or nothing for every item)"
            )
        self.tensors = {k: entries[k] for k in self.fqns if isinstance(entries[k], TensorStorageMetadata)}

    def name(self, fqn: str) -> str:
        """The item's name in the export: its state-dict name with the ``only`` prefix removed."""
        return fqn[len(self.prefix) :]

    def nbytes(self, fqn: str) -> int:
        md = self.tensors[fqn]
        return md.size.numel() * md.properties.dtype.itemsize

    def load(self, fqns: list[str]) -> dict[str, Any]:
        """These items, whole (a sharded tensor assembled from every rank's shards), by name."""
        import torch
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        entries = self.metadata.state_dict_metadata
        state: dict[str, Any] = {}
        for k in fqns:
            md = entries[k]
            state[k] = torch.empty(md.size, dtype=md.properties.dtype) if k in self.tensors else md
        _load_state_dict(
            state,
            storage_reader=self.reader,
            planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )
        return {self.name(k): v for k, v in state.items()}


class ExportFormat(Protocol):
    name: str

    def write(self, items: Items, out: str) -> Written:
        """Write ``items`` into the empty directory ``out``."""
        ...


class DcpFormat:
    """A stock DCP directory: ``FileSystemReader(dest)`` loads it, no tiered-dcp needed."""

    name = "dcp"

    def write(self, items: Items, out: str) -> Written:
        import torch.distributed.checkpoint as dcp

        state = items.load(items.fqns) if items.prefix else read_whole(items.reader)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
        size = sum(items.nbytes(k) for k in items.tensors)
        items.progress(".metadata", size, 1, 1)
        return Written(tuple(sorted(os.listdir(out))), len(items.tensors), size)


class SafetensorsFormat:
    """Hugging Face safetensors, sharded by size; one output file in memory at a time."""

    name = "safetensors"

    def __init__(self, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> None:
        if max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be > 0 bytes, got {max_shard_size}")
        self.max_shard_size = max_shard_size

    def files(self, items: Items) -> list[list[str]]:
        """The tensors' fqns per output file: packed in state-dict order, a file closed when the
        next tensor would take it past ``max_shard_size`` (a larger tensor gets a file alone)."""
        out: list[list[str]] = []
        size = 0
        for k in items.tensors:
            n = items.nbytes(k)
            if not out or (size + n > self.max_shard_size and out[-1]):
                out.append([])
                size = 0
            out[-1].append(k)
            size += n
        return out

    def write(self, items: Items, out: str) -> Written:
        from safetensors.torch import save_file

        left_out = tuple(items.name(k) for k in items.fqns if k not in items.tensors)
        if not items.tensors:
            raise ValueError(
                f"step {items.step} holds no tensor under {items.prefix!r}, only "
                f"{', '.join(left_out)}: safetensors holds tensors"
            )
        groups = self.files(items)
        n = len(groups)
        names = (
            [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        header = {"format": "pt", "tiered_dcp.step": str(items.step)}
        weight_map: dict[str, str] = {}
        total = 0
        for i, (name, fqns) in enumerate(zip(names, groups, strict=True), 1):
            tensors = items.load(fqns)
            save_file(tensors, os.path.join(out, name), metadata=header)
            weight_map.update(dict.fromkeys(tensors, name))
            size = sum(items.nbytes(k) for k in fqns)
            total += size
            del tensors
            items.progress(name, size, i, n)
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(out, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
            names.append(INDEX_FILE)
        return Written(tuple(names), len(items.tensors), total, left_out)


def format_named(name: str, max_shard_size: int | None = None) -> ExportFormat:
    """The export format called ``name``; the safetensors package must be installed for it."""
    if name == "dcp":
        if max_shard_size is not None:
            raise ValueError("max_shard_size applies to format='safetensors' only")
        return DcpFormat()
    if name == "safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ValueError(
                "format='safetensors' needs the safetensors package: pip install safetensors "
                "(or pip install 'tiered-dcp[safetensors]')"
            ) from None
        return SafetensorsFormat(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    raise ValueError(f"unknown export format {name!r}: 'dcp' (the default) or 'safetensors'")


def run_export(
    config: TieredConfig,
    step: int | None,
    dest: str | os.PathLike,
    fmt: ExportFormat,
    only: str | None = None,
    progress: Progress | None = None,
) -> Exported:
    """Export ``step`` (None: the newest that loads) of ``config`` into the local directory
    ``dest`` as ``fmt``. ``dest`` may exist; files of the export's own names already there are
    refused rather than mixed with, and nothing lands in it until the export is whole."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ..load.reader import TieredReader
    from ..load.resume import resume, unwrapped

    dest = os.fspath(dest)
    if "://" in dest and not dest.startswith("file://"):
        raise ValueError(f"export writes a local directory, not {dest}: export there, then copy it up")
    dest = dest.removeprefix("file://")
    _check_dest(dest)

    def write(reader: Any) -> Written:
        items = Items(reader, only, progress)
        with reader.held(), _fresh_dir(dest) as out:  # leased until the last file is read
            written = fmt.write(items, out)
            _move_into(out, dest, written.files)
        return written

    with one_process():
        try:
            if step is None:
                step, written = resume(config, write, caller="export", no_dist=True)
            else:
                written = write(TieredReader(config, step, no_dist=True))
        except CheckpointException as e:
            raise unwrapped(e) from None
    return Exported(step, dest, fmt.name, written)


def read_whole(reader: Any, keys: set[str] | None = None) -> dict:
    """Every item ``reader`` holds, as the state dict its metadata describes (unsharded, nested
    as it was saved); with ``keys``, only those items are read, the other tensors left
    unfilled (``torch.empty``, for the caller to replace). Non-tensor values reach torch's
    planner, which unpickles them with ``weights_only=False``, only once they load as plain
    data (``user_values.checked``): an import reads a checkpoint from elsewhere with torch's
    own reader, which does not check."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..load.user_values import checked

    class Checked(_EmptyStateDictLoadPlanner):
        def create_local_plan(self) -> Any:
            """torch's plan, of ``keys`` only: its own filter leaves holes in a list whose
            other items are not read, and a list with holes no longer flattens to its items."""
            plan = super().create_local_plan()
            if keys is None:
                return plan
            return dataclasses.replace(plan, items=[r for r in plan.items if r.dest_index.fqn in keys])

        def load_bytes(self, read_item: Any, value: Any) -> None:
            super().load_bytes(read_item, checked(value.read()))

    state: dict = {}
    _load_state_dict(state, storage_reader=reader, planner=Checked(), no_dist=True)
    return state


def _check_dest(dest: str) -> None:
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise ValueError(f"{dest} is a file: export writes a directory")
    taken = [
        n
        for n in (os.listdir(dest) if os.path.isdir(dest) else [])
        if n in (".metadata", SINGLE_FILE, INDEX_FILE)
        or (n.startswith("model-") and n.endswith(".safetensors"))
    ]
    if taken:
        raise ValueError(
            f"{dest} already holds an export ({', '.join(sorted(taken)[:3])}): "
            "choose an empty directory, or remove those files"
        )


@contextlib.contextmanager
def _fresh_dir(dest: str) -> Iterator[str]:
    """A new directory beside the export's files (so they move in by rename), gone after;
    on a failure, ``dest`` too when this made it."""
    made = not os.path.exists(dest)
    os.makedirs(dest, exist_ok=True)
    out = tempfile.mkdtemp(prefix=".tiered-dcp-export.", dir=dest)
    try:
        yield out
    except BaseException:
        shutil.rmtree(out if not made else dest, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)


def _move_into(out: str, dest: str, files: tuple[str, ...]) -> None:
    """Rename the written files into ``dest``; the file readers open first (the index, the
    ``.metadata``) last, so a reader never finds it before what it names."""
    last = [f for f in files if f in (INDEX_FILE, ".metadata")]
    for f in [f for f in files if f not in last] + last:
        os.replace(os.path.join(out, f), os.path.join(dest, f))


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """Quiet DCP's note that it runs in one process: exports and imports mean to."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
