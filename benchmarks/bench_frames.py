"""Frame-stacked replay (84x84 uint8 frames, stacks of k = 4) against cpprb, in one run.

1. memory: RSS of a buffer of 100k transitions, measured in a fresh subprocess (VmRSS before
   and after filling it), extrapolated to 1M transitions;
2. sampling 32 transitions (S and S_next): FrameStackReplayBuffer vs a plain memcpy of the
   output bytes (from memory that is not in the caches) vs cpprb's ReplayBuffer with
   ``next_of`` and ``stack_compress`` (same capacity, same stream);
3. adding one step: FrameStackReplayBuffer.add vs cpprb's add (both full, overwriting);
4. jitted sampling from make_frame_stack_buffer vs ``jnp.take`` of the same stacks from a
   dense ``(N, k, 84, 84)`` array, and vs make_uniform_buffer holding the same transitions
   with dense stacks (a sample that also returns the other fields);
5. jitted prioritized sampling and update from make_prioritized_frame_stack_buffer vs
   make_prioritized_buffer holding the same transitions with dense stacks.

Every variant is checked for correctness before it is timed.

Usage: ``python benchmarks/bench_frames.py [--quick] [--only 1,4,5]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402
from bench_replay import report, round_robin  # noqa: E402

from coax_utils.replay import (  # noqa: E402
    FrameStackReplayBuffer,
    PrioritizedFrameStackReplayBuffer,
    TransitionBatch,
)

K, SHAPE = 4, (84, 84)
FRAME_BYTES = int(np.prod(SHAPE))


def frame_stream(n: int, episode: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` distinct random frames and, per step, whether it starts an episode."""
    frames = np.random.default_rng(seed).integers(0, 256, (n,) + SHAPE, dtype=np.uint8)
    return frames, np.arange(n) % episode == 0


def stacks(frames: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """For every step t the frame indices of FrameStackObservation's stack (k, reset padding)."""
    first = np.maximum.accumulate(np.where(starts, np.arange(len(starts)), 0))
    t = np.arange(len(starts))[:, None] - np.arange(K - 1, -1, -1)[None, :]
    return np.maximum(t, first[:, None])


def batch_of(frames, idx, rows) -> TransitionBatch:
    """1-step transitions (t -> t+1) for the rows ``rows`` of the stack indices ``idx``."""
    n = len(rows)
    return TransitionBatch(
        S=frames[idx[rows]],
        A=np.zeros(n, np.int32),
        logP=np.zeros(n, np.float32),
        Rn=np.ones(n, np.float32),
        In=np.full(n, 0.99, np.float32),
        S_next=frames[idx[rows + 1]],
    )


# -- 1: memory ----------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def memory_child(n: int) -> None:
    """Fill a buffer of ``n`` transitions; print RSS before and after as JSON."""
    episode = 1000
    frames, starts = frame_stream(n + episode, episode)
    idx = stacks(frames, starts)
    ends = np.flatnonzero(np.r_[starts[1:], True])  # no transition across an episode end
    before = _rss() - frames.nbytes
    buffer = FrameStackReplayBuffer(capacity=n, stack_size=K)
    rows = np.setdiff1d(np.arange(len(frames) - 1), ends)[:n]
    for lo in range(0, n, 500):
        buffer.add(batch_of(frames, idx, rows[lo : lo + 500]))
    after = _rss() - frames.nbytes
    sample = buffer.sample(8)
    assert np.array_equal(sample.S, frames[idx[rows[sample.idx]]])
    print(json.dumps(dict(before=before, after=after, len=len(buffer), frames=buffer.frame_count)))


def memory(n: int) -> dict:
    # a fixed mmap threshold: glibc returns freed temporaries (batches being added) to the
    # OS instead of keeping them in the heap, so RSS measures the buffer
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "262144"}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    per = (r["after"] - r["before"]) / n
    print(f"\n1. memory of FrameStackReplayBuffer, {n} transitions, k={K}, 84x84 uint8")
    print(f"  process RSS before {r['before'] / 2**30:.2f} GiB, after {r['after'] / 2**30:.2f} GiB")
    print(f"  frames stored {r['frames']} for {r['len']} transitions")
    print(f"  buffer bytes per transition {per:.0f} (one frame is {FRAME_BYTES})")
    total = r["before"] + per * 1_000_000
    print(
        f"  extrapolated to 1M transitions: {per * 1e6 / 1e9:.2f} GB buffer, process "
        f"{total / 1e9:.2f} GB (target <= 7.5 GB; frames alone {FRAME_BYTES * 1e6 / 1e9:.2f} GB)"
    )
    # stacked storage keeps S and S_next whole: 2 k frames per transition
    return dict(
        transitions=n,
        bytes_per_transition=per,
        stacked_bytes=2 * K * FRAME_BYTES,
        frame_bytes=FRAME_BYTES,
        frames_stored=r["frames"],
    )


# -- 2 and 3: sampling and adding against cpprb ---------------------------------------------


def host(capacity: int, reps: int, rep_seconds: float) -> None:
    import cpprb

    episode = 1000
    n = capacity + 20_000
    frames, starts = frame_stream(n, episode, seed=1)
    idx = stacks(frames, starts)
    ends = np.r_[starts[1:], True]
    ours = FrameStackReplayBuffer(capacity=capacity, stack_size=K, random_seed=0)
    peer = cpprb.ReplayBuffer(
        capacity,
        env_dict={
            "obs": {"shape": SHAPE + (K,), "dtype": np.uint8},
            "act": {"dtype": np.int32},
            "rew": {},
            "done": {},
        },
        next_of="obs",
        stack_compress="obs",
    )
    frames_last = np.ascontiguousarray(frames.transpose(1, 2, 0))  # cpprb stacks on the last axis

    def peer_add(t):
        peer.add(
            obs=frames_last[..., idx[t]],
            act=0,
            rew=1.0,
            next_obs=frames_last[..., idx[t + 1]],
            done=0.0,
        )
        if ends[t]:
            peer.on_episode_end()

    prio = PrioritizedFrameStackReplayBuffer(capacity, stack_size=K, alpha=0.6, random_seed=0)
    fill = [t for t in range(capacity + 1000) if not ends[t]][:capacity]
    for lo in range(0, capacity, 1000):
        ours.add(batch_of(frames, idx, np.array(fill[lo : lo + 1000])))
        prio.add(batch_of(frames, idx, np.array(fill[lo : lo + 1000])))
    for t in fill:
        peer_add(t)
    # correctness: both return the stacks of the stream
    b = ours.sample(64)
    assert np.array_equal(b.S, frames[idx[np.array(fill)[b.idx]]])
    assert np.array_equal(b.S_next, frames[idx[np.array(fill)[b.idx] + 1]])
    p = peer.sample(64)
    assert p["obs"].shape == (64,) + SHAPE + (K,) and np.any(p["obs"] != p["next_obs"])

    batch = 32
    out_bytes = 2 * batch * K * FRAME_BYTES
    # memcpy of as many bytes from memory that is not in the caches, as the frames of a large
    # buffer are not: one block per call from a pool of 1 GiB (larger than any L3 cache here,
    # up to 260 MiB)
    pool = np.random.default_rng(0).integers(
        0, 256, (-(-(1 << 30) // out_bytes), out_bytes), dtype=np.uint8
    )
    dst = np.empty(out_bytes, np.uint8)
    blocks = itertools.cycle(range(len(pool)))
    times = round_robin(
        {
            "FrameStackReplayBuffer.sample": lambda: ours.sample(batch),
            "cpprb sample (next_of+stack_compress)": lambda: peer.sample(batch),
            "memcpy of the output bytes": lambda: np.copyto(dst, pool[next(blocks)]),
        },
        reps,
        rep_seconds,
    )
    print(f"\n2. sample {batch} transitions (S and S_next, k={K}), capacity {capacity}")
    report("  time per call", times, "FrameStackReplayBuffer.sample")
    ours_t = np.median(times["FrameStackReplayBuffer.sample"])
    print(
        f"  ours vs memcpy: {np.median(times['memcpy of the output bytes']) / ours_t:.2f} "
        f"(target >= 0.8); ours vs cpprb: "
        f"{np.median(times['cpprb sample (next_of+stack_compress)']) / ours_t:.2f}x (target >= 1)"
    )

    # 3: adding one step each, continuing the stream (both buffers are full: overwrite)
    stream = [t for t in range(capacity + 1000, n - 1) if not ends[t]]
    pos = {"ours": 0, "peer": 0, "prio": 0}

    def ours_add():
        t = stream[pos["ours"] % len(stream)]
        pos["ours"] += 1
        ours.add(batch_of(frames, idx, np.array([t])))

    def prio_add():  # with the largest priority; finds the transitions that lost frames
        t = stream[pos["prio"] % len(stream)]
        pos["prio"] += 1
        prio.add(batch_of(frames, idx, np.array([t])))

    def peer_add_next():
        t = stream[pos["peer"] % len(stream)]
        pos["peer"] += 1
        peer_add(t)

    times = round_robin(
        {
            "FrameStackReplayBuffer.add": ours_add,
            "PrioritizedFrameStackReplayBuffer.add": prio_add,
            "cpprb add": peer_add_next,
        },
        reps,
        rep_seconds,
    )
    print("\n3. add one step (full buffers)")
    report("  time per call", times, "FrameStackReplayBuffer.add")
    per_step = (ours.frame_count - len(fill) - episode // 1000) / max(pos["ours"], 1)
    print(f"  frames stored per added step after the fill: {per_step:.3f}")
    live = sum(1 for _ in prio)  # every held transition keeps its frames (episodes of 1000)
    print(f"  prioritized: {live} of {len(prio)} held transitions can be sampled")


# -- 4: jitted sampling ---------------------------------------------------------------------------


def jitted(capacity: int, reps: int, rep_seconds: float) -> None:
    import jax
    import jax.numpy as jnp

    from coax_utils.replay import make_frame_stack_buffer, make_uniform_buffer

    episode = 1000
    frames, starts = frame_stream(capacity + 1, episode, seed=2)
    idx = stacks(frames, starts)
    rows = np.array([t for t in range(capacity) if not starts[t + 1]])
    buf = make_frame_stack_buffer(capacity, stack_size=K)

    def numbered(lo, hi):  # Rn = position in rows, to check what was sampled
        return batch_of(frames, idx, rows[lo:hi]).replace(Rn=np.arange(lo, hi, dtype=np.float32))

    state = buf.init(jax.tree_util.tree_map(lambda x: x[0], numbered(0, 1)))
    add = jax.jit(buf.add, donate_argnums=0)
    for lo in range(0, len(rows) - 1000 + 1, 1000):
        state = add(state, numbered(lo, lo + 1000))
    rows = rows[: len(rows) // 1000 * 1000]
    dense = jnp.asarray(frames[idx[rows]])  # (N, k, 84, 84): S of every transition
    dense_next = jnp.asarray(frames[idx[rows + 1]])  # and S_next
    sample = jax.jit(buf.sample, static_argnums=2)
    # the same transitions, stacks stored whole, in a plain jittable buffer
    plain = make_uniform_buffer(len(rows))
    plain_state = plain.init(jax.tree_util.tree_map(lambda x: x[0], numbered(0, 1)))
    plain_add = jax.jit(plain.add, donate_argnums=0)
    for lo in range(0, len(rows), 1000):
        plain_state = plain_add(plain_state, numbered(lo, lo + 1000))
    plain_sample = jax.jit(plain.sample, static_argnums=2)

    @jax.jit
    def take(d, d_next, key):
        i = jax.random.randint(key, (32,), 0, len(d))
        return jnp.take(d, i, axis=0), jnp.take(d_next, i, axis=0)

    key = jax.random.PRNGKey(0)
    s = sample(state, key, 32)
    t = rows[np.asarray(s.Rn).astype(np.int64)]  # Rn holds each transition's row
    assert np.array_equal(np.asarray(s.S), frames[idx[t]])
    assert np.array_equal(np.asarray(s.S_next), frames[idx[t + 1]])
    p = plain_sample(plain_state, key, 32)
    t = rows[np.asarray(p.Rn).astype(np.int64)]
    assert np.array_equal(np.asarray(p.S), frames[idx[t]])
    keys = iter(jax.random.split(key, 10**6))
    times = round_robin(
        {
            "make_frame_stack_buffer sample": lambda: jax.block_until_ready(
                sample(state, next(keys), 32)
            ),
            "jnp.take from dense (N,k,84,84) x2": lambda: jax.block_until_ready(
                take(dense, dense_next, next(keys))
            ),
            "make_uniform_buffer, dense stacks": lambda: jax.block_until_ready(
                plain_sample(plain_state, next(keys), 32)
            ),
        },
        reps,
        rep_seconds,
    )
    print(f"\n4. jitted sample of 32 stacks (k={K}), capacity {capacity}")
    report("  time per call", times, "make_frame_stack_buffer sample")

    # the same sampling inside one jitted function, as a jitted training loop samples: 16
    # batches drawn in a lax.scan per call, each replacing the one before in the loop's
    # carry (a training step uses its batch before it draws the next), so neither the cost
    # of a call to the runtime (which dominates the figures above on a CPU) nor fresh
    # output memory is timed: only the sampling itself
    steps = 16

    def many(buffer):
        """``steps`` samples of 32 from ``buffer`` in a scan: the batch of the last key."""

        @jax.jit
        def call(state, key):
            first = jax.eval_shape(lambda s, k: buffer.sample(s, k, 32), state, key)
            carry = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), first)

            def draw(_, k):
                return buffer.sample(state, k, 32), None

            return jax.lax.scan(draw, carry, jax.random.split(key, steps))[0]

        return call

    many_samples, many_plain = many(buf), many(plain)

    @jax.jit
    def many_takes(d, d_next, key):
        carry = (jnp.zeros((32,) + d.shape[1:], d.dtype),) * 2

        def draw(_, k):
            i = jax.random.randint(k, (32,), 0, len(d))
            return (jnp.take(d, i, axis=0), jnp.take(d_next, i, axis=0)), None

        return jax.lax.scan(draw, carry, jax.random.split(key, steps))[0]

    last_key = jax.random.split(key, steps)[-1]
    for last, s in [  # the batch of the last key
        (many_samples(state, key), sample(state, last_key, 32)),
        (many_plain(plain_state, key), plain_sample(plain_state, last_key, 32)),
    ]:
        assert all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree_util.tree_leaves(last), jax.tree_util.tree_leaves(s))
        )
    times = round_robin(
        {
            "make_frame_stack_buffer sample": lambda: jax.block_until_ready(
                many_samples(state, next(keys))
            ),
            "jnp.take from dense (N,k,84,84) x2": lambda: jax.block_until_ready(
                many_takes(dense, dense_next, next(keys))
            ),
            "make_uniform_buffer, dense stacks": lambda: jax.block_until_ready(
                many_plain(plain_state, next(keys))
            ),
        },
        reps,
        rep_seconds,
    )
    for name in times:
        times[name] = [t / steps for t in times[name]]
    report(
        f"  time per sample, {steps} samples in a lax.scan in one jitted call",
        times,
        "make_frame_stack_buffer sample",
    )


# -- 5: jitted prioritized sampling and update -----------------------------------------------


def jitted_prioritized(capacity: int, reps: int, rep_seconds: float) -> None:
    import jax

    from coax_utils.replay import make_prioritized_buffer, make_prioritized_frame_stack_buffer

    episode = 1000
    frames, starts = frame_stream(capacity + 1, episode, seed=3)
    idx = stacks(frames, starts)
    rows = np.array([t for t in range(capacity) if not starts[t + 1]])
    rows = rows[: len(rows) // 1000 * 1000]
    ours = make_prioritized_frame_stack_buffer(capacity, stack_size=K, alpha=0.6, beta=0.4)
    dense = make_prioritized_buffer(capacity, alpha=0.6, beta=0.4)

    def numbered(lo, hi):  # Rn = position in rows, to check what was sampled
        return batch_of(frames, idx, rows[lo:hi]).replace(Rn=np.arange(lo, hi, dtype=np.float32))

    first = jax.tree_util.tree_map(lambda x: x[0], numbered(0, 1))
    states = {"ours": ours.init(first), "dense": dense.init(first)}
    adds = {"ours": jax.jit(ours.add, donate_argnums=0), "dense": jax.jit(dense.add)}
    for lo in range(0, len(rows), 1000):
        batch = numbered(lo, lo + 1000)
        states = {name: adds[name](states[name], batch) for name in states}
    del adds

    def stepper(buffer):
        def step(state, key):  # sample 32, then give them new priorities (as a learner does)
            drawn = buffer.sample(state, key, 32)
            td = jax.random.normal(jax.random.fold_in(key, 1), (32,))
            return buffer.update(state, drawn.indices, td), drawn

        return jax.jit(step, donate_argnums=0)

    steps = {"ours": stepper(ours), "dense": stepper(dense)}
    key = jax.random.PRNGKey(0)
    for name in states:  # correctness: same stacks as the stream, same slots and weights
        states[name], drawn = steps[name](states[name], key)
        t = rows[np.asarray(drawn.items.Rn).astype(np.int64)]
        assert np.array_equal(np.asarray(drawn.items.S), frames[idx[t]])
        assert np.array_equal(np.asarray(drawn.items.S_next), frames[idx[t + 1]])
    keys = iter(jax.random.split(key, 10**6))

    def run(name):
        def call():
            states[name], drawn = steps[name](states[name], next(keys))
            jax.block_until_ready(drawn)

        return call

    times = round_robin(
        {
            "make_prioritized_frame_stack_buffer": run("ours"),
            "make_prioritized_buffer, dense stacks": run("dense"),
        },
        reps,
        rep_seconds,
    )
    dense_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(states["dense"]))
    ours_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(states["ours"]))
    print(f"\n5. jitted prioritized sample of 32 stacks (k={K}) + update, capacity {capacity}")
    print(f"  state bytes: ours {ours_bytes / 2**20:.0f} MiB, dense {dense_bytes / 2**20:.0f} MiB")
    report("  time per call", times, "make_prioritized_frame_stack_buffer")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="sections to run, e.g. 4,5 (default: all)")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    _results.add_argument(parser)
    args = parser.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child)
        return
    reps, rep_seconds = (3, 0.05) if args.quick else (7, 0.2)
    only = {int(x) for x in args.only.split(",")} if args.only else {1, 2, 3, 4, 5}
    if 1 in only:  # at a few sizes: the cost per transition does not grow with the buffer
        sizes = (2_000, 5_000) if args.quick else (10_000, 30_000, 100_000)
        _results.write(args.results, "frames_memory", [memory(n) for n in sizes])
    if only & {2, 3}:
        host(10_000 if args.quick else 100_000, reps, rep_seconds)
    if 4 in only:
        jitted(5_000 if args.quick else 20_000, reps, rep_seconds)
    if 5 in only:
        jitted_prioritized(5_000 if args.quick else 20_000, reps, rep_seconds)


if __name__ == "__main__":
    main()
