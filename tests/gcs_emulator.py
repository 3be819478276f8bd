"""The tests' name for ``tiered_dcp.cli.local_servers`` (fake-gcs-server and the fault proxy), which
moved into the package so that ``tiered-dcp drill`` can use them."""

from tiered_dcp.cli.local_servers import (  # noqa: F401
    DROP,
    PASS,
    PROJECT,
    STALL,
    Emulator,
    FaultProxy,
    emulator_binary,
    free_port,
)
