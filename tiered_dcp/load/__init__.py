"""The trainer's side of a load: the DCP reader, opening a step, reading its items (own
roots, peers, shared tiers, GPUs), resume."""
