"""Count XLA compilations (through jax.monitoring's public listener API)."""

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_count = [0]


def _listener(event, duration, **kwargs):
    if event == _COMPILE_EVENT:
        _count[0] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def compiles() -> int:
    """Number of backend compilations so far in this process."""
    return _count[0]


def eager_compiles(source, state, calls):
    """Compilations made by ``calls`` eager ``source.next`` calls after a first one."""
    _, _, state = source.next(state)
    before = compiles()
    for _ in range(calls):
        _, _, state = source.next(state)
    return compiles() - before
