"""The tiered-dcp command: its --config loading, the demo, the drill and the fake GCS they start."""
