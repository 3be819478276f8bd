"""DCP planning: the load plan (``load``), the save plan passes (``save``), the save planner
with cross-rank dedup (``tiered_save``), read routing (``routing``)."""
