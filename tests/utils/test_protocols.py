"""Tests of the structural function-approximator protocols (is_policy & co.)."""

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

from coax_utils import utils

PREDICATES = {
    "policy": utils.is_policy,
    "v": utils.is_vfunction,
    "q": utils.is_qfunction,
    "reward_function": utils.is_reward_function,
    "transition_model": utils.is_transition_model,
}


def _network(x):
    return hk.nets.MLP([8, 2])(x)


class Approximator:
    """A minimal Haiku-backed function approximator following the documented protocol."""

    def __init__(self, kind, stateful=False):
        self.approximates = kind
        net = hk.transform_with_state(
            lambda x: hk.BatchNorm(True, True, 0.9)(_network(x), True) if stateful else _network(x)
        )
        self.params, self.function_state = net.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
        self._apply = net.apply

    def __call__(self, s, a=None):
        out, _ = self._apply(self.params, self.function_state, None, s)
        return out


class StochasticApproximator(Approximator):
    proba_dist = "categorical"

    def dist_params(self, s, a=None):
        return {"logits": self(s, a)}


@pytest.mark.parametrize("kind", sorted(PREDICATES))
def test_each_kind_matches_exactly_one_predicate(kind):
    obj = Approximator(kind, stateful=kind == "v")
    assert obj(jnp.ones((2, 3))).shape == (2, 2)  # it really is a working approximator
    for other, predicate in PREDICATES.items():
        assert predicate(obj) is (other == kind), (kind, other)
    assert utils.is_stochastic(obj) is False
    assert utils.is_stochastic(StochasticApproximator(kind)) is True
    assert PREDICATES[kind](StochasticApproximator(kind)) is True


def test_objects_missing_part_of_the_protocol_do_not_qualify():
    good = Approximator("q")
    assert utils.is_qfunction(good)

    no_kind = Approximator("q")
    del no_kind.approximates
    assert not utils.is_qfunction(no_kind)

    unknown = Approximator("critic")
    assert not any(p(unknown) for p in PREDICATES.values()) and not utils.is_stochastic(unknown)

    no_params = Approximator("q")
    no_params.params = None
    assert not utils.is_qfunction(no_params)

    no_state = Approximator("q")
    del no_state.function_state
    assert not utils.is_qfunction(no_state)

    class NotCallable:
        approximates = "q"
        params, function_state = {}, {}

    assert not utils.is_qfunction(NotCallable())
    assert not utils.is_qfunction(Approximator)  # the class itself is not an approximator

    class Broken(Approximator):
        @property
        def params(self):
            raise RuntimeError("not initialized")

        @params.setter
        def params(self, value):
            pass

    assert not utils.is_policy(Broken("policy"))

    class NoProbaDist(Approximator):
        def dist_params(self, s):
            return {}

    assert not utils.is_stochastic(NoProbaDist("policy"))

    class DistParamsNotCallable(Approximator):
        proba_dist = "normal"
        dist_params = None

    assert not utils.is_stochastic(DistParamsNotCallable("policy"))


def test_plain_values_do_not_qualify():
    for obj in (None, 1, "policy", {}, lambda s: s, jnp.ones(3)):
        assert not any(p(obj) for p in PREDICATES.values())
        assert not utils.is_stochastic(obj)
