"""Structural protocols of function approximators (policies, value functions, models).

This package has no function-approximator classes. Instead, ``is_policy`` & co. recognise any
object that follows this protocol (duck typing, no base class or registration):

- ``params``: the model's parameters, a pytree such as :class:`haiku.Params` (not ``None``);
- ``function_state``: the model's state, a pytree such as :class:`haiku.State` (not
  ``None``; use ``{}`` for stateless models);
- the object is callable (``obj(s)``, ``obj(s, a)``, ...);
- ``approximates``: a string naming what the object approximates, one of ``"policy"``,
  ``"v"``, ``"q"``, ``"reward_function"``, ``"transition_model"``. A class attribute is the
  usual way to set it.

The role has to be declared because it cannot be told from the structure: a Q-function, a
reward function and a transition model all map ``(s, a)`` to an output.

Stochastic function approximators additionally have a callable ``dist_params`` (the
parameters of the output distribution for the given inputs) and a ``proba_dist`` attribute
(the distribution object those parameters belong to).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "is_policy",
    "is_qfunction",
    "is_reward_function",
    "is_stochastic",
    "is_transition_model",
    "is_vfunction",
]

APPROXIMATOR_KINDS = ("policy", "v", "q", "reward_function", "transition_model")


def _approximates(obj: Any) -> str | None:
    """The declared kind of a function approximator, or None if ``obj`` is not one."""
    if isinstance(obj, type) or not callable(obj):
        return None
    try:
        params = obj.params
        state = obj.function_state
        kind = obj.approximates
    except Exception:  # a missing attribute or a failing property: not an approximator
        return None
    if params is None or state is None or kind not in APPROXIMATOR_KINDS:
        return None
    return kind


def is_policy(obj: Any) -> bool:
    r"""Check whether an object is a policy.

    An object qualifies when it has ``params`` and ``function_state`` attributes (pytrees such
    as Haiku params and state, not ``None``), is callable (``a = pi(s)``), and its
    ``approximates`` attribute is ``"policy"``. See :func:`is_stochastic` for stochastic
    policies (which also have ``dist_params`` and ``proba_dist``).

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a policy.

    Examples
    --------
    >>> class Greedy:
    ...     approximates = "policy"
    ...     def __init__(self):
    ...         self.params, self.function_state = {"linear": {}}, {}
    ...     def __call__(self, s):
    ...         return 0
    >>> is_policy(Greedy()), is_qfunction(Greedy()), is_policy(Greedy)
    (True, False, False)
    """
    return _approximates(obj) == "policy"


def is_vfunction(obj: Any) -> bool:
    r"""Check whether an object is a state value function, or V-function.

    An object qualifies when it has ``params`` and ``function_state`` attributes (pytrees such
    as Haiku params and state, not ``None``), is callable (``v = v_func(s)``), and its
    ``approximates`` attribute is ``"v"``.

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a V-function.
    """
    return _approximates(obj) == "v"


def is_qfunction(obj: Any) -> bool:
    r"""Check whether an object is a state-action value function, or Q-function.

    An object qualifies when it has ``params`` and ``function_state`` attributes (pytrees such
    as Haiku params and state, not ``None``), is callable (``q(s, a)``, or ``q(s)`` for all
    actions at once), and its ``approximates`` attribute is ``"q"``.

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a Q-function.
    """
    return _approximates(obj) == "q"


def is_reward_function(obj: Any) -> bool:
    r"""Check whether an object is a reward function (a model of the immediate reward).

    An object qualifies when it has ``params`` and ``function_state`` attributes (pytrees such
    as Haiku params and state, not ``None``), is callable (``r = r_func(s, a)``), and its
    ``approximates`` attribute is ``"reward_function"``.

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a reward function.
    """
    return _approximates(obj) == "reward_function"


def is_transition_model(obj: Any) -> bool:
    r"""Check whether an object is a transition model (a dynamics model of the next state).

    An object qualifies when it has ``params`` and ``function_state`` attributes (pytrees such
    as Haiku params and state, not ``None``), is callable (``s_next = p(s, a)``), and its
    ``approximates`` attribute is ``"transition_model"``.

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a transition model.
    """
    return _approximates(obj) == "transition_model"


def is_stochastic(obj: Any) -> bool:
    r"""Check whether an object is a stochastic function approximator.

    An object qualifies when it is a function approximator of any kind (it has ``params`` and
    ``function_state`` attributes that are not ``None``, is callable, and its ``approximates``
    attribute is one of ``"policy"``, ``"v"``, ``"q"``, ``"reward_function"``,
    ``"transition_model"``), and in addition has a callable ``dist_params`` method (returning
    the parameters of the output distribution, e.g. ``pi.dist_params(s)``) and a
    ``proba_dist`` attribute (the distribution those parameters belong to).

    Parameters
    ----------
    obj
        Object to check.

    Returns
    -------
    bool
        Whether ``obj`` is a stochastic function approximator.

    Examples
    --------
    >>> class GaussianPolicy:
    ...     approximates = "policy"
    ...     proba_dist = "normal"
    ...     params, function_state = {"mu": {}}, {}
    ...     def __call__(self, s):
    ...         return 0.0
    ...     def dist_params(self, s):
    ...         return {"mu": 0.0, "logvar": 0.0}
    >>> is_stochastic(GaussianPolicy()), is_policy(GaussianPolicy())
    (True, True)
    """
    if _approximates(obj) is None:
        return False
    try:
        return callable(obj.dist_params) and hasattr(obj, "proba_dist")
    except Exception:
        return False
