"""DCP planning helpers: read routing (which stored bytes serve each read)."""
