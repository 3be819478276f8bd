"""The trainer's side of a save: the DCP writer, staging, snapshots, replication, host memory, preemption."""
