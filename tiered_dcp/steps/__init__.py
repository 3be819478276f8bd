"""A step on the tiers: its parts and blocks, DCP metadata, commit, placement, leases,
choice, retention and status (torch-free, but for metadata)."""
