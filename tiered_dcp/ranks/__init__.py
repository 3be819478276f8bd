"""Ranks and the job: clique layout, failure domains, gloo groups between ranks."""
