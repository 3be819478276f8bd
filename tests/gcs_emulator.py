"""The tests' name for ``tiered_dcp.cli.fakegcs`` (fake-gcs-server and the fault proxy), which
moved into the package so that ``tiered-dcp drill`` can use them."""

from tiered_dcp.cli.fakegcs import (  # noqa: F401
    DROP,
    PASS,
    PROJECT,
    STALL,
    Emulator,
    FaultProxy,
    emulator_binary,
    free_port,
)
