"""ckpt-engine: bucketed, versioned, hash-verified weight sync from trainers to rollout engines."""

__version__ = "0.1.0"
