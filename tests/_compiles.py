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


def compiles_again(calls, repeats=3):
    """Compilations made by calling each of ``calls`` (functions of an int) ``repeats``
    more times, after one call each."""
    import jax

    for call in calls:
        call(0)
    before = compiles()
    for i in range(1, repeats + 1):
        for call in calls:
            jax.block_until_ready(call(i))
    return compiles() - before
