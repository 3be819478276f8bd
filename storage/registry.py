"""Which backend serves a URL: a table from URL scheme to Storage class.

Each backend module registers itself with ``@register_backend("scheme", ...)`` when it is
imported (``storage/__init__.py`` imports the built-in ones, or names them in
``ON_DEMAND``), so adding a backend is one new file and one import, with no dispatch code
to edit. A plain path has the scheme ""; ``ANY_SCHEME`` names the backend for every scheme
no other backend claims (fsspec).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .base import Storage
from .forks import renew_in_child

ANY_SCHEME = "*"
_BACKENDS: dict[str, type[Storage]] = {}
# Backend modules imported when a URL's scheme is not registered yet, before ``ANY_SCHEME``
# is asked: the GCS backend imports asyncio, a third of a writer process's or a CLI
# command's start, which a job whose tiers are local paths never needs.
ON_DEMAND: list[str] = []
_IMPORTING = threading.Lock()  # a second thread asking meanwhile waits: no scheme falls to ANY early

S = TypeVar("S", bound=type[Storage])


def register_backend(*schemes: str) -> Callable[[S], S]:
    """Class decorator: ``cls(url, storage_options)`` serves URLs of these schemes."""

    def register(cls: S) -> S:
        for scheme in schemes:
            scheme = scheme.lower()
            other = _BACKENDS.get(scheme)
            if other is not None and other is not cls:
                raise ValueError(f"URL scheme {scheme!r} already served by {other.__qualname__}")
            _BACKENDS[scheme] = cls
        return cls

    return register


def scheme_of(url: str) -> str:
    """'gs' for 'gs://b/x', 'simplecache::gs' for a chained fsspec URL, '' for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def backend_for(url: str) -> type[Storage]:
    """The class registered for the URL's scheme, else the ``ANY_SCHEME`` one if it serves
    that scheme; a ValueError naming the scheme otherwise (cheap: checks a URL up front)."""
    scheme = scheme_of(url)
    cls = _BACKENDS.get(scheme)
    if cls is None and ON_DEMAND:
        _import_on_demand()
        cls = _BACKENDS.get(scheme)
    if cls is None:
        cls = _BACKENDS.get(ANY_SCHEME)
        if cls is None or not cls.serves(scheme):
            raise ValueError(
                f"no storage backend for URL scheme {scheme!r} ({url}): none is registered for it"
                + (f" and {cls.__qualname__} does not serve it" if cls is not None else "")
            )
    return cls


@renew_in_child
def _renew_lock() -> None:
    """A child forked while a thread of its parent held the lock gets one of its own (the
    import itself is safe: the interpreter renews its import lock at a fork)."""
    global _IMPORTING
    _IMPORTING = threading.Lock()


def _import_on_demand() -> None:
    with _IMPORTING:
        while ON_DEMAND:
            importlib.import_module(ON_DEMAND[0])  # it registers its schemes
            del ON_DEMAND[0]


def check_url(url: str) -> None:
    """A ValueError when no installed backend can open ``url``: its scheme has none (the
    message names the URL), or a package it needs is missing (the message names it and how
    to install it). Cheap: imports no package a backend needs."""
    cls = backend_for(url)
    missing = cls.missing(scheme_of(url))
    if missing:
        raise ValueError(missing)


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The store for one tier root, from the backend registered for its URL scheme."""
    return backend_for(url)(url, storage_options)
