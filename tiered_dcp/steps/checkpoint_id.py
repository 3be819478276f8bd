"""What DCP's ``checkpoint_id`` means for tiered-dcp: a step of the writer's or reader's config.

``dcp.save(..., checkpoint_id=X, storage_writer=w)`` and ``dcp.load(..., checkpoint_id=X,
storage_reader=r)`` call ``w.reset(X)`` / ``r.reset(X)``. Where a step is stored is the
config's business (its tiers), so the only id that can mean something is the step itself:
the integer, its decimal string, or the id a writer or reader reports (``step_id``: the
step's directory inside every tier, ``<namespace>/step_<12 digits>``). Anything else, a
directory path above all, is refused: silently saving elsewhere than the caller named would
be worse than an error.
"""

from __future__ import annotations

import os
import uuid

from tiered_dcp.storage.format import parse_step_dir, step_dir


def step_id(namespace: str, step: int) -> str:
    """The id of ``step``: its directory inside every tier of the namespace."""
    return step_dir(namespace, step)


def step_of(namespace: str, checkpoint_id: object, who: str) -> int:
    """The step ``checkpoint_id`` names; ValueError saying what is accepted otherwise."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str | os.PathLike):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str):
            if text.isdigit():
                return int(text)
            ns, sep, name = text.rpartition("/")
            step = parse_step_dir(name)
            if sep and ns == namespace and step is not None:
                return step
    raise ValueError(
        f"{who}: checkpoint_id={checkpoint_id!r} does not name a step of namespace {namespace!r}. "
        "tiered-dcp stores a step where its TieredConfig's tiers say, so checkpoint_id can only be "
        f"the step: an int, its digits, or '{step_id(namespace, 0)}'-style ids as reported by "
        f".checkpoint_id. To save under a directory of your own, use torch's FileSystemWriter; "
        f"to write a saved step out as a stock DCP directory, use tiered_dcp.export()."
    )


def new_id() -> str:
    """A fresh save or load id (DCP's ``StorageMeta.save_id`` / ``load_id``)."""
    return uuid.uuid4().hex
