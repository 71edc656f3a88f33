"""Hypothesis: random add/update/sample/save/load sequences against a plain reference model."""

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coax_utils.replay import PrioritizedReplayBuffer, TransitionBatch

CAPACITY = 6
ALPHA, EPSILON = 0.5, 0.01

advantages = st.floats(-1e3, 1e3, allow_nan=False)
bad_advantages = st.sampled_from([np.nan, np.inf, -np.inf])


def rows(values):
    v = np.asarray(values, np.int64)
    return TransitionBatch(
        S=np.stack([v, -v], axis=1).astype(np.float32),
        A=v,
        logP=np.zeros(len(v), np.float32),
        Rn=v.astype(np.float32),
        In=np.ones(len(v), np.float32),
        S_next=v.astype(np.float32),
    )


class BufferMachine(RuleBasedStateMachine):
    """The model: an ordered dict id -> (value, |Adv|) of the newest CAPACITY additions."""

    def __init__(self):
        super().__init__()
        self.buffer = PrioritizedReplayBuffer(CAPACITY, alpha=ALPHA, epsilon=EPSILON, random_seed=0)
        self.model: dict[int, tuple[int, float]] = {}
        self.count = 0
        self.top = None  # the largest |Adv| given so far
        self.folder = tempfile.mkdtemp(prefix="buffer-model-")
        self.saved = None

    def teardown(self):
        shutil.rmtree(self.folder, ignore_errors=True)

    def _store(self, values, abs_adv):
        for v, a in zip(values, abs_adv):
            self.model[self.count] = (v, a)
            self.count += 1
        for i in list(self.model):
            if i < self.count - CAPACITY:
                del self.model[i]

    @rule(values=st.lists(st.integers(0, 10**6), min_size=1, max_size=9), data=st.data())
    def add(self, values, data):
        if data.draw(st.booleans()):
            adv = data.draw(st.lists(advantages, min_size=len(values), max_size=len(values)))
            self.buffer.add(rows(values), Adv=np.array(adv))
            kept = np.abs(adv)[-CAPACITY:]
            self.top = max(self.top or 0.0, float(kept.max()))
            self._store(values, np.abs(adv))
        else:
            self.buffer.add(rows(values))
            self._store(values, [1.0 if self.top is None else self.top] * len(values))

    @rule(bad=bad_advantages)
    def add_refused(self, bad):
        before = self._fingerprint()
        try:
            self.buffer.add(rows([1, 2]), Adv=np.array([1.0, bad]))
        except ValueError:
            pass
        else:
            raise AssertionError("a non-finite advantage was accepted")
        assert self._fingerprint() == before

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def update(self, data):
        live = sorted(self.model)
        ids = data.draw(
            st.lists(
                st.one_of(st.sampled_from(live), st.integers(0, self.count + 5)),
                min_size=1,
                max_size=5,
            )
        )
        adv = data.draw(st.lists(advantages, min_size=len(ids), max_size=len(ids)))
        self.buffer.update(np.array(ids, np.uint64), np.array(adv))
        winners = {i: abs(a) for i, a in zip(ids, adv) if i in self.model}  # last one wins
        for i, a in winners.items():
            self.model[i] = (self.model[i][0], a)
        if winners:
            self.top = max(self.top or 0.0, max(winners.values()))

    @precondition(lambda self: self.model)
    @rule(size=st.integers(1, 20))
    def sample(self, size):
        batch = self.buffer.sample(size)
        assert set(batch.idx.tolist()) <= set(self.model)
        for i, s in zip(batch.idx.tolist(), batch.S):
            assert s[0] == self.model[i][0] and s[1] == -self.model[i][0]
        assert np.all((batch.W > 0) & (batch.W <= 1)) and batch.W.max() == 1.0

    @rule()
    def save(self):
        self.buffer.save(self.folder)
        self.saved = (dict(self.model), self.count, self.top, self._fingerprint())

    @precondition(lambda self: self.saved is not None)
    @rule(mmap_mode=st.sampled_from(["c", None]))
    def load(self, mmap_mode):
        self.buffer = PrioritizedReplayBuffer.load(self.folder, mmap_mode=mmap_mode)
        self.model, self.count, self.top, fingerprint = self.saved
        self.model = dict(self.model)
        assert self._fingerprint() == fingerprint

    def _fingerprint(self):
        rows_ = [(int(r.idx[0]), float(r.S[0, 0])) for r in self.buffer]
        state = self.buffer._rng.bit_generator.state
        return rows_, self.buffer._abs_adv.tobytes(), self.buffer._tree._arr.tobytes(), state

    @invariant()
    def matches_the_model(self):
        stored = [(int(r.idx[0]), int(r.A[0])) for r in self.buffer]
        assert stored == [(i, v) for i, (v, _) in sorted(self.model.items())]
        assert len(self.buffer) == len(self.model)
        p = self.buffer._tree.values
        for i, (_, a) in self.model.items():
            slot = i % CAPACITY
            np.testing.assert_allclose(p[slot], (a + EPSILON) ** ALPHA, rtol=1e-12)
        assert np.isfinite(self.buffer._tree.root_value)


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
