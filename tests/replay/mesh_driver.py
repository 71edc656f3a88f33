"""Checks of the mesh-sharded buffers on ``N`` forced CPU devices, run in its own process.

``python tests/replay/mesh_driver.py N FOLDER`` forces ``N`` host devices (the flag must be
set before jax starts, hence a process per device count), runs every check and prints
``mesh checks passed on N devices``; a failed check raises. ``FOLDER`` takes the checkpoints.
Every add, sample and update runs under ``jax.transfer_guard("disallow")``. The uniform and
prioritized buffers come first, then the sequence buffers (``check_sequences``) and the
frame-stack buffers (``check_frames``).
"""

from __future__ import annotations

import dataclasses
import os
import sys

N_DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"  # the forced devices are host devices, also on a GPU machine

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from scipy import stats  # noqa: E402

from coax_utils import utils  # noqa: E402
from coax_utils.replay import (  # noqa: E402
    TransitionBatch,
    make_frame_stack_buffer,
    make_prioritized_buffer,
    make_prioritized_frame_stack_buffer,
    make_prioritized_sequence_buffer,
    make_sequence_buffer,
    make_uniform_buffer,
)
from coax_utils.replay._mesh import shard_buffer  # noqa: E402

CAPACITY = 64  # divisible by 1, 2 and 8
ALPHA, BETA, EPS = 0.7, 0.6, 1e-4
DRAWS = 48  # batches drawn for each distribution check
BATCH = 64  # rows per sample (divisible by 1, 2 and 8)
P_MIN = 1e-4  # chi-square p-values below this fail (seeds are fixed: no flakiness)


COMPILES = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: (
        COMPILES.__setitem__(0, COMPILES[0] + 1)
        if event == "/jax/core/compile/backend_compile_duration"
        else None
    )
)


def chi_square(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"{what}: draws of zero-probability items"
    p = stats.chisquare(counts[keep], expected[keep]).pvalue
    assert p > P_MIN, f"{what}: chi-square p-value {p}"


def two_sample(a: np.ndarray, b: np.ndarray, what: str) -> None:
    keep = (a + b) > 0
    p = stats.chi2_contingency(np.stack([a[keep], b[keep]])).pvalue
    assert p > P_MIN, f"{what}: two-sample chi-square p-value {p}"


def host(x):
    return np.asarray(jax.device_get(x))


def synced(buffer):
    """``buffer`` with calls that wait for their results: XLA's CPU runtime can deadlock when
    several programs with collectives over forced host devices are in flight on few cores
    (a plain ``all_gather`` does it too), so no call is dispatched before the last ended."""

    def wait(fn):
        return lambda *args, **kwargs: jax.block_until_ready(fn(*args, **kwargs))

    return dataclasses.replace(
        buffer,
        add=wait(buffer.add),
        sample=wait(buffer.sample),
        update=buffer.update and wait(buffer.update),
    )


def refused(fn, match):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), e
    else:
        raise AssertionError(f"no ValueError ({match})")


def same(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(host(x), host(y))


def restored(buffer, state, path):
    """``state`` dumped, loaded (safe) and put back onto the mesh."""
    utils.dump(state, path)
    back = buffer.put(utils.load(path, safe=True))
    for x in jax.tree_util.tree_leaves(back):
        assert x.sharding.is_equivalent_to(buffer.state_sharding, x.ndim)
    return back


def fill(buffer, state, ids: np.ndarray, put):
    items = {"id": put(ids.astype(np.int32)), "x": put(np.stack([ids, -ids], 1).astype(np.float32))}
    with jax.transfer_guard("disallow"):
        return buffer.add(state, items)


def main(folder: str) -> None:
    n = N_DEVICES
    assert len(jax.devices()) == n
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = CAPACITY // n
    example = {"id": jnp.int32(0), "x": jnp.zeros(2, jnp.float32)}
    big = make_prioritized_buffer(CAPACITY, alpha=ALPHA, beta=BETA, epsilon=EPS)
    raw = shard_buffer(big, mesh, "data")
    mb = synced(raw)
    put = lambda x: jax.device_put(x, mb.batch_sharding)  # noqa: E731
    keys = [
        jax.device_put(k, mb.replicated) for k in jax.random.split(jax.random.key(0), DRAWS + 8)
    ]

    # -- fill both: 48 items (each device writes 48 / n), priorities set by id ----------------
    ids = np.arange(48)
    state = mb.init(example)
    state = fill(mb, state, ids, put)
    one = big.add(big.init(example), {"id": jnp.asarray(ids, jnp.int32), "x": jnp.zeros((48, 2))})
    # where each id lives in the sharded buffer: device d wrote ids [d*48/n, (d+1)*48/n)
    stored = host(state.items["id"]).reshape(-1)
    filled = (host(state.size)[:, None] > np.arange(rows)).reshape(-1)
    slot_of = {int(i): k for k, i in enumerate(stored) if filled[k]}
    assert sorted(slot_of) == ids.tolist()
    delta = np.where(ids < 48 // max(n, 2), 8.0, 0.5) * (1 + ids % 3)  # unequal shard totals
    gidx = np.array([slot_of[i] for i in ids])
    with jax.transfer_guard("disallow"):
        state = mb.update(state, put(gidx.astype(np.int32)), put(delta.astype(np.float32)))
    one = big.update(one, jnp.asarray(ids), jnp.asarray(delta, jnp.float32))
    p = (np.abs(delta) + EPS) ** ALPHA

    # updates reached the owning shards: leaf values and the shared maximum
    n_leaves = state.tree.nodes.shape[1] // 2
    leaves = host(state.tree.nodes)[:, n_leaves : n_leaves + rows].reshape(-1)
    np.testing.assert_allclose(leaves[gidx], p, rtol=1e-6)
    assert np.all(leaves[~filled] == 0)
    np.testing.assert_allclose(host(state.max_priority), np.full(n, p.max()), rtol=1e-6)

    # -- prioritized distribution and weights ---------------------------------------------
    counts, counts_one = np.zeros(48), np.zeros(48)
    with jax.transfer_guard("disallow"):
        for k in range(DRAWS):
            if k == 1:
                compiled = COMPILES[0]
            s = mb.sample(state, keys[k], BATCH)
            got_ids = host(s.items["id"])
            np.testing.assert_array_equal(stored[host(s.indices)], got_ids)
            np.testing.assert_array_equal(host(s.items["x"])[:, 1], -got_ids)
            counts += np.bincount(got_ids, minlength=48)
            # weights: (N P(i))^-beta / max_j (N P(j))^-beta with the global N and P
            w = (48 * p[got_ids] / p.sum()) ** -BETA
            np.testing.assert_allclose(host(s.weights), w / w.max(), rtol=1e-5)
            assert s.indices.sharding.is_equivalent_to(mb.batch_sharding, 1)
    assert COMPILES[0] == compiled, "a second sample call compiled again"
    for k in range(DRAWS):
        counts_one += np.bincount(np.asarray(big.sample(one, keys[k], BATCH).indices), minlength=48)
    chi_square(counts, p, "sharded prioritized sample")
    chi_square(counts_one, p, "one-buffer prioritized sample")
    two_sample(counts, counts_one, "sharded vs one buffer")

    # a traced beta and donation
    with jax.transfer_guard("disallow"):
        beta = jax.device_put(np.float32(0.3), mb.replicated)
        s = mb.sample(state, keys[DRAWS], BATCH, beta)
    w = (p[host(s.items["id"])]) ** -0.3
    np.testing.assert_allclose(host(s.weights), w / w.max(), rtol=1e-5)

    # -- stale updates are ignored; fresh ones reach the owner --------------------------------
    with jax.transfer_guard("disallow"):
        s = mb.sample(state, keys[DRAWS + 1], BATCH)
        later = fill(mb, state, np.arange(48, 48 + rows * n), put)  # rewrites every slot
        stale = mb.update(later, s.indices, s.weights - s.weights, s.versions)
    np.testing.assert_array_equal(host(stale.tree.nodes), host(later.tree.nodes))

    # -- prioritized per shard: each device by its own shard's priorities ------------------
    owner_of = gidx // rows  # the shard of each id
    sizes = np.bincount(owner_of, minlength=n)
    totals = np.bincount(owner_of, weights=p, minlength=n)
    counts = np.zeros(48)
    with jax.transfer_guard("disallow"):
        for k in range(DRAWS):
            if k == 1:
                compiled = COMPILES[0]
            s = mb.sample(state, keys[k], BATCH, scope="shard")
            got_ids, idx = host(s.items["id"]), host(s.indices)
            np.testing.assert_array_equal(stored[idx], got_ids)
            assert np.all(idx // rows == np.repeat(np.arange(n), BATCH // n)), "drew elsewhere"
            counts += np.bincount(got_ids, minlength=48)
            # weights: (N_s P_s(i))^-beta / max (N_s P_s(j))^-beta over the device's rows,
            # with the shard's size N_s and probabilities P_s(i) = p_i / T_s
            mine = owner_of[got_ids]
            w = (sizes[mine] * p[got_ids] / totals[mine]) ** -BETA
            w = np.stack([x / x.max() for x in w.reshape(n, -1)]).reshape(-1)
            np.testing.assert_allclose(host(s.weights), w, rtol=1e-5)
    assert COMPILES[0] == compiled, "a second per-shard sample call compiled again"
    for d in range(n):
        mine = owner_of == d
        chi_square(counts[mine], p[mine], f"prioritized sample of shard {d}")
    # nothing crosses devices in the per-shard sample and update; the exact sample gathers
    texts = {
        scope: jax.jit(lambda st, k, scope=scope: raw.sample(st, k, BATCH, scope=scope))
        .lower(state, keys[0])
        .compile()
        .as_text()
        for scope in ("shard", "mesh")
    }
    ops = ("all-gather", "all-reduce", "collective-permute", "all-to-all")
    assert not any(op in texts["shard"] for op in ops), "a collective in the per-shard sample"
    assert n == 1 or "all-gather" in texts["mesh"]
    text = (
        jax.jit(lambda st, i, q: raw.update(st, i, q, scope="shard"))
        .lower(state, s.indices, s.weights)
        .compile()
        .as_text()
    )
    assert not any(op in text for op in ops), "a collective in the per-shard update"
    # a per-shard update keeps each device's entries of its own slots, ignores the others
    own = host(s.indices)
    moved = np.roll(own, BATCH // n)  # device d now holds the indices of device d - 1
    with jax.transfer_guard("disallow"):
        new = mb.update(state, s.indices, put(np.full(BATCH, 3.0, np.float32)), scope="shard")
        same = mb.update(state, put(moved), put(np.full(BATCH, 3.0, np.float32)), scope="shard")
    leaves_new = host(new.tree.nodes)[:, n_leaves : n_leaves + rows].reshape(-1)
    expected = leaves.copy()
    expected[own] = (3.0 + EPS) ** ALPHA
    np.testing.assert_allclose(leaves_new, expected, rtol=1e-6)
    if n > 1:
        np.testing.assert_array_equal(host(same.tree.nodes), host(state.tree.nodes))

    # -- uniform: per shard and over the whole mesh ---------------------------------------
    ub = synced(shard_buffer(make_uniform_buffer(CAPACITY), mesh, "data"))
    ustate = fill(ub, ub.init(example), ids, put)
    ustored = host(ustate.items["id"]).reshape(n, rows)
    counts_mesh, counts_shard = np.zeros(48), np.zeros(48)
    with jax.transfer_guard("disallow"):
        for k in range(DRAWS):
            got = host(ub.sample(ustate, keys[k], BATCH, "mesh")["id"])
            counts_mesh += np.bincount(got, minlength=48)
            got = host(ub.sample(ustate, keys[k], BATCH, "shard")["id"]).reshape(n, BATCH // n)
            for d in range(n):  # each device drew from its own shard
                assert set(got[d]) <= set(ustored[d, : 48 // n].tolist())
            counts_shard += np.bincount(got.reshape(-1), minlength=48)
    chi_square(counts_mesh, np.ones(48), "uniform sample over the mesh")
    chi_square(counts_shard, np.ones(48), "uniform sample per shard")
    assert bool(ub.can_sample(ustate, 48)) and not bool(ub.can_sample(ustate, 49))

    # -- donation, and the per-device halves inside a caller's shard_map ------------------
    from coax_utils.replay._mesh import shard_map

    spec = mb.state_sharding.spec

    def step(block, items, key):
        block = mb.shard_add(block, items)
        s = mb.shard_sample(block, key, 4)
        return mb.shard_update(block, s.indices, s.weights, s.versions), s.items["id"]

    step = jax.jit(
        shard_map(step, mesh, (spec, spec, mb.replicated.spec), (spec, spec)), donate_argnums=0
    )
    donated = mb.put(jax.device_get(state))
    items = {"id": put(np.arange(n, dtype=np.int32)), "x": put(np.zeros((n, 2), np.float32))}
    with jax.transfer_guard("disallow"):
        donated, got = jax.block_until_ready(step(donated, items, keys[0]))
    assert host(donated.size).tolist() == (host(state.size) + 1).tolist() and got.shape == (4 * n,)

    # -- checkpoints: dump/load and the manager continue the same stream ------------------
    path = os.path.join(folder, f"mesh{n}.ckpt")
    utils.dump(state, path)
    restored = mb.put(utils.load(path, safe=True))
    assert restored.items["id"].sharding.is_equivalent_to(state.items["id"].sharding, 2)
    with utils.CheckpointManager(os.path.join(folder, f"manager{n}")) as manager:
        manager.save(1, {"buffer": state})
        manager.wait()
        managed = mb.put(manager.restore()["buffer"])
    more = np.arange(100, 100 + 8 * n)
    for other in (restored, managed):
        a = fill(mb, state, more, put)
        b = fill(mb, other, more, put)
        with jax.transfer_guard("disallow"):
            sa, sb = mb.sample(a, keys[3], BATCH), mb.sample(b, keys[3], BATCH)
        for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
            np.testing.assert_array_equal(host(x), host(y))

    # a mesh of another size is refused
    other = jax.tree_util.tree_map(lambda x: np.concatenate([x, x]), jax.device_get(state))
    try:
        mb.put(other)
    except ValueError as e:
        assert "mesh axis 'data' has" in str(e), e
    else:
        raise AssertionError("a state of another mesh size was accepted")

    # -- bad input raises before anything is written --------------------------------------
    refused(lambda: shard_buffer(big, mesh, "model"), "not an axis")
    refused(
        lambda: mb.sample(state, keys[0], 8 * n + 1) if n > 1 else mb.sample(state, keys[0], 0),
        "batch_size",
    )
    before = jax.device_get(state)
    if n > 1:
        refused(lambda: shard_buffer(make_uniform_buffer(CAPACITY + 1), mesh, "data"), "divisible")
        bad = {"id": jnp.zeros(n + 1, jnp.int32), "x": jnp.zeros((n + 1, 2))}
        refused(lambda: mb.add(state, bad), "divisible")
        refused(lambda: mb.update(state, np.arange(n + 1), np.ones(n + 1)), "divisible")
    bad = {"id": jnp.zeros(n, jnp.float32), "x": jnp.zeros((n, 2))}
    refused(lambda: mb.add(state, bad), "dtype")
    for x, y in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(x, host(y))
    check_sequences(mesh, folder, keys)
    check_frames(mesh, folder, keys)
    print(f"mesh checks passed on {n} devices")


# -- sequence buffers: 8 sub-envs split over the devices ----------------------------------
E, L, PERIOD = 8, 4, 2
SEQ_DRAWS, WIDE = 3, 512  # 1536 draws, few calls


def seq_stream(t0, t1):
    """Steps ``t0 .. t1 - 1`` of the 8 sub-envs: step ``{"env", "t"}``, core state, and the
    flags; sub-env ``e`` ends an episode at step ``3 + e`` (terminated when ``e`` is even)."""
    env = np.arange(E, dtype=np.int32)
    for t in range(t0, t1):
        end = env + 3 == t
        core = np.stack([env, np.full(E, t)], 1).astype(np.float32)
        yield (
            {"env": env, "t": np.full(E, t, np.int32)},
            core,
            end & (env % 2 == 0),
            end & (env % 2 == 1),
        )


def feed(buffer, state, stream):
    for args in stream:
        args = jax.device_put(args, buffer.batch_sharding)
        with jax.transfer_guard("disallow"):
            state = buffer.add(state, *args)
    return state


def window_keys(items):
    """The sub-env and first step of each window (its identity)."""
    return list(zip(host(items["env"])[:, 0].tolist(), host(items["t"])[:, 0].tolist()))


def check_sequences(mesh, folder, keys):
    n = len(mesh.devices)
    rows = CAPACITY // n
    big = make_prioritized_sequence_buffer(
        CAPACITY, L, PERIOD, burn_in=1, num_envs=E, alpha=ALPHA, beta=BETA
    )
    example = ({"env": jnp.int32(0), "t": jnp.int32(0)}, jnp.zeros(2, jnp.float32))
    one = big.init(*example)
    for args in seq_stream(0, 10):
        one = big.add(one, *args)
    count = int(one.size)
    assert count < CAPACITY  # nothing overwritten: the mesh holds the same windows
    every = jax.jit(big.gather)(one, jnp.arange(count, dtype=jnp.int32))
    slot_of = {key: i for i, key in enumerate(window_keys(every.items))}

    def as_big(sample):
        """Each sampled window equals the big buffer's window of the same key."""
        slots = np.array([slot_of[key] for key in window_keys(sample.items)])
        want = jax.tree_util.tree_map(lambda x: host(x)[slots], every)
        for name in ("items", "core_state", "mask", "loss_mask", "terminated", "truncated"):
            same(getattr(sample, name), getattr(want, name))
        return slots

    # uniform: over the mesh (global indices) and per shard
    ub = synced(shard_buffer(make_sequence_buffer(CAPACITY, L, PERIOD, 1, E), mesh, "data"))
    ustate = feed(ub, ub.init(*example), seq_stream(0, 10))
    stored_t = host(ustate.steps["t"]).reshape(n * rows, L)
    assert int(host(ustate.size).sum()) == count
    counts = np.zeros(count)
    with jax.transfer_guard("disallow"):
        for k in range(SEQ_DRAWS):
            s = ub.sample(ustate, keys[k], WIDE, "mesh")
            counts += np.bincount(as_big(s), minlength=count)
            np.testing.assert_array_equal(stored_t[host(s.indices)], host(s.items["t"]))
        s = ub.sample(ustate, keys[0], WIDE, "shard")
    as_big(s)
    assert np.all(host(s.indices) // rows == np.repeat(np.arange(n), WIDE // n))
    # device d owns sub-envs d * E / n ..: its windows are theirs
    assert np.all(host(s.items["env"])[:, 0] // (E // n) == host(s.indices) // rows)
    chi_square(counts, np.ones(count), "uniform sequence sample over the mesh")

    # prioritized: R2D2 priorities set by the owning shard, exact sampling
    pb = synced(shard_buffer(big, mesh, "data"))
    state = feed(pb, pb.init(*example), seq_stream(0, 10))
    stored = [
        (e, t)
        for e, t in zip(
            host(state.steps["env"])[..., 0].reshape(-1).tolist(), stored_t[:, 0].tolist()
        )
    ]
    filled = (host(state.size)[:, None] > np.arange(rows)).reshape(-1)
    gidx = np.flatnonzero(filled)
    td_of = lambda e, t0: 0.2 * (1 + e) * (1 + (t0 + np.arange(L)) % 3)  # noqa: E731
    mask_of = lambda e: np.arange(L) < (L if e % 3 else L - 1)  # noqa: E731
    one = big.update(
        one,
        jnp.arange(count),
        np.stack([td_of(*key) for key in slot_of]).astype(np.float32),
        mask=np.stack([mask_of(key[0]) for key in slot_of]),
    )
    pad = -len(gidx) % 8  # entries of index -1 (ignored): a multiple of the devices
    keys_m = [stored[g] for g in gidx]
    td = np.stack([td_of(*key) for key in keys_m] + [np.zeros(L)] * pad).astype(np.float32)
    mask = np.stack([mask_of(key[0]) for key in keys_m] + [np.ones(L, bool)] * pad)
    idx = np.concatenate([gidx, -np.ones(pad, int)]).astype(np.int32)
    with jax.transfer_guard("disallow"):
        state = pb.update(
            state,
            *jax.device_put((idx, td), pb.batch_sharding),
            mask=jax.device_put(mask, pb.batch_sharding),
        )
    p_big = host(utils.sum_tree_values(jax.device_get(one.tree)))
    p_mesh = host(utils.sum_tree_values(jax.device_get(state.tree))).reshape(-1)
    np.testing.assert_allclose(p_mesh[gidx], [p_big[slot_of[key]] for key in keys_m], rtol=1e-6)
    np.testing.assert_allclose(host(state.max_mix), np.full(n, host(one.max_mix)), rtol=1e-6)
    p = p_big[:count]
    counts = np.zeros(count)
    with jax.transfer_guard("disallow"):
        for k in range(SEQ_DRAWS):
            s = pb.sample(state, keys[k], WIDE)
            slots = as_big(s)
            counts += np.bincount(slots, minlength=count)
            w = p[slots] ** -BETA
            np.testing.assert_allclose(host(s.weights), w / w.max(), rtol=1e-5)
    chi_square(counts, p, "prioritized sequence sample over the mesh")

    # a restored state continues the same stream
    back = restored(pb, state, os.path.join(folder, f"seq{n}.ckpt"))
    a, b = (feed(pb, x, seq_stream(10, 14)) for x in (state, back))
    with jax.transfer_guard("disallow"):
        same(pb.sample(a, keys[2], WIDE), pb.sample(b, keys[2], WIDE))
    # chains reset on the devices that own them
    reset = np.arange(E) % 3 == 0
    with jax.transfer_guard("disallow"):
        b = pb.reset_chains(a, jax.device_put(reset, pb.batch_sharding))
    np.testing.assert_array_equal(
        host(b.chain_n).reshape(-1), np.where(reset, 0, host(a.chain_n).reshape(-1))
    )
    assert np.all(host(b.chain_first).reshape(-1)[reset])

    # sub-envs that cannot be split, and steps of another number of sub-envs
    if n > 1:
        refused(
            lambda: shard_buffer(make_sequence_buffer(CAPACITY, L, num_envs=n + 1), mesh, "data"),
            "num_envs",
        )
    bad = jax.tree_util.tree_map(lambda x: np.concatenate([x] * 2), next(seq_stream(0, 1)))
    refused(lambda: pb.add(state, *bad), "num_envs")


# -- frame stacks: a sub-env per device, frames lost to a small frame ring -----------------
FRAMES = 8  # rows and frames per shard: of 12 transitions added, 4..11 stay, 6..11 whole


def frame_batch(n, t):
    """Step ``t`` of sub-env ``e`` on device ``e``: stacks of the frames ``32 e + t``."""
    e = np.arange(n)
    f = lambda t: np.repeat((32 * e + t).astype(np.uint8)[:, None], 3, 1)  # noqa: E731
    z = np.zeros(n, np.float32)
    A = (100 * e + t).astype(np.int32)
    return TransitionBatch(
        S=np.stack([f(t), f(t + 1)], 1),
        A=A,
        logP=z,
        Rn=z,
        In=z,
        S_next=np.stack([f(t + 1), f(t + 2)], 1),
    )


def check_stacks(items):
    """Every stack is the one added with the transition (``A`` names it); none lost frames."""
    e, t = np.divmod(host(items.A), 100)
    assert np.all(t >= 6), "a transition that lost frames was sampled"
    first = (32 * e + t).astype(np.uint8)[:, None, None] + np.arange(2, dtype=np.uint8)[:, None]
    np.testing.assert_array_equal(host(items.S), np.broadcast_to(first, (len(t), 2, 3)))
    np.testing.assert_array_equal(host(items.S_next), np.broadcast_to(first + 1, (len(t), 2, 3)))
    return e * 6 + t - 6  # an index among the whole transitions


def check_frames(mesh, folder, keys):
    n = len(mesh.devices)
    size = FRAMES * n

    def feed_frames(buffer, state, t0, t1):
        for t in range(t0, t1):
            batch = jax.device_put(frame_batch(n, t), buffer.batch_sharding)
            with jax.transfer_guard("disallow"):
                state = buffer.add(state, batch)
        return state

    example = jax.tree_util.tree_map(lambda x: x[0], frame_batch(1, 0))
    ub = synced(shard_buffer(make_frame_stack_buffer(size, 2, frame_capacity=size), mesh, "data"))
    ustate = feed_frames(ub, ub.init(example), 0, 12)
    counts = np.zeros(6 * n)
    with jax.transfer_guard("disallow"):
        for k in range(SEQ_DRAWS):
            counts += np.bincount(
                check_stacks(ub.sample(ustate, keys[k], WIDE, "mesh")), minlength=6 * n
            )
        s = ub.sample(ustate, keys[0], WIDE, "shard")
    check_stacks(s)
    assert np.all(host(s.A) // 100 == np.repeat(np.arange(n), WIDE // n)), "drew elsewhere"
    chi_square(counts, np.ones(6 * n), "uniform frame-stack sample over the mesh")

    pb = synced(
        shard_buffer(
            make_prioritized_frame_stack_buffer(size, 2, ALPHA, BETA, EPS, frame_capacity=size),
            mesh,
            "data",
        )
    )
    state = feed_frames(pb, pb.init(example), 0, 12)
    ids = host(state.transitions.items.A).reshape(-1)
    delta = 0.5 + ids % 4 + (ids // 100) * 0.25
    with jax.transfer_guard("disallow"):
        state = pb.update(
            state,
            *jax.device_put(
                (np.arange(size, dtype=np.int32), delta.astype(np.float32)), pb.batch_sharding
            ),
        )
    p_all = (delta + EPS) ** ALPHA
    whole = ids % 100 >= 6
    values = host(utils.sum_tree_values(jax.device_get(state.transitions.tree))).reshape(-1)
    np.testing.assert_allclose(values, np.where(whole, p_all, 0), rtol=1e-6)  # lost: 0
    p = np.zeros(6 * n)
    p[(ids[whole] // 100) * 6 + ids[whole] % 100 - 6] = p_all[whole]
    counts = np.zeros(6 * n)
    with jax.transfer_guard("disallow"):
        for k in range(SEQ_DRAWS):
            s = pb.sample(state, keys[k], WIDE)
            got = check_stacks(s.items)
            counts += np.bincount(got, minlength=6 * n)
            np.testing.assert_array_equal(host(s.items.A), ids[host(s.indices)])
            w = p[got] ** -BETA
            np.testing.assert_allclose(host(s.weights), w / w.max(), rtol=1e-5)
    chi_square(counts, p, "prioritized frame-stack sample over the mesh")

    if n > 1:  # a frame ring too small to split
        small = make_frame_stack_buffer(size, 2, frame_capacity=4)
        refused(lambda: shard_buffer(small, mesh, "data"), "frames to each")
    back = restored(pb, state, os.path.join(folder, f"frames{n}.ckpt"))
    a, b = (feed_frames(pb, x, 12, 14) for x in (state, back))
    with jax.transfer_guard("disallow"):
        same(pb.sample(a, keys[3], WIDE), pb.sample(b, keys[3], WIDE))


if __name__ == "__main__":
    main(sys.argv[2])
