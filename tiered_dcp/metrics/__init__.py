"""What the timings say: goodput per tier, slow-rank scores."""
