"""Moving replica bytes between ranks: a gloo group of our own per operation, with timeouts.

Replicas never travel over the group DCP's collectives use (the user's training group, or
DCP's own in its PROCESS mode). Each save's clique exchange and each load's peer reads open
fresh ``ProcessGroupGloo``s on the job's rendezvous store, only between the ranks that
exchange data, under names every rank derives alike (namespace, purpose, a sequence number,
the members). A fresh group costs about a millisecond, and a group broken by a timed-out
peer is never reused.

Small agreements (who is done, the commit's metadata, who wants what from whom at load) go
through the store itself.

Everything here belongs to one world (``world``): its store, its operations' names.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PeerLostError, TieredCheckpointError
from . import worlds

log = logging.getLogger(__name__)
OPENED: deque[list[int]] = deque(maxlen=1000)  # members of the last groups this process opened (tests)
CHECK_IN = 5.0  # seconds the survivors of a broken collective wait for each other to say so


class PeerTimeout(PeerLostError):
    """A peer did not answer within ``TieredConfig.peer_timeout`` (or its connection broke).

    Raised where the step is not known (a group's transfer); a load falls back to another
    source, a save turns it into its own ``PeerLostError`` (``lost``)."""


def lost(
    step: int | None,
    phase: str,
    cause: BaseException,
    ranks: Sequence[int] | None = None,
    why: str | None = None,
) -> PeerLostError:
    """The ``PeerLostError`` for ``cause`` (a broken collective, a peer that timed out),
    naming the ranks that did not answer: ``ranks`` where the caller knows them, else those
    that did not check in (``silent_ranks``); ``why`` says how it showed (default: the first
    line of ``cause``)."""
    if isinstance(cause, PeerLostError) and cause.ranks and ranks is None:
        ranks = cause.ranks
    if ranks is None:
        ranks = silent_ranks()
    who = f"rank(s) {sorted(ranks)}" if ranks else "a peer rank (which one could not be told)"
    what = "the newest step" if step is None else f"step {step}"
    if why is None:
        why = first_line(cause)
    return PeerLostError(
        f"{what}: {who} stopped answering during {phase} ({why}); the job cannot go on: restart "
        "it (its resume loads the newest committed step; a save this interrupted is never committed)",
        step,
        phase,
        tuple(sorted(ranks or ())),
    )


def first_line(e: BaseException) -> str:
    """What ``e`` says in its first line (300 characters at most), or its type's name."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def silent_ranks(wait: float = CHECK_IN) -> tuple[int, ...]:
    """The ranks that did not check in within ``wait`` seconds after a collective broke.

    Each survivor appends its rank and the time to one list in the job's store (torch's
    prefixed one: a restarted job's attempt has its own) and reads it, more rarely as it
    waits, until every rank is in; a check-in older than ``wait`` before this one is an
    earlier break's, and does not count. Empty when the store itself does not answer: it
    lives with rank 0 or the launcher, which may be what died.
    """
    try:
        job, rank, size = worlds.store(), dist.get_rank(), dist.get_world_size()
        now = time.time()
        job.append(ALIVE, f"{rank}@{now:.3f},".encode())
    except Exception:  # noqa: BLE001 - the store is gone too: who stopped cannot be told
        return ()
    deadline, pause, missing = time.monotonic() + wait, 0.05, tuple(range(size))
    while True:
        try:
            missing = _not_in(job.get(ALIVE).decode(), size, since=now - wait)
        except Exception:  # noqa: BLE001 - the store went away meanwhile (its host is done): what it said last
            return missing if len(missing) < size else ()
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause *= 2


ALIVE = "tiered_dcp/alive"  # the survivors' check-ins: "rank@time," each, appended


def _not_in(listed: str, size: int, since: float) -> tuple[int, ...]:
    """The ranks below ``size`` with no check-in at or after ``since`` in ``listed``."""
    seen = set()
    for entry in filter(None, listed.split(",")):
        rank, _, at = entry.partition("@")
        with contextlib.suppress(ValueError):
            if float(at) >= since:
                seen.add(int(rank))
    return tuple(r for r in range(size) if r not in seen)


def broken_collective(e: BaseException) -> bool:
    """Whether ``e`` is torch's error for a collective or store call that a lost peer broke."""
    if isinstance(e, TieredCheckpointError):
        return False
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo", "Broken pipe")
    )


@contextlib.contextmanager
def watching_peers(step: int | None, phase: str) -> Iterator[None]:
    """Raise a collective broken by a lost peer as a ``PeerLostError`` (``lost``)."""
    try:
        yield
    except Exception as e:
        if not (worlds.dist_up() and broken_collective(e)):
            raise
        raise lost(step, phase, e) from e


def group_keys(name: str, member: int) -> list[str]:
    """The store keys gloo's rendezvous leaves for member index ``member`` of group ``name``.

    ``ProcessGroupGloo`` prefixes its one device's rendezvous with "0" and gloo keys each
    member's address by its index; nothing deletes them, so whoever opens a group does.
    """
    return [f"{name}/0/{member}"]


def as_bytes_tensor(buf: memoryview | bytes | bytearray) -> torch.Tensor:
    """A uint8 tensor over ``buf`` without a copy (read-only buffers are only ever sent)."""
    view = memoryview(buf).cast("B")
    if len(view) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we only send it
        return torch.frombuffer(view, dtype=torch.uint8)


class Group:
    """A gloo group over ``members`` (global ranks) for one operation, with a deadline per call.

    Open one only where a byte will cross it: gloo's setup returns on a member as soon as
    its own side is connected, so a member that closes a group it had no use for may do so
    while another is still connecting, and that one's setup fails ("Connection closed by
    peer") with every rank alive."""

    def __init__(self, name: str, members: Sequence[int], rank: int, timeout: float) -> None:
        self.members = list(members)
        self.me = self.members.index(rank)
        self.timeout = timeout
        self._tags: dict[tuple[str, int], int] = {}  # (send|recv, peer) -> ops posted so far
        OPENED.append(self.members)
        prefix = dist.PrefixStore(name, worlds.rendezvous_store(timeout))
        try:
            self.pg = dist.ProcessGroupGloo(
                prefix, self.me, len(self.members), datetime.timedelta(seconds=timeout)
            )
        except Exception as e:  # a member never arrived (the store's wait timed out) or broke off
            others = tuple(m for m in self.members if m != rank)
            raise PeerTimeout(
                f"ranks {self.members} could not form their group ({first_line(e)}; each had "
                f"{timeout:.0f} s to join)",
                ranks=others if len(others) == 1 else (),  # of two, the other is the one missing
            ) from e

    def _wait(self, works: list[tuple[int | None, Any]], what: str) -> None:
        """Wait for ``works`` (each with the peer it is with; None: every member) until the
        deadline; a failure names the peer, as the rank that stopped answering."""
        deadline = time.monotonic() + self.timeout
        for peer, w in works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                w.wait(datetime.timedelta(seconds=left))
            except Exception as e:
                me = self.members[self.me]
                ranks = [peer] if peer is not None else [m for m in self.members if m != me]
                raise PeerTimeout(f"{what} with rank(s) {ranks} failed: {e}", ranks=tuple(ranks)) from e

    def allgather(self, blob: bytes) -> list[bytes]:
        """Every member's ``blob``, in member order (bytes: what a member sends is never code)."""
        n = len(self.members)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        self._wait(
            [(None, self.pg.allgather([sizes], [torch.tensor([len(blob)], dtype=torch.int64)]))], "allgather"
        )
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(blob)] = as_bytes_tensor(blob)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
        self._wait([(None, self.pg.allgather([out], [mine]))], "allgather")
        return [out[i][: int(sizes[i])].numpy().tobytes() for i in range(n)]

    def post(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> list[tuple[int, Any]]:
        """Start every send and receive (each with its peer); they run in gloo's threads until
        ``wait``.

        The k-th send from A to B meets the k-th receive at B from A, counted over all of
        this group's ``post`` calls: both sides list their buffers in the same order, one
        call or many (a sender may post each buffer as soon as it has it). A peer that
        closed its end raises PeerTimeout, as ``wait`` does.
        """
        works, tags = [], self._tags
        for kind, ops in (("send", sends), ("recv", recvs)):
            for peer, t in ops:
                if t.numel() == 0:
                    continue
                tag = tags.get((kind, peer), 0)
                tags[(kind, peer)] = tag + 1
                other = self.members.index(peer)
                op = self.pg.send if kind == "send" else self.pg.recv
                try:
                    works.append((peer, op([t], other, tag)))
                except Exception as e:  # the peer closed its end (it gave up on this rank): as in wait
                    raise PeerTimeout(f"{kind} with rank {peer} failed: {e}", ranks=(peer,)) from e
        return works

    def wait(self, works: list[tuple[int, Any]]) -> None:
        self._wait(works, "replica transfer")

    def close(self) -> None:
        """Drop the connections (an unfinished peer sees them close instead of waiting)."""
        self.pg = None
