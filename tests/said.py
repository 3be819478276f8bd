"""What tiered_dcp logs in a test's process, kept for the test to read."""

from __future__ import annotations

import logging


def kept_warnings() -> list[str]:
    """Every warning tiered_dcp logs in this process from now on, in order: a list that grows
    while the test runs (a rank's lines, returned to the test that started it)."""
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    logging.getLogger("tiered_dcp").addHandler(Keep(logging.WARNING))
    return kept
