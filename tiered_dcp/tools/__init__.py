"""What ships beside the library for the command line: the demo, the failure drill and the
fake GCS server with its fault proxy (the tests', the benchmarks' and the drill's bucket).
Nothing in the library's core imports them."""
