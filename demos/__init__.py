"""Demos: the fully asynchronous setup with the daemon (ckpt-engine demo), and the library alone (demo-library)."""
