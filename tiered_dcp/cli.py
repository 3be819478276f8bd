"""The ``tiered-dcp`` command: ls, verify, export, goodput, drill, demo.

``ls`` imports no torch, so it answers at once; the others import it when they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time

from .api import export, host_memory, status, writer_status
from .catalog import views
from .config import Tier, TieredConfig, here
from .errors import TieredCheckpointError


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def age(created: float | None) -> str:
    if created is None:
        return ""
    s = max(0.0, time.time() - created)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h" if s < 172800 else f"{s / 86400:.0f}d"


def _config(args: argparse.Namespace) -> TieredConfig:
    if getattr(args, "config", None):
        if args.tiers or args.namespace:
            raise SystemExit("give either --config or -n NAMESPACE and the tiers, not both")
        from .jobconfig import load_job_config

        return load_job_config(args.config)
    if not args.namespace or not args.tiers:
        raise SystemExit(
            "say which job: --config tiers.toml (or python:module:attr), or -n NAMESPACE TIER..."
        )
    options = {}
    for kv in args.option or []:
        key, sep, value = kv.partition("=")
        if not sep:
            raise SystemExit(f"--option wants KEY=VALUE, got {kv!r}")
        options[key] = value
    tiers = [
        Tier(t, storage_options=options if "://" in t and not t.startswith("file://") else {})
        for t in args.tiers
    ]
    return TieredConfig(args.namespace, tiers)


def cmd_ls(args: argparse.Namespace) -> int:
    cfg = _config(args)
    rows = status(cfg)
    if args.json:
        return _ls_json(cfg, rows)
    if not rows:
        print(f"no steps of namespace {cfg.namespace!r} on any tier")
        return 0
    cells = {
        (r.step, r.tier_index): f"{r.state} {human(r.size_bytes)} {age(r.created)}".strip() for r in rows
    }
    for r in rows:  # logical -> stored (compression) -> written (dedup), where known
        if r.logical_bytes:
            cells[(r.step, r.tier_index)] += (
                f" [{human(r.logical_bytes)} logical, x{r.compression_ratio:.2f} stored,"
                f" x{r.dedup_ratio:.2f} written]"
            )
    header = ["step"] + [f"tier {i}: {t.path}" for i, t in enumerate(cfg.tiers)]
    table = [
        [str(step)] + [cells.get((step, i), "-") for i in range(len(cfg.tiers))]
        for step in sorted({r.step for r in rows}, reverse=True)
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *table, strict=True)]
    for line in [header, *table]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    for r in rows:  # what a state that is not a good step means, and what to do
        if r.error and r.state in ("damaged", "incomplete"):
            print(f"  step {r.step} on tier {r.tier_index}: {r.state}: {r.error}")
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
    _print_memory(cfg)
    _print_scores(cfg)
    return 0


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
    from .scores import FLOOR_SECONDS, THRESHOLD, job_scores

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
    from .scores import job_scores

    out = {
        "namespace": cfg.namespace,
        "tiers": [t.path for t in cfg.tiers],
        "steps": [dataclasses.asdict(r) for r in rows],
        "writers": [dataclasses.asdict(w) for w in writer_status(cfg)],
        "host_memory": dataclasses.asdict(host_memory(cfg)),
        "scores": [dataclasses.asdict(s) for s in job_scores(cfg)],
    }
    print(json.dumps(out, indent=1))
    return 0


def _pick_step(cfg: TieredConfig, step: int | None) -> int | None:
    if step is not None:
        return step
    committed = {s for v in views(cfg, *here()) for s in v.committed()}
    return max(committed) if committed else None


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_step  # imports torch (to read the metadata): only here

    cfg = _config(args)
    step = _pick_step(cfg, args.step)
    if step is None:
        print(f"no committed step of namespace {cfg.namespace!r} on any tier", file=sys.stderr)
        return 2
    checks = verify_step(cfg, step, *here())
    if not checks:
        print(f"step {step} is not committed on any tier", file=sys.stderr)
        return 2
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
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    cfg = _config(args)
    t0 = time.perf_counter()
    dest = export(cfg, args.step, args.to)
    print(
        f"exported to {dest} (a stock DCP checkpoint: FileSystemReader({dest!r})) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0


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
        help="storage option passed to fsspec for URL tiers (repeatable)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered-dcp", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ls", help="steps x tiers: state, size, age; writers; save-time scores")
    _tier_args(p, json_output=True)
    p.set_defaults(fn=cmd_ls)
    p = sub.add_parser("verify", help="re-check every checksum of a step; exit 1 on damage")
    _tier_args(p, json_output=True)
    p.add_argument("--step", type=int, help="the step (default: the newest committed)")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("export", help="write a step as a stock DCP checkpoint directory")
    _tier_args(p)
    p.add_argument("--step", type=int, help="the step (default: the newest complete)")
    p.add_argument("--to", required=True, help="destination directory")
    p.set_defaults(fn=cmd_export)
    from . import drill, goodput  # torch-free; their commands import what they need when run

    p = sub.add_parser("goodput", help="best save interval per tier, and the goodput it buys (Young/Daly)")
    _tier_args(p, json_output=True)
    goodput.add_arguments(p)
    p.set_defaults(fn=lambda a: goodput.command(a, _config(a) if a.config or a.tiers else None))
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except (TieredCheckpointError, ValueError) as e:
        print(f"tiered-dcp {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
