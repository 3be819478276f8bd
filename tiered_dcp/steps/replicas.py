"""Data-parallel replicas compared at a save's agreement, and what a disagreement does.

Each rank hashes every replica it holds of the save's replicated items, into one digest per
replica group (``save.replica_check``; groups: ``planners.replicas``), and says them with
its word to the coordinator: through the commit agreement's store keys on a node-local
first tier (``commit.AgreedCommit``), in a round of their own on a shared one
(``commit.CoordinatorCommit``, ``standalone``). The coordinator compares each group's
digests (``mismatched``); only where they differ does it ask that group's ranks for a
digest per item (``Round``) and name the items, the ranks and their nodes
(``Disagreement``). With three copies or more the odd one out is named; with two, both.

What then happens is the job's ``on_replica_mismatch`` (``POLICIES``): ``"mark"`` commits
the step marked (its marker counts and names the items: loads pass it over), ``"raise"``
refuses it (``ReplicaMismatchError`` on every rank), ``"warn"`` commits it unmarked. Every
disagreement is one line in the log, at once, and in the job's records
(``record_findings``). An item whose copies differ at two saves in a row is a value kept per
rank by design (``per_rank_values``): said once, not marked again. Torch-free.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from tiered_dcp.storage.format import NONFINITE_NAMES

from ..errors import PeerLostError

if TYPE_CHECKING:
    from ..ranks.worlds import Op

log = logging.getLogger(__name__)

ASK = "replicas/ask"  # the coordinator's question: group id -> the ranks asked for item digests
ANSWER = "replicas/items/{rank}"
WORD = "replicas/word/{rank}"  # a shared first tier's round: a rank's digests
COUNT, ALL = "replicas/count", "replicas/all"
DCP_KEEPS_ONE = (
    "DCP saves one copy of a key that several ranks hold and drops the others unread: a value "
    "meant to differ per rank needs a key of its own on each rank"
)


class ReplicaDigests(Protocol):
    """One rank's side of the comparison (``save.replica_check.ReplicaCheck``)."""

    found: list[Disagreement]  # the coordinator's: what the comparison found (for the commit)

    def digests(self) -> dict[str, str]:
        """Group id -> this rank's digest of its copies of the group's items."""

    def item_digests(self, groups: Collection[str]) -> dict[str, list[list]]:
        """Group id -> ``[fqn, offset, digest]`` per item of the group, in group order."""

    def record_findings(self, found: list[Disagreement]) -> None:
        """The coordinator, once it named what differs: said in the log and the records."""


SHOWN, SHOWN_GROUPS = 8, 4  # ranks (nodes) of a group, and groups, a line names: 10,000 ranks may hold a copy


def _few(numbers: list[int]) -> str:
    """The first ``SHOWN`` of ``numbers``, and how many more."""
    more = f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else ""
    return ", ".join(map(str, numbers[:SHOWN])) + more


@dataclass(frozen=True)
class Disagreement:
    """One item whose copies differ: ``values`` groups its holders by the bytes they hold,
    the largest group first; ``odd`` are the ranks outside a strict majority (all of them
    when there is none: two copies cannot tell which is right)."""

    step: int
    item: str
    offset: tuple[int, ...]
    values: tuple[tuple[int, ...], ...]
    nodes: dict[int, int]  # rank -> its node

    @property
    def majority(self) -> tuple[int, ...] | None:
        first = self.values[0]
        if len(first) > 1 and all(len(v) < len(first) for v in self.values[1:]):
            return first
        return None

    @property
    def odd(self) -> tuple[int, ...]:
        agree = set(self.majority or ())
        return tuple(sorted(r for v in self.values for r in v if r not in agree))

    def _ranks(self, ranks: Collection[int]) -> str:
        word = "rank" if len(ranks) == 1 else "ranks"
        where = sorted({self.nodes.get(r, -1) for r in ranks})
        node = "node" if len(where) == 1 else "nodes"
        return f"{word} {_few(sorted(ranks))} ({node} {_few(where)})"

    def line(self) -> str:
        """The one line a disagreement is said in (log, records, errors)."""
        what = f"step {self.step}: replicas of {self.item!r}" + (
            f" (chunk at offset {list(self.offset)})" if any(self.offset) else ""
        )
        majority = self.majority
        if majority is not None:
            said = f"{self._ranks(self.odd)} differs from {self._ranks(majority)}, which agree"
        else:
            copies = sum(len(v) for v in self.values)
            groups = [self._ranks(v) for v in self.values[:SHOWN_GROUPS]]
            if len(self.values) > SHOWN_GROUPS:
                groups.append(f"{len(self.values) - SHOWN_GROUPS} more groups of ranks")
            none = f" hold different values (with {copies} copies none can be told right)"
            said = " and ".join(groups) + none
        return f"{what} disagree: {said}; {DCP_KEEPS_ONE}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["nodes"] = {str(r): n for r, n in self.nodes.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Disagreement:
        return cls(
            int(d["step"]),
            str(d["item"]),
            tuple(int(x) for x in d["offset"]),
            tuple(tuple(int(r) for r in v) for v in d["values"]),
            {int(r): int(n) for r, n in d["nodes"].items()},
        )


def mismatched(words: Mapping[int, Mapping[str, str]]) -> dict[str, list[int]]:
    """Group id -> its ranks, for each group whose ranks' digests are not all the same."""
    seen: dict[str, dict[int, str]] = {}
    for rank, digests in words.items():
        for group, digest in digests.items():
            seen.setdefault(group, {})[rank] = digest
    return {g: sorted(d) for g, d in seen.items() if len(set(d.values())) > 1}


def name(step: int, answers: Mapping[int, Mapping[str, list[list]]], world: list[int]) -> list[Disagreement]:
    """The items whose copies differ, from the asked ranks' item digests (``Round``).

    Digests of two kinds (a host checksum, a device digest) are not compared: a save that
    found one replica in host memory and another on a device says nothing of them."""
    per_item: dict[tuple[str, tuple[int, ...]], dict[int, str]] = {}
    for rank, groups in answers.items():
        for items in groups.values():
            for fqn, offset, digest in items:
                per_item.setdefault((str(fqn), tuple(offset)), {})[rank] = str(digest)
    found = []
    for (fqn, offset), digests in sorted(per_item.items()):
        if len({d[:1] for d in digests.values()}) > 1:
            log.debug("step %d: replicas of %r not compared: digested on host and device", step, fqn)
            continue
        by_value: dict[str, list[int]] = {}
        for rank, digest in sorted(digests.items()):
            by_value.setdefault(digest, []).append(rank)
        if len(by_value) > 1:
            values = tuple(sorted((tuple(v) for v in by_value.values()), key=lambda v: (-len(v), v)))
            nodes = {r: world[r] if r < len(world) else -1 for v in values for r in v}
            found.append(Disagreement(step, fqn, offset, values, nodes))
    return found


@dataclass
class Round:
    """The question for item digests, through the save's ``op``: the coordinator ``ask``s
    the ranks of the groups that differ (every group rank waits for the question, which is
    empty when nothing differs) and ``collect``s their ``answer``s."""

    op: Op
    step: int

    def ask(self, asked: Mapping[str, list[int]]) -> None:
        key = self.op.key(ASK)
        self.op.sweep_later([key])
        self.op.store.set(key, json.dumps(asked).encode())

    def release(self) -> None:
        """An empty question, unless one was asked: the coordinator failed before its
        comparison, and no group rank may wait for a question that will not come."""
        key = self.op.key(ASK)
        self.op.sweep_later([key])
        self.op.store.compare_set(key, b"", b"{}")

    def answer(self, rank: int, check: ReplicaDigests) -> None:
        """A group's rank (not the coordinator): wait for the question; answer it if asked."""
        from ..ranks import transport  # torch: the save path only

        try:  # the coordinator waits for the slowest rank first: this wait is longer
            asked = json.loads(
                self.op.wait(self.op.key(ASK), "the replica comparison", [0], 2 * self.op.timeout)
            )
        except Exception as e:
            if isinstance(e, PeerLostError):
                raise
            waited = f"no question from the coordinator within {2 * self.op.timeout:g} s"
            raise transport.lost(self.step, "the replica comparison", e, [0], waited) from e
        mine = [g for g, ranks in asked.items() if rank in ranks]
        if mine:
            key = self.op.key(ANSWER.format(rank=rank))
            self.op.sweep_later([key])
            self.op.store.set(key, json.dumps(check.item_digests(mine)).encode())

    def collect(
        self, asked: Mapping[str, list[int]], own: int, check: ReplicaDigests
    ) -> dict[int, dict[str, list[list]]]:
        """The coordinator: every asked rank's item digests (its own from ``check``)."""
        from ..ranks import transport

        ranks = sorted({r for rs in asked.values() for r in rs})
        out: dict[int, dict[str, list[list]]] = {}
        for r in ranks:
            groups = [g for g, rs in asked.items() if r in rs]
            if r == own:
                out[r] = check.item_digests(groups)
                continue
            try:
                out[r] = json.loads(
                    self.op.wait(self.op.key(ANSWER.format(rank=r)), "the replica comparison", [r])
                )
            except PeerLostError:
                raise
            except Exception as e:
                raise transport.lost(self.step, "the replica comparison", e, [r]) from e
        return out


def compare(
    round_: Round, words: Mapping[int, Mapping[str, str]], own: int, check: ReplicaDigests, world: list[int]
) -> list[Disagreement]:
    """The coordinator's comparison: the groups whose digests differ, then their items,
    told at once (``tell``), less the values kept per rank. The question is asked, empty or
    not: group ranks wait for it."""
    asked = mismatched(words)
    round_.ask(asked)
    if not asked:
        check.found = per_rank_values(round_.op, [])  # nothing differs now: no value is per rank
        return []
    found = per_rank_values(round_.op, name(round_.step, round_.collect(asked, own, check), world))
    tell(found, check)
    return found


_DIFFERED: dict[str, set[str]] = {}  # the items that differed at this process's last compared save, by job
_SAID_PER_RANK: set[tuple[str, str]] = set()


def per_rank_values(op: Op, found: list[Disagreement]) -> list[Disagreement]:
    """``found`` less the items whose copies differed at the save before too and agree in no
    majority now: values kept per rank under one key by design (BatchNorm's running
    statistics under DDP, each rank updating them from its own batch), which stock DCP saves
    one copy of, not a fault that struck between two saves. Marking them would pass over
    every step of the job; each is said once instead. The first save that shows one still
    treats it as a disagreement, and a copy that a few ranks keep apart from a majority that
    agrees (a bit flipped in one rank's DDP parameter stays flipped) is marked at every save."""
    job = op.name.rsplit("/", 1)[0]  # the namespace's saves, whatever their sequence number
    before, _DIFFERED[job] = _DIFFERED.get(job, set()), {d.item for d in found}

    def per_rank(d: Disagreement) -> bool:
        return d.item in before and d.majority is None

    for d in filter(per_rank, found):
        if (job, d.item) not in _SAID_PER_RANK:
            _SAID_PER_RANK.add((job, d.item))
            log.warning(
                "replicas of %r differed at two saves in a row: a value kept per rank under one key "
                "(e.g. BatchNorm's running statistics under DDP), of which DCP saves one rank's copy; "
                "its steps are not marked for it from now on. Give it a key of its own on each rank, "
                "or make it equal on every rank, to have it compared",
                d.item,
            )
    return [d for d in found if not per_rank(d)]


def tell(found: list[Disagreement], check: ReplicaDigests) -> None:
    """Each disagreement in one line of the log, then to the writer (records, suspects)."""
    check.found = found
    for d in found[:NONFINITE_NAMES]:
        log.error("%s", d.line())
    if len(found) > NONFINITE_NAMES:
        log.error(
            "step %d: and %d more items whose replicas disagree", found[0].step, len(found) - NONFINITE_NAMES
        )
    if found:
        check.record_findings(found)


def standalone(
    op: Op, rank: int, world: list[int], check: ReplicaDigests | None, failed: bool, is_coordinator: bool
) -> list[Disagreement]:
    """A round of its own (a shared first tier: ``CoordinatorCommit``): every rank says
    its digests (or that its part failed: nothing is compared then), the coordinator
    compares; the group ranks answer its question. What the coordinator found; [] elsewhere."""
    word = {"failed": failed, "digests": check.digests() if check is not None and not failed else {}}
    key, count, done = op.key(WORD.format(rank=rank)), op.key(COUNT), op.key(ALL)
    op.sweep_later([key])
    op.store.set(key, json.dumps(word).encode())
    if op.store.add(count, 1) == len(world):
        op.store.set(done, b"1")
    round_ = Round(op, op.step or 0)
    if not is_coordinator:
        if word["digests"]:
            round_.answer(rank, check)  # type: ignore[arg-type] - digests: there is a check
        return []
    op.sweep_later([count, done])
    try:
        op.wait(done, "the replica comparison")
        words = [json.loads(op.store.get(op.key(WORD.format(rank=r)))) for r in range(len(world))]
    except BaseException:
        round_.ask({})  # no rank waits on a question that will not come
        raise
    if any(w["failed"] for w in words) or check is None:
        round_.ask({})
        return []
    return compare(round_, {r: w["digests"] for r, w in enumerate(words)}, rank, check, world)


# -- what a disagreement does: the job's ``on_replica_mismatch`` ------------------------


class Policy:
    """``"warn"``: the step is committed as any other; the log and the records say it."""

    def marker_fields(self, found: list[Disagreement]) -> dict:
        """The marker's replica fields (``format.Marker``): none."""
        return {}

    def refusal(self, step: int, where: str, found: list[Disagreement]) -> dict | None:
        """The verdict that refuses the step (``commit``'s refusal), or None."""
        return None


class Mark(Policy):
    """``"mark"`` (the default): committed marked; loads pass it over, as a non-finite one."""

    def marker_fields(self, found: list[Disagreement]) -> dict:
        if not found:
            return {}
        names = sorted({d.item for d in found})
        log.warning(
            "step %d saved and marked: its replicas disagree in %d item(s) %s; load_latest and "
            "TieredReader(config) pass it over (TieredReader(config, step=%d) loads it anyway)",
            found[0].step,
            len(found),
            names[:NONFINITE_NAMES],
            found[0].step,
        )
        return {
            "replica_mismatch_items": len(found),
            "replica_mismatch": names[:NONFINITE_NAMES],
            "replica_ranks": sorted({r for d in found for r in d.odd}),
        }


class Refuse(Policy):
    """``"raise"``: not committed; every rank raises ``ReplicaMismatchError``."""

    def refusal(self, step: int, where: str, found: list[Disagreement]) -> dict | None:
        if not found:
            return None
        lines = [d.line() for d in found[:NONFINITE_NAMES]]
        more = f"; and {len(found) - len(lines)} more item(s)" if len(found) > len(lines) else ""
        return {
            "error": f"step {step} not committed on {where} (on_replica_mismatch='raise'): "
            + "; ".join(lines)
            + more,
            "kind": "replica mismatch",
            "ranks": sorted({r for d in found for r in d.odd}),
            "items": sorted({d.item for d in found}),
        }


POLICIES: dict[str, Policy] = {"mark": Mark(), "raise": Refuse(), "warn": Policy(), "ignore": Policy()}
