"""Checks of the mesh-sharded buffers on ``N`` forced CPU devices, run in its own process.

``python tests/replay/mesh_driver.py N FOLDER`` forces ``N`` host devices (the flag must be
set before jax starts, hence a process per device count), runs every check and prints
``mesh checks passed on N devices``; a failed check raises. ``FOLDER`` takes the checkpoints.
Every add, sample and update runs under ``jax.transfer_guard("disallow")``.
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
from coax_utils.replay import make_prioritized_buffer, make_uniform_buffer  # noqa: E402
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
    def refused(fn, match):
        try:
            fn()
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"no ValueError ({match})")

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
    print(f"mesh checks passed on {n} devices")


if __name__ == "__main__":
    main(sys.argv[2])
