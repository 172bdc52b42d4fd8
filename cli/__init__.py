"""The ``ckpt-engine`` command: the daemon, a client for its HTTP API, the demos, the benchmarks and the
fault trials. The top of the import graph: it may import every other folder, and none imports it."""
