"""Replay buffers against cpprb and flashbax, timed round robin in one process.

Configurations:

1. host uniform sample, 256 small transitions (obs: 4 float32): SimpleReplayBuffer vs cpprb
   (and the floor: one np.take per field into preallocated arrays);
2. host uniform sample, 256 transitions with (84, 84, 4) uint8 frames (S and S_next) as a
   fraction of memcpy bandwidth: SimpleReplayBuffer vs cpprb vs a plain memcpy of as many
   bytes;
3. jitted uniform sample, 256 small items: make_uniform_buffer vs flashbax's item buffer;
4. jitted prioritized step (sample B, then update the B priorities, state donated):
   make_prioritized_buffer vs flashbax's prioritised item buffer.

Host samples are timed three ways: results dropped at once, "(kept)" where the caller holds
its previous batch while the next one is drawn (a training loop), and "(out=)" where the caller
hands its previous batch back to be overwritten. Every variant is checked for correctness
before it is timed.

Usage: ``python benchmarks/bench_replay.py [--quick] [--only 1,2,3,4]``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from coax_utils.replay import (
    SimpleReplayBuffer,
    TransitionBatch,
    make_prioritized_buffer,
    make_uniform_buffer,
)

# -- timing -------------------------------------------------------------------------------------


def round_robin(variants: dict, reps: int, rep_seconds: float) -> dict:
    """Seconds per call of each variant: reps repetitions, A B C A B C ..., after warm-up."""
    calls = {}
    for name, fn in variants.items():
        fn()  # warm-up (compiles jitted code)
        n, elapsed = 1, 0.0
        while elapsed < rep_seconds / 4:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            elapsed = time.perf_counter() - t0
            if elapsed < rep_seconds / 4:
                n *= 2
        calls[name] = max(1, int(n * rep_seconds / max(elapsed, 1e-9)))
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            n = calls[name]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n)
    return times


def report(title: str, times: dict, reference: str, unit: float = 1e-6, label: str = "us"):
    print(f"\n{title}")
    ref = np.median(times[reference])
    print(f"  {'variant':<34} {'median':>10} {'min-max':>21}   vs {reference}")
    for name, ts in times.items():
        med = np.median(ts)
        lo, hi = min(ts) / unit, max(ts) / unit
        print(
            f"  {name:<34} {med / unit:>7.1f} {label} {lo:>8.1f}-{hi:<8.1f}{label}"
            f"   {ref / med:5.2f}x"
        )


# -- 1 and 2: host buffers ----------------------------------------------------------------------


def host_buffers(obs_shape, obs_dtype, capacity, batch_size, reps, rep_seconds, seed=0):
    import cpprb

    rng = np.random.default_rng(seed)
    n = capacity
    code = np.arange(n)
    if obs_dtype == np.uint8:
        obs = np.empty((n,) + obs_shape, np.uint8)
        obs[...] = (code % 251).astype(np.uint8).reshape((n,) + (1,) * len(obs_shape))
        obs_next = obs.copy()
        obs_next[:, 0, 0, 0] = ((code + 1) % 251).astype(np.uint8)
    else:
        obs = rng.normal(size=(n,) + obs_shape).astype(obs_dtype)
        obs[:, 0] = code
        obs_next = obs.copy()
        obs_next[:, 0] = code + 1
    fields = dict(
        A=rng.integers(2, size=n),
        logP=np.zeros(n, np.float32),
        Rn=code.astype(np.float32),
        In=np.full(n, 0.9, np.float32),
        W=np.ones(n, np.float32),
    )
    ours = SimpleReplayBuffer(capacity, random_seed=seed)
    for lo in range(0, n, 4096):
        sl = slice(lo, lo + 4096)
        ours.add(
            TransitionBatch(S=obs[sl], S_next=obs_next[sl], **{k: v[sl] for k, v in fields.items()})
        )
    env_dict = {
        "obs": {"shape": obs_shape, "dtype": obs_dtype},
        "act": {"dtype": np.int64},
        "logp": {},
        "rew": {},
        "disc": {},
        "next_obs": {"shape": obs_shape, "dtype": obs_dtype},
        "w": {},
    }
    peer = cpprb.ReplayBuffer(capacity, env_dict=env_dict)
    for lo in range(0, n, 4096):
        sl = slice(lo, lo + 4096)
        peer.add(
            obs=obs[sl],
            act=fields["A"][sl],
            logp=fields["logP"][sl],
            rew=fields["Rn"][sl],
            disc=fields["In"][sl],
            next_obs=obs_next[sl],
            w=fields["W"][sl],
        )

    # correctness: every sampled row is a stored row
    b = ours.sample(batch_size)
    assert np.array_equal(b.Rn, b.idx.astype(np.float32))
    if obs_dtype == np.uint8:
        assert np.array_equal(b.S[:, 1, 1, 1], (b.idx % 251).astype(np.uint8))
        assert np.array_equal(b.S_next[:, 0, 0, 0], ((b.idx + 1) % 251).astype(np.uint8))
    else:
        assert np.array_equal(b.S[:, 0], b.idx) and np.array_equal(b.S_next[:, 0], b.idx + 1)
    p = peer.sample(batch_size)
    code_p = p["rew"][:, 0].astype(np.int64)
    if obs_dtype == np.uint8:
        assert np.array_equal(p["obs"][:, 1, 1, 1], (code_p % 251).astype(np.uint8))
        assert np.array_equal(p["next_obs"][:, 0, 0, 0], ((code_p + 1) % 251).astype(np.uint8))
    else:
        assert np.array_equal(p["obs"][:, 0], code_p) and np.array_equal(
            p["next_obs"][:, 0], code_p + 1
        )

    last = [ours.sample(batch_size)]

    def sample_keep_last():  # a training loop: the previous batch is alive during the draw
        last[0] = ours.sample(batch_size)

    def sample_into_last():  # the caller hands back its previous batch: no new memory
        last[0] = ours.sample(batch_size, out=last[0])

    variants = {
        "SimpleReplayBuffer.sample": lambda: ours.sample(batch_size),
        "SimpleReplayBuffer.sample (kept)": sample_keep_last,
        "SimpleReplayBuffer.sample(out=)": sample_into_last,
        "cpprb ReplayBuffer.sample": lambda: peer.sample(batch_size),
    }
    if "out" not in inspect.signature(ours.sample).parameters:  # releases before 0.2
        del variants["SimpleReplayBuffer.sample(out=)"]
    storage = ours._storage
    if obs_dtype == np.uint8:
        nbytes = sum(a[:batch_size].nbytes for a in storage)
        # memcpy of as many bytes, from memory that is not in cache (a pool of blocks)
        pool = np.ones((16, nbytes), np.uint8)
        out = np.empty(nbytes, np.uint8)
        counter = iter(range(10**12))

        def memcpy():
            np.copyto(out, pool[next(counter) % 16])

        variants["memcpy (same bytes)"] = memcpy
    else:
        # the floor: one np.take per field, from contiguous per-field arrays, into
        # preallocated outputs (no batch object, no allocation)
        storage = [np.ascontiguousarray(a) for a in storage]
        outs = [np.empty((batch_size,) + a.shape[1:], a.dtype) for a in storage]

        def floor():
            slots = ours._rng.integers(0, len(ours), size=batch_size)
            for a, o in zip(storage, outs):
                np.take(a, slots, axis=0, out=o, mode="clip")

        variants["np.take into preallocated (floor)"] = floor
    times = round_robin(variants, reps, rep_seconds)
    return times, (nbytes if obs_dtype == np.uint8 else None)


# -- 3: jitted uniform sampling -------------------------------------------------------------------


def small_items(n, offset=0):
    t = jnp.arange(offset, offset + n, dtype=jnp.int32)
    obs = jnp.tile(t[:, None].astype(jnp.float32), (1, 4))
    return {
        "obs": obs,
        "action": t % 2,
        "reward": t.astype(jnp.float32),
        "discount": jnp.full((n,), 0.9, jnp.float32),
        "next_obs": obs + 1,
    }


def jitted_uniform(capacity, batch_size, reps, rep_seconds):
    import flashbax

    example = jax.tree_util.tree_map(lambda x: x[0], small_items(1))
    nkeys = 1024
    keys = jax.random.split(jax.random.key(0), nkeys)

    ours = make_uniform_buffer(capacity)
    state = ours.init(example)
    add = jax.jit(ours.add, donate_argnums=0)
    for lo in range(0, capacity, 8192):
        state = add(state, small_items(min(8192, capacity - lo), lo))

    fb = flashbax.make_item_buffer(
        max_length=capacity, min_length=1, sample_batch_size=batch_size, add_batches=True
    )
    fb_state = fb.init(example)
    fb_add = jax.jit(fb.add, donate_argnums=0)
    for lo in range(0, capacity, 8192):
        fb_state = fb_add(fb_state, small_items(min(8192, capacity - lo), lo))

    @jax.jit
    def ours_sample(state, keys, step):
        return ours.sample(state, keys[step % nkeys], batch_size), step + 1

    @jax.jit
    def fb_sample(state, keys, step):
        return fb.sample(state, keys[step % nkeys]).experience, step + 1

    # correctness: rows are stored rows; the index law is uniform
    for fn, st in ((ours_sample, state), (fb_sample, fb_state)):
        counts = np.zeros(16)
        step = jnp.zeros([], jnp.int32)
        for _ in range(64):
            out, step = fn(st, keys, step)
            t = np.asarray(out["reward"]).astype(np.int64)
            assert np.array_equal(np.asarray(out["obs"])[:, 0], t)
            assert np.array_equal(np.asarray(out["next_obs"])[:, 0], t + 1)
            counts += np.bincount(t * 16 // capacity, minlength=16)
        expected = counts.sum() / 16
        assert np.all(np.abs(counts - expected) < 6 * np.sqrt(expected)), counts

    carry = {"ours": jnp.zeros([], jnp.int32), "fb": jnp.zeros([], jnp.int32)}

    def run_ours():
        out, carry["ours"] = ours_sample(state, keys, carry["ours"])
        jax.block_until_ready(out)

    def run_fb():
        out, carry["fb"] = fb_sample(fb_state, keys, carry["fb"])
        jax.block_until_ready(out)

    return round_robin(
        {"make_uniform_buffer sample (jit)": run_ours, "flashbax item buffer sample (jit)": run_fb},
        reps,
        rep_seconds,
    )


# -- 4: jitted prioritized step -------------------------------------------------------------------


def jitted_prioritized(capacity, batch_size, reps, rep_seconds, alpha=0.6):
    import flashbax

    example = jax.tree_util.tree_map(lambda x: x[0], small_items(1))
    nkeys = 1024
    keys = jax.random.split(jax.random.key(1), nkeys)

    ours = make_prioritized_buffer(capacity, alpha=alpha, beta=0.4, epsilon=1e-6)
    state = ours.init(example)
    add = jax.jit(ours.add, donate_argnums=0)
    chunk = min(capacity, 65536)
    for lo in range(0, capacity, chunk):
        state = add(state, small_items(chunk, lo))

    fb = flashbax.make_prioritised_item_buffer(
        max_length=capacity,
        min_length=1,
        sample_batch_size=batch_size,
        add_batches=True,
        priority_exponent=alpha,
    )
    fb_state = fb.init(example)
    fb_add = jax.jit(fb.add, donate_argnums=0)
    for lo in range(0, capacity, chunk):
        fb_state = fb_add(fb_state, small_items(chunk, lo))

    def new_priorities(indices, step):
        # changes every step (a rewrite of the same value could be skipped by a peer)
        x = indices.astype(jnp.float32) * 0.6180339 + step.astype(jnp.float32) * 0.1
        return x - jnp.floor(x) + 0.05

    @functools.partial(jax.jit, donate_argnums=0)
    def ours_step(state, keys, step):
        s = ours.sample(state, keys[step % nkeys], batch_size)
        # with the versions of the sample: an update for a slot overwritten since is ignored
        state = ours.update(state, s.indices, new_priorities(s.indices, step), s.versions)
        return state, (s.items, s.weights), step + 1

    @functools.partial(jax.jit, donate_argnums=0)
    def fb_step(state, keys, step):
        s = fb.sample(state, keys[step % nkeys])
        # flashbax takes priorities before the exponent, like ours takes |delta|
        state = fb.set_priorities(state, s.indices, new_priorities(s.indices, step))
        return state, (s.experience, s.probabilities), step + 1

    # correctness: with fixed priorities, sampling frequencies follow p**alpha
    @jax.jit
    def set_pattern_ours(state):
        idx = jnp.arange(capacity, dtype=jnp.int32)
        return ours.update(state, idx, jnp.where(idx % 4 == 0, 8.0, 1.0))

    @jax.jit
    def set_pattern_fb(state):
        idx = jnp.arange(capacity, dtype=jnp.int32)
        return fb.set_priorities(state, idx, jnp.where(idx % 4 == 0, 8.0, 1.0))

    expected = 8.0**alpha / (8.0**alpha + 3.0)  # share of slots with idx % 4 == 0

    def share(sample_fn, st, get_t):
        hits = total = 0
        for k in range(32):
            t = np.asarray(get_t(sample_fn(st, keys[k])))
            hits += np.sum(t % 4 == 0)
            total += t.size
        return hits / total

    ours_sample = jax.jit(lambda st, k: ours.sample(st, k, batch_size))
    fb_sample = jax.jit(fb.sample)
    s_ours = share(ours_sample, set_pattern_ours(state), lambda s: s.items["reward"])
    s_fb = share(fb_sample, set_pattern_fb(fb_state), lambda s: s.experience["reward"])
    n = 32 * batch_size
    tol = 6 * np.sqrt(expected * (1 - expected) / n)
    assert abs(s_ours - expected) < tol, (s_ours, expected)
    assert abs(s_fb - expected) < tol, (s_fb, expected)
    # ours: weights are (N P)^-beta normalised to max 1
    s = ours_sample(state, keys[0])
    assert abs(float(jnp.max(s.weights)) - 1.0) < 1e-6

    carry = {"ours": (state, jnp.zeros([], jnp.int32)), "fb": (fb_state, jnp.zeros([], jnp.int32))}

    def run_ours():
        st, step = carry["ours"]
        st, out, step = ours_step(st, keys, step)
        jax.block_until_ready((st, out))
        carry["ours"] = (st, step)

    def run_fb():
        st, step = carry["fb"]
        st, out, step = fb_step(st, keys, step)
        jax.block_until_ready((st, out))
        carry["fb"] = (st, step)

    return round_robin(
        {"make_prioritized_buffer step (jit)": run_ours, "flashbax prioritised step (jit)": run_fb},
        reps,
        rep_seconds,
    )


def section1(small_cap, reps, rep_s):
    times, _ = host_buffers((4,), np.float32, small_cap, 256, reps, rep_s)
    report(
        f"1. host uniform sample, B=256, obs (4,) float32, N={small_cap}",
        times,
        "cpprb ReplayBuffer.sample",
    )


def section2(frame_cap, reps, rep_s):
    times, nbytes = host_buffers((84, 84, 4), np.uint8, frame_cap, 256, reps, rep_s)
    report(
        f"2. host uniform sample, B=256, S and S_next (84,84,4) uint8, N={frame_cap}",
        times,
        "memcpy (same bytes)",
        unit=1e-3,
        label="ms",
    )
    memcpy = np.median(times["memcpy (same bytes)"])
    for name in times:
        if name.startswith("memcpy"):
            continue
        gbps = nbytes / np.median(times[name]) / 1e9
        print(f"  {name:<34} {gbps:6.1f} GB/s = {memcpy / np.median(times[name]):.2f} of memcpy")
    print(f"  {'memcpy':<34} {nbytes / memcpy / 1e9:6.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds smoke run")
    parser.add_argument("--only", default="", help="sections to run, e.g. 3,4 (default: all)")
    args = parser.parse_args()
    reps, rep_s = (3, 0.02) if args.quick else (11, 0.15)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, reps={reps}")

    only = {int(x) for x in args.only.split(",")} if args.only else {1, 2, 3, 4}
    small_cap = 20_000 if args.quick else 100_000
    if 1 in only:
        section1(small_cap, reps, rep_s)
    if 2 in only:
        section2(1024 if args.quick else 8192, reps, rep_s)
    if 3 in only:
        times = jitted_uniform(small_cap, 256, reps, rep_s)
        report(
            f"3. jitted uniform sample, B=256, N={small_cap}",
            times,
            "flashbax item buffer sample (jit)",
        )
    if 4 in only:
        configs = [(2**14, 32)] if args.quick else [(2**20, 32), (2**20, 256), (2**17, 1024)]
        for capacity, batch_size in configs:
            times = jitted_prioritized(capacity, batch_size, reps, rep_s)
            report(
                f"4. jitted prioritized sample+update, N={capacity}, B={batch_size} (donated)",
                times,
                "flashbax prioritised step (jit)",
            )


if __name__ == "__main__":
    main()
