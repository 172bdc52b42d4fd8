"""Fault trials (ckpt-engine chaos) and the fuzzers: real clusters, hostile peers, injected faults."""
