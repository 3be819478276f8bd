"""DCP planning: the load plan (``load``), the save plan passes (``save``), read routing (``routing``)."""
