"""The hostile-record battery's worker: one damaged or crafted record, every entry point.

``python hostile_records.py WORK CLEAN`` builds a small checkpoint in ``CLEAN`` (unless there)
(steps 1 and 2 on a raw tier ``t0``; step 2 also on a zstd tier ``t1``; dedup on, so the
big tensor's chunks are blocks there), imports everything and runs every entry point once
(so that no import counts as a case's memory), then reads case names from stdin, one per
line. For each it forks a child that copies the checkpoint, alters one record (``CASES``),
and runs every entry point in turn (``ENTRY_POINTS``; a field mutation of a marker or an
index meets the two exports once per field, ``EXPORTING``) under a 30 s timer, its address space
limited, and prints one JSON line: per entry point its outcome, wall and CPU seconds, and the
case's peak memory over what the child started with. A fork per case is cheap (the imports are done) and one
case's memory or damage never reaches the next.

The cases are generated from the record formats of ``storage/format.py``: every field of
the commit marker and of an index (and of their nested parts) set to a wrong type, zero,
negative, huge, null or removed, lists made huge, keys added; the metadata unpickler fed
calls that allocate or compute, calls an admitted constructor rejects with an error of its
own (a KeyError, an OverflowError, a LookupError), a key missing, a tensor of an impossible
size; step directories named out of the format; each record file made huge and sparse, a
FIFO, a device, a directory, a link to a FIFO outside the tiers (opening it would hang:
caught as a timeout). The test (``test_hostile_records.py``) judges the outcomes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import select
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tiered_dcp import (
    Tier,
    TieredCheckpointError,
    TieredConfig,
    TieredReader,
    TieredWriter,
    export,
    latest_step,
    load_latest,
    shutdown,
    status,
    wait_for,
)

NS = "run"
N = 32768  # "w": 128 KiB, cut into blocks on the dedup tier
ENTRY_SECONDS = 30.0  # wall: only a hang reaches it (the test bounds each entry point's CPU time)
STEP = "run/step_000000000002"
HUGE = 10**20
HUGE_LIST = 10**6


def state(step: int) -> dict:
    return {
        "w": torch.arange(float(N)) + step,
        "b": torch.full((64,), float(step)),
        "n": {"step": step, "s": "x"},
    }


def zeros() -> dict:
    return {"w": torch.zeros(N), "b": torch.zeros(64), "n": {"step": 0, "s": ""}}


def exact(got: dict, step: int) -> bool:
    want = state(step)
    return all(torch.equal(got[k], want[k]) for k in ("w", "b")) and got["n"] == want["n"]


def config_of(root: Path) -> TieredConfig:
    tiers = [Tier(str(root / "t0"), every=1), Tier(str(root / "t1"), every=2, compression="zstd")]
    return TieredConfig(NS, tiers, dedup=True)


def build(root: Path) -> None:
    config = config_of(root)
    for s in (1, 2):
        dcp.save(state(s), storage_writer=TieredWriter(config, step=s))
    wait_for(config, 2, timeout=120)
    shutdown()


# -- the entry points ----------------------------------------------------------------------


def _load(config: TieredConfig, root: Path) -> str:
    got = zeros()
    dcp.load(got, storage_reader=TieredReader(config))
    return "exact" if exact(got, 2) else "WRONG DATA"


def _load_latest(config: TieredConfig, root: Path) -> str:
    got = zeros()
    step = load_latest(got, config)
    return "exact" if step == 2 and exact(got, 2) else f"WRONG: step {step}"


def _exported(dest: Path) -> str:
    got = zeros()
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(dest)))
    return "exact" if exact(got, 2) else "WRONG DATA"


def _export(config: TieredConfig, root: Path) -> str:
    dest = root / "export-api"
    export(config, None, dest)
    return _exported(dest)


def _cli(*argv: str) -> tuple[int, str]:
    """The command's exit status and what it printed."""
    from tiered_dcp.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue()


def _tiers(root: Path) -> list[str]:
    return ["-n", NS, str(root / "t0"), str(root / "t1")]


def _cli_ls(config: TieredConfig, root: Path) -> str:
    """The exit status, and the line that says a copy is damaged (if any)."""
    rc, out = _cli("ls", *_tiers(root))
    damaged = [line.strip() for line in out.splitlines() if "damaged: " in line]
    return f"rc {rc}" + "".join(f"; {line[:300]}" for line in damaged[:1])


def _cli_verify(config: TieredConfig, root: Path) -> str:
    return f"rc {_cli('verify', '--step', '2', *_tiers(root))[0]}"


def _cli_export(config: TieredConfig, root: Path) -> str:
    dest = root / "export-cli"
    rc, _ = _cli("export", "--to", str(dest), *_tiers(root))
    return _exported(dest) if rc == 0 else f"rc {rc}"


def _verify_step(config: TieredConfig, root: Path) -> str:
    from tiered_dcp.ops.verify import verify_step

    checks = verify_step(config, 2)
    bad = [p for c in checks for p in c.problems]
    return "ok" if not bad else "damage: " + " | ".join(bad)[:600]


ENTRY_POINTS: dict[str, Callable[[TieredConfig, Path], str]] = {
    "latest_step": lambda config, root: f"step {latest_step(config)}",
    "load": _load,
    "load_latest": _load_latest,
    "status": lambda config, root: f"{len(status(config))} rows",
    "verify_step": _verify_step,
    "export": _export,
    "cli_ls": _cli_ls,
    "cli_verify": _cli_verify,
    "cli_export": _cli_export,
}
# Both exports write the whole step anew (~40% of a case's time) through the reader the loads
# use: a field mutation of a marker or an index meets them once per field (``EXPORTING``),
# every other case on every case.
EXPORTS = frozenset({"export", "cli_export"})
FIELD_MUTATIONS: set[str] = set()  # the cases of ``_json_cases``, filled as they are made
EXPORTING: set[str] = set()  # those that run the exports too


# -- the cases -----------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    return json.loads(path.read_bytes())


def _write_json(path: Path, doc: Any) -> None:
    """As the library writes a marker (indented), or compact when that would be over 1 MB."""
    text = json.dumps(doc, indent=1)
    text = text if len(text) < 1 << 20 else json.dumps(doc)
    text = text.replace(json.dumps(NESTED), "[" * 100000 + "]" * 100000)
    path.write_bytes(text.encode())


def _paths(doc: Any, at: tuple = ()) -> list[tuple]:
    """Every field of a JSON document: dict keys, every element of a short list (a chunk's
    [stored, raw, xxh3], a key, replication's [factor, jump]) and a long one's first, nested."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*at, k))
            out += _paths(v, (*at, k))
    elif isinstance(doc, list) and doc:
        for i in range(len(doc) if len(doc) <= 3 else 1):
            out.append((*at, i))
            out += _paths(doc[i], (*at, i))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _huge(v: Any) -> Any:
    """A number past every bound, or the list made a million long (objects: 100000, which
    is tens of MB already)."""
    if not isinstance(v, list) or not v:
        return HUGE
    return [v[0]] * (HUGE_LIST // 10 if isinstance(v[0], dict | list) else HUGE_LIST)


def _wrong_type(v: Any) -> Any:
    return {str: 7, bool: "yes", int: "7", float: "1.5", list: {"a": 1}, dict: [1, 2]}.get(type(v), "x")


MUTATIONS: dict[str, Callable[[Any], Any]] = {
    "wrong_type": _wrong_type,
    "zero": lambda v: (
        [] if isinstance(v, list) else {} if isinstance(v, dict) else "" if isinstance(v, str) else 0
    ),
    "negative": lambda v: -1,
    "huge": lambda v: _huge(v),
    "null": lambda v: None,
    "float": lambda v: 1.5,
    "nested": lambda v: NESTED,
}
REMOVED = object()
NESTED = "@nested@"  # written as 100000 nested lists (``_write_json``): json cannot make them


def _json_cases(record: str, file: str, doc: Any) -> dict[str, Callable[[Path], None]]:
    """A case per (field, mutation) of the JSON record ``file`` (in step 2 of tier 0), and per
    nested object one with a key added."""
    cases: dict[str, Callable[[Path], None]] = {}

    def mutate(path: tuple, fn: Callable[[Any], Any]) -> Callable[[Path], None]:
        def apply(root: Path) -> None:
            where = root / "t0" / STEP / file
            d = _read_json(where)
            parent = _get(d, path[:-1])
            value = fn(parent[path[-1]])
            if value is REMOVED:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            _write_json(where, d)

        return apply

    for ordinal, path in enumerate(_paths(doc)):
        name = ".".join(str(p) for p in path)
        for m, fn in MUTATIONS.items():
            cases[f"{record}:{name}:{m}"] = mutate(path, fn)
        if isinstance(path[-1], str):
            cases[f"{record}:{name}:missing"] = mutate(path, lambda v: REMOVED)
        if isinstance(_get(doc, path), dict):
            cases[f"{record}:{name}:extra_key"] = mutate(path, lambda v: {**v, "zzz": [1]})
        mine = [c for c in cases if c.startswith(f"{record}:{name}:") and c.count(":") == 2]
        FIELD_MUTATIONS.update(mine)
        EXPORTING.add(mine[ordinal % len(mine)])  # the exports: one mutation a field, in turn
    cases[f"{record}:extra_key"] = _add_top_key(file)
    return cases


def _mutate_json(file: str, path: tuple, value: Any) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        where = root / "t0" / STEP / file
        d = _read_json(where)
        _get(d, path[:-1])[path[-1]] = value
        _write_json(where, d)

    return apply


def _add_top_key(file: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        where = root / "t0" / STEP / file
        d = _read_json(where)
        d["zzz"] = {"a": [1, 2]}
        _write_json(where, d)

    return apply


def _resign(root: Path, blob: bytes, tier: str = "t0") -> None:
    """Write ``blob`` as step 2's metadata and make the marker's size and checksum match it
    (as whoever can write the tier could)."""
    from tiered_dcp.storage.codec import checksum

    (root / tier / STEP / "metadata").write_bytes(blob)
    marker = root / tier / STEP / "COMMITTED"
    d = _read_json(marker)
    d["metadata_size"], d["metadata_xxh3"] = len(blob), checksum(blob)
    _write_json(marker, d)


def _metadata(root: Path) -> Any:
    """Step 2's metadata as DCP's objects, without the facts ``loads`` leaves on it (which
    name a class of ours: pickled again, the unpickler would refuse it for that alone)."""
    from tiered_dcp.steps.metadata import CHECKED, loads

    md = loads((root / "t0" / STEP / "metadata").read_bytes())
    delattr(md, CHECKED)
    return md


def _md_case(change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        md = _metadata(root)
        md = change(md) or md
        _resign(root, pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))

    return apply


def _first_tensor(md: Any) -> tuple[str, Any]:
    return next((k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks") and k == "w")


def _md_drop_storage_key(md: Any) -> None:
    md.storage_data.pop(next(iter(md.storage_data)))


def _md_drop_sd_key(md: Any) -> None:
    md.state_dict_metadata.pop("b")


def _md_huge_tensor(md: Any) -> None:
    _, tmd = _first_tensor(md)
    tmd.size = torch.Size([10**6, 10**6])


def _md_huge_chunk(md: Any) -> None:
    _, tmd = _first_tensor(md)
    c = tmd.chunks[0]
    tmd.chunks[0] = type(c)(offsets=c.offsets, sizes=torch.Size([10**12]))
    tmd.size = torch.Size([10**12])


def _md_chunk_out_of_bounds(md: Any) -> None:
    _, tmd = _first_tensor(md)
    c = tmd.chunks[0]
    tmd.chunks[0] = type(c)(offsets=torch.Size([N]), sizes=c.sizes)


def _md_bad_dtype(md: Any) -> None:
    _, tmd = _first_tensor(md)
    tmd.properties.dtype = torch.float64


def _md_tensor_field(field: str, value: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        setattr(_first_tensor(md)[1], field, value)

    return change


def _md_item_fields(field: str, value: Any) -> Callable[[Any], None]:
    def change(md: Any) -> None:
        for d in md.storage_data.values():
            if d.get("kind") == "tensor":
                d[field] = value
                return

    return change


def _pickled_call(fn: str, *args: Any, module: str = "builtins") -> bytes:
    """A pickle whose top object is ``<module>.<fn>(*args)``."""
    return b"\x80\x04" + b"c" + f"{module}\n{fn}\n".encode() + pickle.dumps(args, protocol=4)[2:-1] + b"R."


def _md_blob_case(blob: Callable[[Path], bytes]) -> Callable[[Path], None]:
    return lambda root: _resign(root, blob(root))


def _special(file: str, how: str) -> Callable[[Path], None]:
    """``file`` of step 2 on tier 0 replaced by something that is no regular record file."""

    def apply(root: Path) -> None:
        where = root / "t0" / STEP / file
        where.unlink()
        if how == "sparse":
            with open(where, "wb") as f:
                f.truncate(6 << 30)
        elif how == "fifo":
            os.mkfifo(where)
        elif how == "device":
            os.symlink("/dev/zero", where)
        elif how == "directory":
            where.mkdir()
        elif how == "link_outside":
            os.symlink(root / "outside.fifo", where)
        elif how == "empty":
            where.write_bytes(b"")
        elif how == "binary":
            where.write_bytes(bytes(range(256)) * 4)

    return apply


def _step_dir_case(name: str, like: str = "step_000000000002") -> Callable[[Path], None]:
    """A committed copy of step 2 on tier 0 under another directory name."""

    def apply(root: Path) -> None:
        src = root / "t0" / NS / like
        dst = root / "t0" / NS / name
        shutil.copytree(src, dst)
        with contextlib.suppress(ValueError, OSError):
            d = _read_json(dst / "COMMITTED")
            d["step"] = int(name.removeprefix("step_")) if name.removeprefix("step_").isdigit() else 3
            _write_json(dst / "COMMITTED", d)

    return apply


def _linked_step_dir(root: Path) -> None:
    """Step 2's directory on tier 0 a link to a copy of it outside the tiers."""
    outside = root / "outside-step"
    shutil.move(str(root / "t0" / STEP), outside)
    os.symlink(outside, root / "t0" / STEP)


def _side_record(name: str, content: bytes | None, how: str | None = None) -> Callable[[Path], None]:
    """A pin, lease, failure note or quarantine mark of step 2 on tier 0, as given."""

    def apply(root: Path) -> None:
        where = root / "t0" / (NS if name.startswith("step_") else STEP) / name
        if content is not None:
            where.write_bytes(content)
        elif how == "sparse":
            with open(where, "wb") as f:
                f.truncate(6 << 30)
        elif how == "fifo":
            os.mkfifo(where)

    return apply


def _blocks_case(how: str) -> Callable[[Path], None]:
    """Tier 1's blocks list of step 2 (the dedup tier's), damaged: tier 0 holds the step too."""

    def apply(root: Path) -> None:
        where = root / "t1" / STEP / "rank_00000.blocks"
        if how == "garbage":
            where.write_bytes(b"\xff" * 100)
        elif how == "nested":
            where.write_bytes(b"[" * 100000 + b"]" * 100000)
        elif how == "huge_list":
            where.write_bytes(json.dumps(["0" * 32] * HUGE_LIST).encode())
        elif how == "sparse":
            where.unlink()
            with open(where, "wb") as f:
                f.truncate(6 << 30)
        elif how == "wrong_type":
            where.write_bytes(b'{"a": 1}')

    return apply


def cases(clean: Path) -> dict[str, Callable[[Path], None]]:
    marker = _read_json(clean / "t0" / STEP / "COMMITTED")
    index = _read_json(clean / "t0" / STEP / "rank_00000.index")
    out: dict[str, Callable[[Path], None]] = {"intact": lambda root: None}
    out.update(_json_cases("marker", "COMMITTED", marker))
    for extra, value in {
        "cliques": [[0]],
        "domains": ["a"],
        "nonfinite_items": 0,
        "nonfinite": [],
    }.items():  # the optional fields, present and then altered
        for m, fn in MUTATIONS.items():

            def apply(root: Path, extra: str = extra, value: Any = value, fn: Callable = fn) -> None:
                where = root / "t0" / STEP / "COMMITTED"
                d = _read_json(where)
                d[extra] = fn(value if value != [] and value != 0 else [0] if isinstance(value, list) else 1)
                _write_json(where, d)

            out[f"marker:{extra}:{m}"] = apply
    out.update(_json_cases("index", "rank_00000.index", index))
    for name, field, value in (
        ("dtype_bogus", "dtype", "torch.bogus"),
        ("dtype_other", "dtype", "torch.float64"),
        ("shape_other", "shape", [64, 64]),
        ("kind_bytes", "kind", "bytes"),
        ("offset_past_part", "offset", 1 << 40),
        ("file_other_part", "file", "run/step_000000000001/rank_00000.part"),
    ):  # the first item's record saying other, well-formed, things of it than the metadata
        out[f"index:items.0:{name}"] = _mutate_json("rank_00000.index", ("items", 0, field), value)
    md = {
        "storage_key_missing": _md_case(_md_drop_storage_key),
        "state_dict_key_missing": _md_case(_md_drop_sd_key),
        "tensor_10e6_x_10e6": _md_case(_md_huge_tensor),
        "chunk_10e12": _md_case(_md_huge_chunk),
        "chunk_out_of_bounds": _md_case(_md_chunk_out_of_bounds),
        "dtype_changed": _md_case(_md_bad_dtype),
        "tensor_properties_int": _md_case(_md_tensor_field("properties", 5)),
        "tensor_chunks_int": _md_case(_md_tensor_field("chunks", 5)),
        "item_shape_huge": _md_case(_md_item_fields("shape", [10**12])),
        "item_dtype_bogus": _md_case(_md_item_fields("dtype", "torch.bogus")),
        "item_chunks_huge": _md_case(_md_item_fields("chunks", [[10**12, 1]])),
        "item_rank_huge": _md_case(_md_item_fields("rank", 10**20)),
        "item_kind_bogus": _md_case(_md_item_fields("kind", "code")),
        "bytes_call": _md_blob_case(lambda root: _pickled_call("bytes", 8 << 30)),
        "bytearray_call": _md_blob_case(lambda root: _pickled_call("bytearray", 8 << 30)),
        "list_call": _md_blob_case(lambda root: _pickled_call("list", "x" * 100)),
        "str_call": _md_blob_case(lambda root: _pickled_call("str", 10**20)),
        "not_metadata": _md_blob_case(lambda root: pickle.dumps({"a": 1})),
        # admitted constructors called with what they reject by an error of their own
        "layout_unknown": _md_blob_case(
            lambda root: _pickled_call("_get_layout", "torch.bogus", module="torch.serialization")
        ),
        "int_of_infinity": _md_blob_case(lambda root: _pickled_call("int", float("inf"))),
        "str_unknown_codec": _md_blob_case(lambda root: _pickled_call("str", b"x", "no-such-codec")),
        "nested": _md_blob_case(lambda root: b"\x80\x04" + b"]" * 200000 + b"."),
        "garbage": _md_blob_case(lambda root: b"\x80\x04garbage"),
    }
    out.update({f"metadata:{k}": v for k, v in md.items()})
    for file in ("COMMITTED", "metadata", "rank_00000.index", "rank_00000.part"):
        for how in ("sparse", "fifo", "device", "directory", "link_outside", "empty", "binary"):
            out[f"file:{file}:{how}"] = _special(file, how)
    out.update(
        {
            "step_dir:non_ascii_digit": _step_dir_case("step_00000000000\u0663"),
            "step_dir:superscript": _step_dir_case("step_00000000000\u00b3"),
            "step_dir:10e20": _step_dir_case("step_100000000000000000000"),
            "step_dir:short": _step_dir_case("step_3"),
            "step_dir:sign": _step_dir_case("step_+00000000003"),
            "step_dir:linked_outside": _linked_step_dir,
            "pin:garbage": _side_record("pin.rank_00000.t01", b"\xff\xfe garbage"),
            "pin:json_wrong": _side_record("pin.rank_00000.t01", b'{"pid": "x", "host": 5}'),
            "pin:nested": _side_record("pin.rank_00000.t01", b"[" * 100000 + b"]" * 100000),
            "pin:sparse": _side_record("pin.rank_00000.t01", None, "sparse"),
            "pin:fifo": _side_record("pin.rank_00000.t01", None, "fifo"),
            "failed:sparse": _side_record("failed.rank_00000", None, "sparse"),
            "failed:fifo": _side_record("failed.rank_00000", None, "fifo"),
            "lease:garbage": _side_record("lease.x-1-abc", b"\xff" * 10),
            "lease:sparse": _side_record("lease.x-1-abc", None, "sparse"),
            "quarantine:sparse": _side_record(
                "step_000000000001.quarantined.0000000000000000.rank_00000", None, "sparse"
            ),
        }
    )
    for how in ("garbage", "nested", "huge_list", "sparse", "wrong_type"):
        out[f"blocks:{how}"] = _blocks_case(how)
    return out


# -- running a case ------------------------------------------------------------------------


class EntryTimeout(BaseException):
    """An entry point ran past ``ENTRY_SECONDS`` (a BaseException: nothing of ours catches it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise EntryTimeout


def _cpu() -> float:
    """CPU seconds of this process and of the children it waited for (the CLI's): what an entry
    point costs, however many other processes share the machine's cores meanwhile."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_case(clean: Path, work: Path, name: str, apply: Callable[[Path], None]) -> dict:
    """In a forked child: the case's outcome per entry point (see the module docstring)."""
    root = work / name.replace(":", "_").replace("/", "_").replace(".", "_")
    shutil.copytree(clean, root, symlinks=True)
    os.mkfifo(root / "outside.fifo")
    apply(root)
    outside_before = _outside(root)
    config = config_of(root)
    signal.signal(signal.SIGALRM, _on_alarm)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on (the case's own set-up aside)
    start_rss = _kib("VmRSS")
    out: dict[str, Any] = {"case": name, "entries": {}}
    light = name in FIELD_MUTATIONS and name not in EXPORTING
    for entry, fn in ENTRY_POINTS.items():
        if light and entry in EXPORTS:
            continue
        t0, cpu0 = time.perf_counter(), _cpu()
        signal.setitimer(signal.ITIMER_REAL, ENTRY_SECONDS)
        try:
            result = {"ok": True, "got": fn(config, root)}
        except EntryTimeout:
            result = {"ok": False, "error": "TIMEOUT", "foreign": True}
        except BaseException as e:  # noqa: BLE001 - judged by the test
            ours = _ours(e)
            result = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[:800],
                "foreign": not ours,
                "trace": "" if ours else traceback.format_exc()[-2500:],
            }
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        result["seconds"] = round(time.perf_counter() - t0, 3)
        result["cpu_seconds"] = round(_cpu() - cpu0, 3)
        out["entries"][entry] = result
    out["peak_mib"] = round((_kib("VmHWM") - start_rss) / 1024, 1)
    out["outside_changed"] = _outside(root) != outside_before
    return out


def _outside(root: Path) -> list[str]:
    """Every path under the case's root outside the tiers (and the exports' destinations)."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        if dirpath == str(root):
            dirs[:] = [d for d in dirs if d not in ("t0", "t1", "export-api", "export-cli")]
        out += [os.path.join(dirpath, f) for f in files + dirs]
    return sorted(out)


def _ours(e: BaseException) -> bool:
    """A TieredCheckpointError, or DCP's CheckpointException holding only such errors."""
    if isinstance(e, TieredCheckpointError):
        return True
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return all(isinstance(f, TieredCheckpointError) for f in failures.values())
    return False


def serve(base: Path, clean: Path) -> None:
    """Build the checkpoint in ``clean`` unless it is there, then run cases (the docstring)."""
    torch.set_num_threads(1)  # no OpenMP pool: the children are forked
    if not clean.exists():
        build(clean)
    all_cases = cases(clean)
    warm = base / "warm"
    warm.mkdir()
    for entry in ENTRY_POINTS.values():  # every import done before the first fork
        root = warm / "root"
        shutil.copytree(clean, root, symlinks=True)
        with contextlib.suppress(Exception):
            entry(config_of(root), root)
        shutil.rmtree(root)
    print(json.dumps({"cases": list(all_cases)}), flush=True)
    work = base / "cases"
    work.mkdir()
    for line in sys.stdin:
        name = line.strip()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                soft = int(_kib("VmSize") * 1024 + (4 << 30))
                resource.setrlimit(resource.RLIMIT_AS, (soft, soft))
                outcome = run_case(clean, work, name, all_cases[name])
            except BaseException as e:  # noqa: BLE001
                outcome = {"case": name, "crash": traceback.format_exc()[-3000:], "error": repr(e)}
            with os.fdopen(w, "w") as f:
                f.write(json.dumps(outcome))
            os._exit(0)
        os.close(w)
        text = _collect(r, pid, len(ENTRY_POINTS) * ENTRY_SECONDS + 20)
        for leftover in os.listdir(work):
            shutil.rmtree(work / leftover, ignore_errors=True)
        print(text or json.dumps({"case": name, "crash": "the child printed nothing"}), flush=True)


def _collect(fd: int, pid: int, limit: float) -> str:
    """What the child writes to ``fd``; it is killed past ``limit`` seconds (a hang that no
    timer interrupts: one inside a C call)."""
    deadline = time.monotonic() + limit
    data = b""
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            data = b""
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    os.waitpid(pid, 0)
    return data.decode() if data else ""


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
