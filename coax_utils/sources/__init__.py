"""JIT-friendly streaming data sources: pure state machines usable inside ``jax.lax.scan``."""

__all__ = [
]
