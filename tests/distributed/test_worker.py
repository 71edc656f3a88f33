"""RolloutWorker on a real local Ray cluster with gymnasium's CartPole and a Haiku Q-network."""

import time

import gymnasium
import haiku as hk
import jax
import numpy as np
import pytest

from coax_utils.distributed import ParameterServer, ReplayServer, RolloutWorker
from coax_utils.replay import NStep, PrioritizedReplayBuffer, SimpleReplayBuffer, TransitionBatch

ENV = "CartPole-v1"


def _forward(S):
    return hk.nets.MLP([8, 2])(S)


Q = hk.without_apply_rng(hk.transform(_forward))


def _params(seed=0):
    return Q.init(jax.random.PRNGKey(seed), np.zeros((1, 4), np.float32))


def _constant_action_params(action):
    """Q-network parameters whose greedy action is always ``action``."""
    params = jax.tree_util.tree_map(np.zeros_like, _params())
    params["mlp/~/linear_1"]["b"] = np.eye(2, dtype=np.float32)[action]
    return params


def greedy(params, s, rng):
    return int(np.argmax(Q.apply(params, np.asarray(s, np.float32)[None])[0]))


def uniform(params, s, rng):
    return int(rng.integers(2))


def _local_rollout(policy, params, num_steps, n, gamma, seed):
    """The oracle: the same rollout in this process, traced with NStep."""
    env = gymnasium.make(ENV)
    rng = np.random.default_rng(seed)
    tracer, out, s = NStep(n=n, gamma=gamma), [], None
    for t in range(num_steps):
        if s is None:
            s, _ = env.reset(seed=seed if t == 0 else None)
        a = policy(params, s, rng)
        s_next, r, terminated, truncated, _ = env.step(a)
        tracer.add(s, a, r, terminated, truncated=truncated, s_next=s_next)
        while tracer:
            out.append(tracer.pop())
        s = None if terminated or truncated else s_next
    return TransitionBatch.concatenate(*out)


def _stored(ray, server):
    return TransitionBatch.concatenate(*ray.get(server.snapshot.remote()))


def _wait_until(condition, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.05)


def test_worker_matches_a_local_nstep_rollout(ray_cluster):
    ray = ray_cluster
    params = _params(seed=1)
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=1000))
    store = ParameterServer.remote(params)
    worker = RolloutWorker.remote(ENV, greedy, server, store, n=3, gamma=0.9, chunk_size=8, seed=3)
    stats = ray.get(worker.run.remote(60))
    assert stats["steps"] == 60 and stats["params_version"] == 1
    expected = _local_rollout(greedy, params, 60, n=3, gamma=0.9, seed=3)
    # run() flushes: everything traced is acknowledged, the last partial chunk included
    assert stats["transitions_added"] == stats["transitions_sent"] == expected.batch_size
    assert ray.get(server.num_added.remote()) == expected.batch_size

    final = ray.get(worker.stop.remote())  # nothing left to send
    assert final["transitions_added"] == expected.batch_size == ray.get(server.size.remote())
    assert final["episodes"] >= 1 and len(final["episode_returns"]) == final["episodes"]
    stored = _stored(ray, server)
    for field in ("S", "A", "Rn", "In", "S_next"):
        np.testing.assert_allclose(getattr(stored, field), getattr(expected, field), rtol=1e-6)
    ray.kill(worker)


def test_worker_pulls_the_latest_parameters(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=1000))
    store = ParameterServer.remote(_constant_action_params(0))
    worker = RolloutWorker.remote(ENV, greedy, server, store, chunk_size=1, sync_every=5)
    # batch_size: the old name of chunk_size
    fixed = RolloutWorker.remote(ENV, greedy, server, _constant_action_params(1), batch_size=1)

    ray.get(worker.run.remote(20))
    assert ray.get(store.set.remote(_constant_action_params(1))) == 2
    stats = ray.get(worker.run.remote(20))
    assert stats["params_version"] == 2
    actions = _stored(ray, server).A.tolist()
    # n=1: one transition per step, in order (the last step of an unfinished episode waits
    # for its successor); the new parameters act from step 21 on
    assert len(actions) in (39, 40)
    assert actions[:20] == [0] * 20 and set(actions[20:]) == {1}

    fixed_stats = ray.get(fixed.run.remote(10))
    assert fixed_stats["params_version"] == 0
    assert set(_stored(ray, server).A.tolist()[len(actions) :]) == {1}
    for w in (worker, fixed):
        ray.kill(w)


def favour_action_1(params, batch):
    return (np.asarray(batch.A) == 1).astype(np.float32)


def wrong_length(params, batch):
    return np.ones(batch.batch_size + 1)


def test_initial_priorities_come_from_priority_fn(ray_cluster):
    ray = ray_cluster
    buffer = PrioritizedReplayBuffer(capacity=1000, alpha=1.0, epsilon=1e-9, random_seed=0)
    server = ReplayServer.remote(buffer)
    worker = RolloutWorker.remote(
        ENV, uniform, server, 0, n=2, chunk_size=16, priority_fn=favour_action_1, seed=0
    )
    ray.get(worker.run.remote(100))
    stored = _stored(ray, server)
    assert 0 < np.mean(stored.A == 1) < 1  # the uniform policy took both actions
    sample = ray.get(server.sample.remote(256))
    assert np.all(sample.A == 1)  # zero-priority transitions are (almost surely) never drawn

    bad = RolloutWorker.remote(ENV, uniform, server, 0, chunk_size=4, priority_fn=wrong_length)
    with pytest.raises(ValueError, match="Adv must have shape"):
        ray.get(bad.run.remote(50))
    for w in (worker, bad):
        ray.kill(w)


def test_a_killed_worker_does_not_disturb_the_server_or_the_others(ray_cluster):
    ray = ray_cluster
    batch_size = 8
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=100_000))
    victim, survivor = (  # max_delay=None: only full chunks go out while they run
        RolloutWorker.remote(
            ENV, uniform, server, 0, n=3, chunk_size=batch_size, max_delay=None, seed=s
        )
        for s in (1, 2)
    )
    ray.get([victim.start.remote(), survivor.start.remote()])

    def added(worker):
        return ray.get(worker.stats.remote())["transitions_added"]

    _wait_until(lambda: added(victim) >= 4 * batch_size and added(survivor) >= batch_size)
    last_seen = added(victim)
    ray.kill(victim)  # mid-run, with pushes possibly in flight

    def dead(worker):
        # ray.kill is asynchronous: a call sent right after it may still be served
        try:
            ray.get(worker.stats.remote())
        except ray.exceptions.RayActorError:
            return True
        return False

    _wait_until(lambda: dead(victim), timeout=30.0)

    before = added(survivor)
    _wait_until(lambda: added(survivor) >= before + 4 * batch_size)
    final = ray.get(survivor.stop.remote())
    assert final["transitions_added"] == final["transitions_sent"]

    total = ray.get(server.num_added.remote())
    assert ray.get(server.size.remote()) == total
    from_victim = total - final["transitions_added"]
    # everything acknowledged to the victim is there, in whole chunks (a call lands whole
    # or not)
    assert from_victim >= last_seen
    assert from_victim % batch_size == 0
    stored = _stored(ray, server)
    assert stored.batch_size == total
    assert set(np.unique(stored.In).tolist()) <= {0.0, np.float32(0.99**3)}
    assert ray.get(server.sample.remote(32)).batch_size == 32
    ray.kill(survivor)


def broken_policy(params, s, rng):
    raise RuntimeError("policy failed on purpose")


def test_worker_errors(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=100))
    with pytest.raises(TypeError, match="env_fn"):
        RolloutWorker.remote(123, greedy, server, 0)
    with pytest.raises(TypeError, match="policy"):
        RolloutWorker.remote(ENV, "greedy", server, 0)
    with pytest.raises(TypeError, match="server"):
        RolloutWorker.remote(ENV, greedy, SimpleReplayBuffer(capacity=100), 0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        RolloutWorker.remote(ENV, greedy, server, 0, n=0)
    with pytest.raises(ValueError, match="gamma"):
        RolloutWorker.remote(ENV, greedy, server, 0, gamma=1.5)
    with pytest.raises(ValueError, match="chunk_size"):
        RolloutWorker.remote(ENV, greedy, server, 0, chunk_size=0)
    with pytest.raises(ValueError, match="max_delay"):
        RolloutWorker.remote(ENV, greedy, server, 0, max_delay=0.0)
    with pytest.raises(TypeError, match="chunk_size only"):
        RolloutWorker.remote(ENV, greedy, server, 0, chunk_size=8, batch_size=8)
    with pytest.raises(ValueError, match="params"):
        RolloutWorker.remote(ENV, greedy, server, None)

    empty_store = ParameterServer.remote()
    assert ray.get(empty_store.get.remote()) == (0, None)
    waiting = RolloutWorker.remote(ENV, greedy, server, empty_store)
    with pytest.raises(ValueError, match="no parameters yet"):
        ray.get(waiting.run.remote(1))

    broken = RolloutWorker.remote(ENV, broken_policy, server, 0)
    ray.get(broken.start.remote())
    with pytest.raises(RuntimeError, match="on purpose"):
        ray.get(broken.stop.remote())
    assert ray.get(server.size.remote()) == 0
    for w in (waiting, broken):
        ray.kill(w)


class FailOnce:
    """A priority_fn whose first call fails (a flaky learner-side computation)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, params, batch):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("priority_fn failed once on purpose")
        return np.ones(batch.batch_size)


def test_an_error_in_run_stops_the_worker_and_drops_nothing_silently(ray_cluster):
    ray = ray_cluster
    server = ReplayServer.remote(PrioritizedReplayBuffer(capacity=100, random_seed=0))
    worker = RolloutWorker.remote(
        ENV, uniform, server, 0, chunk_size=4, priority_fn=FailOnce(), seed=0
    )
    with pytest.raises(RuntimeError, match="once on purpose"):
        ray.get(worker.run.remote(8))
    # the error stopped the worker: every later call raises it, none steps on without the
    # batch that failed
    with pytest.raises(RuntimeError, match="once on purpose"):
        ray.get(worker.stats.remote())
    with pytest.raises(RuntimeError, match="once on purpose"):
        ray.get(worker.run.remote(8))
    with pytest.raises(RuntimeError, match="once on purpose"):
        ray.get(worker.stop.remote())
    with pytest.raises(RuntimeError, match="once on purpose"):
        ray.get(worker.start.remote())
    assert ray.get(server.size.remote()) == 0

    # the same in stop(): the server rejects the chunk that stop() flushes (its buffer holds
    # transitions of another structure)
    other = SimpleReplayBuffer(capacity=100)
    other.add(TransitionBatch.from_single(s=0.0, a=0, logp=0.0, r=1.0, done=False, gamma=0.9))
    rejecting = ReplayServer.remote(other)
    late = RolloutWorker.remote(
        ENV, uniform, rejecting, 0, chunk_size=10_000, max_delay=None, seed=0
    )
    ray.get(late.start.remote())
    _wait_until(lambda: ray.get(late.stats.remote())["transitions_sent"] >= 5)
    assert ray.get(rejecting.num_added.remote()) == 1  # nothing sent before stop()
    with pytest.raises(ValueError, match="differs in structure"):
        ray.get(late.stop.remote())
    with pytest.raises(ValueError, match="differs in structure"):
        ray.get(late.stop.remote())
    with pytest.raises(ValueError, match="differs in structure"):
        ray.get(late.run.remote(1))
    assert ray.get(rejecting.num_added.remote()) == 1

    # a failed parameter pull changes nothing: run() may be called again once published
    store = ParameterServer.remote()
    early = RolloutWorker.remote(ENV, uniform, server, store, batch_size=1)
    with pytest.raises(ValueError, match="no parameters yet"):
        ray.get(early.run.remote(3))
    ray.get(store.set.remote(0))
    assert ray.get(early.run.remote(3))["params_version"] == 1
    for actor in (worker, late, early, rejecting):
        ray.kill(actor)


def test_arguments_the_actor_would_die_on_are_refused_by_remote(ray_cluster):
    # each of these used to pass RolloutWorker.remote and kill the actor in its constructor
    # (NStep or NumPy refusing them), so the error only came as RayActorError on a later call
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=10))
    for gamma in ("0.5", True):
        with pytest.raises(TypeError, match="gamma"):
            RolloutWorker.remote(ENV, greedy, server, 0, gamma=gamma)
    with pytest.raises(ValueError, match="seed"):
        RolloutWorker.remote(ENV, greedy, server, 0, seed=-1)
    worker = RolloutWorker.remote(ENV, uniform, server, 0, gamma=np.float32(0.5), seed=0)
    assert ray.get(worker.run.remote(3))["steps"] == 3
    ray.kill(worker)


def test_stop_with_a_timeout_returns_while_a_rate_limited_shard_holds_the_pushes(ray_cluster):
    # the learner stopped sampling: the shard's adds wait for the limiter (no insert_timeout),
    # so stop() used to wait for their acknowledgements for good
    from coax_utils.distributed import RateLimiter, ShardedReplay

    ray = ray_cluster
    # inserts wait once 2 transitions are in and nothing was sampled
    limiter = RateLimiter.remote(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=1.0)
    replay = ShardedReplay([SimpleReplayBuffer(100)], rate_limiter=limiter)
    too_large = RolloutWorker.remote(ENV, uniform, replay.shards[0], 0)  # chunks of 256
    with pytest.raises(ValueError, match="chunk_size must be <= 2"):  # the limiter's window
        ray.get(too_large.run.remote(5))
    ray.kill(too_large)
    worker = RolloutWorker.remote(ENV, uniform, replay.shards[0], 0, chunk_size=1, seed=0)
    ray.get(worker.start.remote())
    _wait_until(lambda: ray.get(worker.stats.remote())["transitions_sent"] >= 3)
    with pytest.raises(TypeError, match="timeout"):
        ray.get(worker.stop.remote(timeout="1"))
    with pytest.raises(TimeoutError, match="not acknowledged"):
        ray.get(worker.stop.remote(timeout=0.5))
    stats = ray.get(worker.stats.remote())  # stopped, not failed: the chunks are on their way
    assert stats["transitions_added"] == 2 < stats["transitions_sent"]

    # the learner samples: the limiter lets the held adds in, one by one
    while replay.size() < stats["transitions_sent"]:
        replay.sample(1, timeout=60.0)
    final = ray.get(worker.stop.remote(timeout=60.0))
    assert final["transitions_added"] == final["transitions_sent"] == replay.size()
    assert ray.get(worker.run.remote(0))["steps"] == final["steps"]  # usable again
    ray.kill(worker)


def uniform_batch(params, S, rng):
    return rng.integers(2, size=len(S))


@jax.jit
def _random_actions(key, S):
    return jax.random.randint(key, (S.shape[0],), 0, 2)


def jitted_uniform_batch(params, S, rng):
    """A jitted policy: its key comes from the worker's rng."""
    return _random_actions(jax.random.key(int(rng.integers(2**31))), jax.numpy.asarray(S))


def gymnax_cartpole(num_envs=3):
    import gymnax
    from gymnax.wrappers.gym import GymnaxToVectorGymWrapper

    env, params = gymnax.make("CartPole-v1")
    params = params.replace(max_steps_in_episode=6)  # truncations within a short run
    return GymnaxToVectorGymWrapper(env, num_envs=num_envs, params=params, seed=0)


def _local_vector_rollout(venv, policy, num_vector_steps, n, gamma, seed):
    """The oracle: one NStep per sub-env, stepped through the vector env in this process."""
    rng = np.random.default_rng(seed)
    obs, _ = venv.reset(seed=seed)
    obs = np.asarray(obs)
    tracers = [NStep(n=n, gamma=gamma) for _ in range(venv.num_envs)]
    skip = np.zeros(venv.num_envs, bool)
    out = []
    for _ in range(num_vector_steps):
        a = np.asarray(policy(None, obs, rng))
        nxt, r, term, trunc, info = venv.step(a)
        nxt, term, trunc = np.asarray(nxt), np.asarray(term), np.asarray(trunc)
        final = np.asarray(info.get("final_observation", nxt))
        for i, tracer in enumerate(tracers):
            if skip[i]:
                continue
            tracer.add(
                obs[i], a[i], float(r[i]), bool(term[i]), truncated=bool(trunc[i]), s_next=final[i]
            )
            while tracer:
                out.append(tracer.pop())
        skip = (term | trunc) & ~skip & ("final_observation" not in info)
        obs = nxt
    return TransitionBatch.concatenate(*out)


@pytest.mark.parametrize("kind", ["gymnasium", "gymnax_jitted_policy"])
def test_vector_worker_pushes_what_one_tracer_per_sub_env_traces(ray_cluster, kind):
    ray = ray_cluster
    server = ReplayServer.remote(SimpleReplayBuffer(capacity=1000))
    if kind == "gymnasium":
        for bad in (0, 2.0):
            with pytest.raises((TypeError, ValueError), match="num_envs"):
                RolloutWorker.remote(ENV, uniform_batch, server, 0, num_envs=bad)
        env_fn, policy, num_envs = ENV, uniform_batch, 4
        local = gymnasium.make_vec(ENV, num_envs=4)
    else:
        env_fn, policy, num_envs = gymnax_cartpole, jitted_uniform_batch, 3
        local = gymnax_cartpole()
    worker = RolloutWorker.remote(
        env_fn, policy, server, 0, n=3, gamma=0.9, chunk_size=8, seed=5, num_envs=num_envs
    )
    stats = ray.get(worker.run.remote(20 * num_envs))  # 20 vector steps
    assert stats["steps"] == 20 * num_envs and stats["episodes"] >= 1
    expected = _local_vector_rollout(local, policy, 20, n=3, gamma=0.9, seed=5)
    assert stats["transitions_added"] == stats["transitions_sent"] == expected.batch_size
    final = ray.get(worker.stop.remote())
    assert final["transitions_added"] == expected.batch_size == ray.get(server.size.remote())
    stored = _stored(ray, server)
    for field in ("S", "A", "Rn", "In", "S_next", "A_next"):
        np.testing.assert_array_equal(getattr(stored, field), getattr(expected, field))
    if kind == "gymnasium":
        assert np.any(stored.In == 0)  # terminated episodes, then next-step reset steps
    else:
        assert np.isclose(stored.In, 0.9).any()  # truncated: from the final observation
    ray.kill(worker)


class CountingServer(ReplayServer):
    """A ReplayServer that counts the calls of ``add`` (one per chunk a writer sends)."""

    def __init__(self, buffer):
        super().__init__(buffer)
        self._calls = []

    def add(self, transition_batch, Adv=None):
        n = super().add(transition_batch, Adv)
        self._calls.append(n)
        return n

    def calls(self):
        return list(self._calls)


def test_transitions_leave_in_chunks_and_stop_flushes_the_last_one(ray_cluster):
    ray = ray_cluster
    server = CountingServer.remote(SimpleReplayBuffer(capacity=10_000))
    # 4 sub-envs, 25 vector steps: about 100 transitions, traced in 25 batches of about 4
    worker = RolloutWorker.remote(
        ENV, uniform_batch, server, 0, chunk_size=16, max_delay=None, num_envs=4, seed=0
    )
    stats = ray.get(worker.run.remote(100))
    added = stats["transitions_added"]
    assert added == stats["transitions_sent"] == ray.get(server.num_added.remote()) > 16
    # full chunks of 16, then run()'s flush sends the rest: one add call per chunk
    first = ray.get(server.calls.remote())
    assert first == [16] * (added // 16) + [added % 16] * (added % 16 > 0)

    # in the background loop nothing leaves before a chunk is full (no max_delay): stop()
    # sends the open chunk and waits for it
    ray.get(worker.start.remote())
    _wait_until(lambda: ray.get(worker.stats.remote())["transitions_sent"] >= added + 8)
    final = ray.get(worker.stop.remote(timeout=60.0))
    assert final["transitions_added"] == final["transitions_sent"]
    assert final["transitions_added"] == ray.get(server.num_added.remote())
    later = ray.get(server.calls.remote())[len(first) :]
    assert sum(later) == final["transitions_added"] - added
    assert all(c == 16 for c in later[:-1]) and 0 < later[-1] <= 16  # then stop()'s chunk
    ray.kill(worker)
    ray.kill(server)
