"""The ``tiered-dcp`` command: ls, status, verify, export, import, rm, prune, goodput, drill, demo.

``ls``, ``status`` and ``verify`` import no torch, so they answer at once; the others
import it when they run. A tier path, namespace or flag that is not there is named with what is
(``hints``), the same way by every command.
Every command exits 0 when all is well, 1 when it found damage or nothing to show, and 2
on a usage or configuration error (``EXIT_CODES``); an expected failure is one line on
stderr (the cause, and what to do), never a traceback. Output whose reader has gone
(``tiered-dcp ls ... | head -1``) ends the command quietly with 141, the status of a command
killed by SIGPIPE, as ``cat`` or ``ls`` give there (so ``set -o pipefail`` sees it alike).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import shutil
import sys
import time
from collections.abc import Callable
from itertools import zip_longest
from typing import Any, NoReturn

from .. import __version__
from ..api import Removal, host_memory, import_dcp, namespaces, prune, remove_steps, status, writer_status
from ..config import Tier, TieredConfig, here, names_no_node
from ..errors import TieredCheckpointError
from ..steps.catalog import views
from ..steps.choice import newest_committed
from ..steps.status import StepStatus
from . import hints

EXIT_CODES = """exit codes (every command):
  0  all is well
  1  damage found, or nothing to show (no such namespace, no committed step)
  2  usage or configuration error
  141  the output's reader went away (e.g. piped into head), as for a command killed by SIGPIPE"""
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what the shell reports for `cat`/`ls` in `... | head -1`


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(text: str) -> int:
    """Bytes from ``5GB`` (decimal, as Hugging Face writes sizes), ``2GiB`` or ``1000``."""
    num = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(num) :]
    try:
        n = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is no size: e.g. 5GB, 500MB, 2GiB or 1000") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be > 0")
    return n


def age(created: float | None) -> str:
    if created is None:
        return ""
    s = max(0.0, time.time() - created)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h" if s < 172800 else f"{s / 86400:.0f}d"


def key_values(pairs: list[str] | None, flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` arguments as a dict (fsspec storage options). A VALUE that starts as a
    JSON object or array is one (s3fs's ``config_kwargs``, ``client_kwargs``); any other
    VALUE is a string."""
    out: dict[str, Any] = {}
    for kv in pairs or []:
        key, sep, value = kv.partition("=")
        if not sep:
            raise ValueError(f"{flag} wants KEY=VALUE, got {kv!r}")
        if value.lstrip().startswith(("{", "[")):
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {key}: {value!r} is no JSON object or array ({e})") from None
        else:
            out[key] = value
    return out


def _config(args: argparse.Namespace) -> TieredConfig:
    if getattr(args, "config", None):
        if args.tiers or args.namespace:
            raise ValueError("give either --config or -n NAMESPACE and the tiers, not both")
        from .jobconfig import load_job_config

        return load_job_config(args.config)
    if not args.namespace or not args.tiers:
        raise ValueError(
            "say which job: --config tiers.toml (or python:module:attr), or -n NAMESPACE TIER... "
            "(`tiered-dcp ls TIER...` lists the namespaces there)"
        )
    return TieredConfig(args.namespace, _tiers(args))


def _tiers(args: argparse.Namespace) -> list[Tier]:
    options = key_values(args.option, "--option")
    return [
        Tier(t, storage_options=options if "://" in t and not t.startswith("file://") else {})
        for t in args.tiers
    ]


class Told(Exception):
    """What went wrong is already on stderr: the command ends with ``code``."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _job(args: argparse.Namespace, *, must_exist: bool = True, namespace: bool = True) -> TieredConfig:
    """The job a command is about, with its tier paths checked (``hints``: one line per path
    that is not a tier root) and, unless the command makes it (``namespace``), its namespace
    found on them. ``must_exist``: a tier's directory must be there already."""
    cfg = _config(args)
    if len(_check_paths(args.cmd, cfg.tiers, must_exist)) == len(cfg.tiers):
        raise Told(1)  # no tier is there: nothing to show, and the lines said why
    missing = hints.missing_namespace(cfg.namespace, cfg.tiers) if namespace else None
    if missing is not None:
        print(f"tiered-dcp {args.cmd}: {missing}", file=sys.stderr)
        raise Told(1)
    return cfg


def _check_paths(cmd: str, tiers: list[Tier], must_exist: bool = True) -> list[hints.PathProblem]:
    """Each tier path that is not a tier root, one line on stderr; exit 2 when one cannot
    be (node directories, a namespace's directory), else the command goes on without it."""
    problems = hints.tier_path_problems(tiers, must_exist)
    for p in problems:
        print(f"tiered-dcp {cmd}: {p.line}", file=sys.stderr)
    if any(p.fatal for p in problems):
        raise Told(2)
    return problems


def cmd_ls(args: argparse.Namespace) -> int:
    if not args.config and not args.namespace and args.tiers:
        return _ls_namespaces(args)
    cfg = _job(args)
    rows = status(cfg)
    if args.json:
        return _ls_json(cfg, rows)
    if not rows:
        print(f"no steps of namespace {cfg.namespace!r} on any tier", file=sys.stderr)
        return 1
    _print_table(cfg, rows, args.wide)
    _print_cliques(cfg, rows)
    _print_row_errors(rows, (StepStatus.DAMAGED, StepStatus.INCOMPLETE))
    _print_writers(cfg)
    _print_memory(cfg)
    _print_scores(cfg)
    return 0


def _print_row_errors(rows: list, states: tuple[StepStatus, ...]) -> None:
    """What a state that is not a good step means, and what to do."""
    for r in rows:
        if r.error and r.state in states:
            print(f"  step {r.step} on tier {r.tier_index}: {r.state}: {r.error}")
        elif r.passed_over:
            print(f"  step {r.step} on tier {r.tier_index}: passed over by loads: {r.passed_over}")


def _print_writers(cfg: TieredConfig) -> None:
    """This node's writer processes of the job: running or not, their queues, what failed."""
    writers = writer_status(cfg)
    if writers:
        print("writer processes on this node:")
    for w in writers:
        state = f"running (pid {w.pid})" if w.running else "not running"
        queue = ", ".join(f"step {s} -> tier {t}" for s, t in w.queue) or "nothing"
        print(f"  rank {w.rank}: {state}; queued: {queue}")
        for t, h in sorted(w.unhealthy.items()):
            since = time.strftime("%H:%M:%S", time.localtime(h.get("since") or 0))
            print(f"    tier {t} {h['state'].upper()} since {since}: {h.get('error')} (saves skip waiting)")
        for s, t, why in w.failed:
            print(f"    FAILED step {s} -> tier {t}: {why}")
        for s, t, why in w.skipped:
            print(f"    SKIPPED step {s} -> tier {t}: {why}")


def cmd_status(args: argparse.Namespace) -> int:
    """``status(config)`` as a table: each step on each tier (queued, writing, clean,
    committed, ...), newest first, then the writer processes' queues."""
    cfg = _job(args)
    rows = status(cfg)
    if args.json:
        doc = {
            "namespace": cfg.namespace,
            "tiers": [t.path for t in cfg.tiers],
            "steps": [dataclasses.asdict(r) for r in rows],
            "writers": [dataclasses.asdict(w) for w in writer_status(cfg)],
        }
        print(json.dumps(doc, indent=1))
        return 0 if rows else 1
    if not rows:
        print(f"no steps of namespace {cfg.namespace!r} on any tier", file=sys.stderr)
    else:
        ordered = sorted(rows, key=lambda r: (-r.step, r.tier_index))
        table = [
            [str(r.step), f"{r.tier_index} ({r.tier})", str(r.state), human(r.size_bytes), age(r.created)]
            for r in ordered
        ]
        print("\n".join(_columns(["step", "tier", "state", "size", "age"], table)))
        _print_row_errors(ordered, tuple(s for s in StepStatus if s is not StepStatus.COMMITTED))
    _print_writers(cfg)
    return 0 if rows else 1


def _print_table(cfg: TieredConfig, rows: list, wide: bool) -> None:
    """Steps x tiers. Fitted to the terminal (its width, or ``COLUMNS``; output to a pipe
    or a file is not fitted) unless ``wide``: first without the byte details, then with the
    tiers' paths on lines of their own above the table."""
    details = {}
    for r in rows:  # logical -> stored (compression) -> written (dedup), where known
        if r.logical_bytes:
            details[(r.step, r.tier_index)] = (
                f" [{human(r.logical_bytes)} logical, x{r.compression_ratio:.2f} stored,"
                f" x{r.dedup_ratio:.2f} written]"
            )
    cells = {
        (r.step, r.tier_index): f"{r.state} {human(r.size_bytes)} {age(r.created)}".strip() for r in rows
    }
    steps = sorted({r.step for r in rows}, reverse=True)
    wide = wide or not sys.stdout.isatty()
    width = shutil.get_terminal_size().columns
    named = [f"tier {i}: {t.path}" for i, t in enumerate(cfg.tiers)]
    short = [f"tier {i}" for i in range(len(cfg.tiers))]
    layouts = [(named, True), (named, False), (short, False)]
    for n, (header, with_details) in enumerate(layouts):
        table = [
            [str(step)]
            + [
                cells.get((step, i), "-") + (details.get((step, i), "") if with_details else "")
                for i in range(len(cfg.tiers))
            ]
            for step in steps
        ]
        lines = _columns(["step", *header], table)
        if wide or n == len(layouts) - 1 or max(len(x) for x in lines) <= width:
            break
    if header is short:
        for line in named:
            print(line)
    for line in lines:
        print(line)


def _print_cliques(cfg: TieredConfig, rows: list) -> None:
    """Who holds copies of whose part on the replicated node-local tiers, with each clique's
    failure domains: one line per layout (a job keeps one), naming its steps; under a tier
    whose path names no node (``config.names_no_node``), that the copies may not exist."""
    layouts: dict[tuple, list[str]] = {}
    for r in rows:
        if r.cliques:
            key = (r.tier_index, tuple(map(tuple, r.cliques)), tuple(map(tuple, r.clique_domains)))
            layouts.setdefault(key, []).append(str(r.step))
    told = set()
    for (tier, cliques, domains), steps in sorted(layouts.items()):
        shown = [
            f"{list(c)} in {', '.join(d)}" if domains else str(list(c))
            for c, d in zip_longest(cliques, domains)
        ]
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(steps)}"
        print(f"cliques on tier {tier} ({which}): {'; '.join(shown)}")
        if tier not in told and tier < len(cfg.tiers) and names_no_node(cfg.tiers[tier]):
            told.add(tier)
            print(
                f"  but tier {tier}'s path names no {{node}}: if the nodes share that directory, "
                f"each part is held there once, not {len(cliques[0])} times"
            )


def _columns(header: list[str], table: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *table, strict=True)]
    return [
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [header, *table]
    ]


def _ls_namespaces(args: argparse.Namespace) -> int:
    """``ls TIER...`` without a namespace: the namespaces those tiers hold."""
    tiers = _tiers(args)
    if len(_check_paths(args.cmd, tiers)) == len(tiers):
        return 1
    found = namespaces(tiers)
    if args.json:
        print(json.dumps([dataclasses.asdict(n) for n in found], indent=1))
    elif found:
        lines = _columns(
            ["namespace", "tier", "steps", "newest", "size"],
            [
                [
                    n.namespace,
                    n.tier,
                    str(n.steps),
                    str(n.newest) if n.newest is not None else "-",
                    human(n.size_bytes),
                ]
                for n in found
            ],
        )
        print("\n".join(lines))
        print("look at one: tiered-dcp ls -n NAMESPACE TIER...")
    else:
        print(f"no namespace on {', '.join(args.tiers)} (no directory there holds steps)", file=sys.stderr)
    return 0 if found else 1


def _print_memory(cfg: TieredConfig) -> None:
    mem = host_memory(cfg)
    if not mem.total:
        return
    print(f"host memory held on this node: {human(mem.total)}")
    for t in mem.tiers:
        print(f"  tier {t.index} ({t.path}): {human(t.steps)} in steps, {human(t.spares)} in spare files")
    for rank, n in mem.staging.items():
        print(f"  rank {rank}'s staging buffers: {human(n)}")


def _print_scores(cfg: TieredConfig) -> None:
    from ..metrics.scores import FLOOR_SECONDS, THRESHOLD, job_scores, job_suspects

    for s in job_suspects(cfg):
        print(
            f"SUSPECT rank {s.rank} (node {s.node}): its copies of replicated items disagreed with "
            f"its replicas at steps {', '.join(map(str, s.steps))} ({', '.join(s.items[:4])}): "
            f"check node {s.node}"
        )
    scores = job_scores(cfg)
    if not scores:
        return
    print(
        "save-time scores (medians over each rank's newest saves: write speed vs its peers' median, "
        "seconds behind them, speed vs its own usual):"
    )
    for s in scores:
        flag = f"  SLOW: below {THRESHOLD} and {FLOOR_SECONDS} s or more behind" if s.slow else ""
        print(
            f"  rank {s.rank} (node {s.node}) tier {s.tier}: {s.relative:.2f}, {s.excess_s:+.3f} s, "
            f"{s.individual:.2f} over {s.window} of {s.saves} saves to step {s.step}{flag}"
        )


def _ls_json(cfg: TieredConfig, rows: list) -> int:
    from ..metrics.scores import job_scores, job_suspects

    out = {
        "namespace": cfg.namespace,
        "tiers": [t.path for t in cfg.tiers],
        "steps": [dataclasses.asdict(r) for r in rows],
        "writers": [dataclasses.asdict(w) for w in writer_status(cfg)],
        "host_memory": dataclasses.asdict(host_memory(cfg)),
        "scores": [dataclasses.asdict(s) for s in job_scores(cfg)],
        "suspects": [dataclasses.asdict(s) for s in job_suspects(cfg)],
    }
    print(json.dumps(out, indent=1))
    return 0


def _pick_step(cfg: TieredConfig, step: int | None) -> int | None:
    if step is not None:
        return step
    return newest_committed(views(cfg, *here()))


def cmd_verify(args: argparse.Namespace) -> int:
    from ..ops.verify import verify_step

    cfg = _job(args)
    step = _pick_step(cfg, args.step)
    if step is None:
        print(f"no committed step of namespace {cfg.namespace!r} on any tier", file=sys.stderr)
        return 1
    checks = verify_step(cfg, step, *here())
    if not checks:
        print(f"step {step} is not committed on any tier", file=sys.stderr)
        return 1
    if args.json:
        doc = [
            {**dataclasses.asdict(c), "ok": c.ok, "problems": c.problems, "bytes_read": c.bytes_read}
            for c in checks
        ]
        print(json.dumps({"step": step, "ok": all(c.ok for c in checks), "tiers": doc}, indent=1))
        return 0 if all(c.ok for c in checks) else 1
    bad = 0
    for c in checks:
        verdict = "OK" if c.ok else f"DAMAGED ({len(c.problems)} problem(s))"
        print(
            f"step {step} tier {c.tier_index} {c.tier}: "
            f"{c.items} items, {human(c.bytes_read)} read: {verdict}"
        )
        for p in c.tier_problems:
            print(f"    {p}")
        if c.passed_over:
            print(f"  its bytes are as saved, but loads pass it over: {c.passed_over}")
        if len(c.roots) < 2 and c.ok:
            continue  # one root, all good: the tier's line says it all
        for r in c.roots:
            if not r.present:
                print(f"  root {r.url}: holds nothing of step {step} (wiped, or not reachable from here)")
                continue
            if r.incomplete:
                print(f"  root {r.url}: {r.incomplete}")
                continue
            replicas = f", replicas of rank(s) {r.replicas}" if r.replicas else ""
            held = sorted(set(r.parts) - set(r.replicas))
            print(
                f"  root {r.url}: part(s) of rank(s) {held}{replicas}; {r.items} items, "
                f"{human(r.bytes_read)}, {'good' if r.ok else 'damaged'}"
            )
            for p in r.problems:
                print(f"    {p}")
        bad += not c.ok
    damaged = [f"tier {c.tier_index}" for c in checks if not c.ok]
    if damaged:
        print(
            f"step {step}: DAMAGED on {', '.join(damaged)} of {len(checks)} tier(s) holding it. A load "
            "reads another copy of what is damaged, else passes over to an older step "
            "(load_latest, export); the next save writes a fresh step. Nothing to repair by hand."
        )
    else:
        marked = " (marked: loads pass it over)" if any(c.passed_over for c in checks) else ""
        print(f"step {step}: good on all {len(checks)} tier(s) holding it{marked}")
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..ops.export import format_named, run_export

    cfg = _job(args)
    t0 = time.perf_counter()

    def progress(name: str, size: int, done: int, total: int) -> None:
        if total > 1:
            print(f"  wrote {name} ({human(size)}), {done} of {total}", flush=True)

    fmt = format_named(args.format, args.max_shard_size)
    done = run_export(cfg, args.step, args.to, fmt, args.only, progress)
    took = time.perf_counter() - t0
    w = done.written
    what = f"{w.tensors} tensor(s), {human(w.bytes)}"
    if done.format == "dcp":
        how = f"a stock DCP checkpoint: FileSystemReader({done.dest!r})"
    else:
        more = ", ..." if len(w.files) > 3 else ""
        how = f"{len(w.files)} file(s): {', '.join(w.files[:3])}{more}"
    print(f"exported step {done.step} to {done.dest} ({how}), {what}, in {took:.1f}s")
    if w.left_out:
        names = ", ".join(w.left_out[:5]) + (", ..." if len(w.left_out) > 5 else "")
        print(f"left out {len(w.left_out)} non-tensor item(s), which {done.format} cannot hold: {names}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    cfg = _job(args, must_exist=False, namespace=False)
    t0 = time.perf_counter()
    import_dcp(cfg, args.source, args.step, storage_options=key_values(args.from_option, "--from-option"))
    print(
        f"imported {args.source} as step {args.step} of {cfg.namespace!r} in {time.perf_counter() - t0:.1f}s "
        f"(committed on tier {cfg.tiers_for(args.step)[0]}; the writer process fills the slower tiers)"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    cfg = _job(args)
    tiers = None if args.tier is None else [args.tier]
    return _report_removals(remove_steps(cfg, args.step, tiers=tiers, force=args.force), cfg, args.step)


def cmd_prune(args: argparse.Namespace) -> int:
    cfg = _job(args)
    tiers = None if args.tier is None else [args.tier]
    return _report_removals(prune(cfg, args.keep, tiers=tiers), cfg, None)


def _report_removals(done: list[Removal], cfg: TieredConfig, asked: list[int] | None) -> int:
    """One line per step and tier; exit 1 when a step asked for is nowhere, or one stays."""
    for r in done:
        if r.removed:
            print(f"removed step {r.step} from tier {r.tier_index} ({r.tier})")
        else:
            print(f"kept step {r.step} on tier {r.tier_index} ({r.tier}): {r.why}")
    missing = sorted(set(asked or []) - {r.step for r in done})
    if missing:
        print(f"step(s) {missing} of namespace {cfg.namespace!r} are on no tier reached", file=sys.stderr)
    if asked is None and not done:
        print("nothing to prune: no tier holds more committed steps than that")
    return 1 if missing or any(not r.removed for r in done) else 0


def cmd_goodput(args: argparse.Namespace) -> int:
    """Without a job, the flags alone; with ``--from-job``, its tiers must be there."""
    from ..metrics import goodput

    given = args.config or args.tiers
    cfg = _job(args, must_exist=args.from_job, namespace=False) if given else None
    measured = goodput.measure_job(cfg) if args.from_job and cfg is not None else None
    if measured is not None and not measured.saves and not measured.loads:
        print(f"tiered-dcp goodput: {hints.no_records(cfg)}", file=sys.stderr)  # type: ignore[arg-type]
        return 1
    return goodput.command(args, cfg, measured)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dir, steps=args.steps, kill_at=args.kill_at)


def _tier_args(p: argparse.ArgumentParser, json_output: bool = False) -> None:
    p.add_argument(
        "-c",
        "--config",
        metavar="SOURCE",
        help="the job's TieredConfig: a TOML file (its fields, one [[tiers]] table per tier) or "
        "python:module:attr (instead of -n and the tiers)",
    )
    if json_output:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-n", "--namespace", help="the job's namespace (TieredConfig.namespace)")
    p.add_argument(
        "tiers",
        nargs="*",
        metavar="TIER",
        help="tier paths or URLs, fastest first ({node}/{rank} are filled from the environment)",
    )
    p.add_argument(
        "-o",
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="storage option for URL tiers (repeatable; a VALUE starting with { or [ is JSON)",
    )


def _parser() -> argparse.ArgumentParser:
    """The command line: every command, with its arguments and the function that runs it."""
    parser = Parser(
        prog="tiered-dcp",
        description="Inspect, check and export tiered-dcp checkpoints; run the demo and the failure drill.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tiered-dcp {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _inspect_commands(sub)
    _transfer_commands(sub)
    _removal_commands(sub)
    _tool_commands(sub)
    return parser


def _reading_command(
    sub: argparse._SubParsersAction, name: str, help: str, fn: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """A command that reads the tiers: their arguments, ``--json`` and the exit codes."""
    p = sub.add_parser(
        name, help=help, epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _tier_args(p, json_output=True)
    p.set_defaults(fn=fn)
    return p


def _inspect_commands(sub: argparse._SubParsersAction) -> None:
    """ls, status and verify: read the tiers, change nothing."""
    p = _reading_command(
        sub,
        "ls",
        "steps x tiers: state, size, age; writers; host memory; save-time scores "
        "(without -n: the namespaces the tiers hold)",
        cmd_ls,
    )
    p.add_argument("--wide", action="store_true", help="every detail, however wide the terminal")
    _reading_command(
        sub,
        "status",
        "status(config): each step on each tier (queued, writing, clean, committed, failed, ...) "
        "and the writer processes' queues",
        cmd_status,
    )
    p = _reading_command(sub, "verify", "re-check every checksum of a step; exit 1 on damage", cmd_verify)
    p.add_argument("--step", type=int, help="the step (default: the newest committed)")


def _transfer_commands(sub: argparse._SubParsersAction) -> None:
    """export and import: a step out to a stock format, or a stock checkpoint in as a step."""
    p = sub.add_parser(
        "export", help="write a step as a stock DCP checkpoint directory, or as Hugging Face safetensors"
    )
    _tier_args(p)
    p.add_argument("--step", type=int, help="the step (default: the newest that loads)")
    p.add_argument("--to", required=True, help="destination directory (local; must hold no export yet)")
    p.add_argument(
        "--format",
        choices=("dcp", "safetensors"),
        default="dcp",
        help="dcp (default): a stock DCP directory; safetensors: whole tensors, as Hugging Face loads them",
    )
    p.add_argument("--only", help="just the items under this name, named without it (e.g. model)")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        help="safetensors: the largest file, e.g. 5GB (the default), 500MB, 2GiB",
    )
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("import", help="store a stock DCP checkpoint directory as a step of the tiers")
    _tier_args(p)
    p.add_argument("--from", dest="source", required=True, help="the stock DCP directory (a path or URL)")
    p.add_argument("--step", type=int, required=True, help="the step number it becomes")
    p.add_argument(
        "--from-option",
        action="append",
        metavar="KEY=VALUE",
        help="storage option for a --from URL (repeatable; a VALUE starting with { or [ is JSON)",
    )
    p.set_defaults(fn=cmd_import)


def _removal_commands(sub: argparse._SubParsersAction) -> None:
    """rm and prune: steps out of the tiers."""
    p = sub.add_parser(
        "rm", help="remove a step from the tiers (never the newest committed one without --force)"
    )
    _tier_args(p)
    p.add_argument("--step", type=int, action="append", required=True, help="the step (repeatable)")
    p.add_argument("--tier", type=int, help="only this tier (its index)")
    p.add_argument("--force", action="store_true", help="also the newest committed step")
    p.set_defaults(fn=cmd_rm)
    p = sub.add_parser("prune", help="keep the newest K committed steps of each tier, remove the older")
    _tier_args(p)
    p.add_argument("--keep", type=int, required=True, help="committed steps to keep per tier (>= 1)")
    p.add_argument("--tier", type=int, help="only this tier (its index)")
    p.set_defaults(fn=cmd_prune)


def _tool_commands(sub: argparse._SubParsersAction) -> None:
    """goodput, drill and demo: the tools that ship with the package."""
    from ..metrics import goodput  # torch-free; the commands import what they need when run
    from . import drill

    p = sub.add_parser("goodput", help="best save interval per tier, and the goodput it buys (Young/Daly)")
    _tier_args(p, json_output=True)
    goodput.add_arguments(p)
    p.set_defaults(fn=cmd_goodput)
    p = sub.add_parser(
        "drill", help="train under random real faults for N minutes; report losses, silent escapes, recovery"
    )
    drill.add_arguments(p)
    p.set_defaults(fn=drill.command)
    p = sub.add_parser("demo", help="kill a rank and resume; lose a node and resume from peer replicas")
    p.add_argument("--dir", help="where the tiers go (default: a temporary directory, RAM tier in /dev/shm)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--kill-at", type=int, default=17, help="step during whose save rank 1 is killed")
    p.set_defaults(fn=cmd_demo)


class Parser(argparse.ArgumentParser):
    """argparse's parser (every command's: subparsers are of their parent's class), whose
    errors end with the flag meant where the command line holds one no parser knows:
    ``unrecognized arguments: --stpe 3 (did you mean --step?)``, and as well where argparse
    stops first at another error (``export --formt x``: ``--to`` is required)."""

    unknown: list[str] = []  # the command line's flags that no parser knows (``_parse``)

    def error(self, message: str) -> NoReturn:
        super().error(message + hints.flag_hint(Parser.unknown, self._option_string_actions))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line parsed; an argument no parser knows is reported with the usage of
    the command it follows (``tiered-dcp ls --bogus``: ``ls``'s), not the top level's."""
    parser = _parser()
    given = sys.argv[1:] if argv is None else list(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = {f for p in (parser, *sub.choices.values()) for f in p._option_string_actions}
    flags = [a.split("=", 1)[0] for a in given if a.startswith("--")]
    Parser.unknown = [f for f in flags if not any(k.startswith(f) for k in known)]  # abbreviations pass
    args, extra = parser.parse_known_args(argv)
    if extra:
        before = given[: given.index(args.cmd)] if args.cmd in given else given
        owner = parser if any(x in before for x in extra) else sub.choices[args.cmd]
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (its poll reports an error), so that a
    BrokenPipeError from anything else (a socket to a tier) is not taken for it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no real stdout: as Python's docs do
        return True


def _run(argv: list[str] | None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except Told as e:
        return e.code
    except TieredCheckpointError as e:  # damage, or nothing to read
        print(f"tiered-dcp {args.cmd}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # how it was called, or the configuration
        print(f"tiered-dcp {args.cmd}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:  # --help's exit too
            sys.stdout.flush()  # a reader that has gone shows here, not as a traceback at exit
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # what is still buffered goes nowhere: Python's flush at exit must not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_STDOUT_CLOSED


if __name__ == "__main__":
    sys.exit(main())
