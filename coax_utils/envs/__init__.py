"""JAX spaces, space conversion, and the gymnasium <-> functional-JAX env bridge."""

__all__ = [
]
