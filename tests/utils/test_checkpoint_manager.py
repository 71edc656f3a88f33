"""Tests of utils.CheckpointManager: naming, retention, background saves, kills and restarts."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coax_utils import utils
from coax_utils.replay import NStep, PrioritizedReplayBuffer, TransitionBatch


def ckpt(step):
    return f"ckpt_{step:012d}.pkl.lz4"


def metrics_file(step):
    return f"ckpt_{step:012d}.metrics.pkl.lz4"


def temp_files(path):
    """The temp files of ``dump`` in ``path`` (none may stay after a save or a restart)."""
    return [n for n in os.listdir(path) if n.startswith(".coax_utils-") and n.endswith(".tmp")]


def folder_bytes(path):
    """{name: bytes} of every file under ``path`` (what a rejected call must not change)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def run_python(code, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class SlowToPickle:
    """Copied at once, but pickled slowly: keeps a background save running for a while."""

    def __init__(self, seconds=0.5):
        self.seconds = seconds

    def __deepcopy__(self, memo):
        return SlowToPickle(self.seconds)

    def __reduce__(self):
        time.sleep(self.seconds)
        return (SlowToPickle, (self.seconds,))


class FailsToPickle:
    def __deepcopy__(self, memo):
        return FailsToPickle()

    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


# -- basics --------------------------------------------------------------------------------


@pytest.mark.parametrize("background", [True, False])
def test_round_trip_file_names_and_types(tmp_path, background):
    steps = [0, 7, 99, 100, 1234, 10**11]
    with utils.CheckpointManager(tmp_path, max_to_keep=None, background=background) as m:
        for step in steps:
            m.save(step, {"step": step, "w": np.full(3, step), "j": jnp.full(2, step)})
        m.wait()
        assert m.all_steps() == steps
        assert m.latest_step() == steps[-1]
        assert m.best_step() is None
        state = m.restore(99)
        assert state["step"] == 99
        assert isinstance(state["w"], np.ndarray) and isinstance(state["j"], jax.Array)
        np.testing.assert_array_equal(state["j"], [99, 99])
        assert m.restore()["step"] == 10**11
    # plain `ls` order (sorted names) is step order
    names = sorted(n for n in os.listdir(tmp_path) if not n.startswith("."))
    assert names == [ckpt(s) for s in steps]
    assert temp_files(tmp_path) == []
    assert utils.load(tmp_path / ckpt(7))["step"] == 7  # plain files, loadable on their own


def test_metrics_are_stored_as_plain_data(tmp_path):
    metrics = {"ret": np.float32(1.5), "n": jnp.asarray(3), "ok": np.bool_(True), "tag": "a"}
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["ret"]) as m:
        m.save(1, {"x": 1}, metrics=metrics)
    stored = utils.load(tmp_path / metrics_file(1), safe=True)
    assert stored == {"ret": 1.5, "n": 3, "ok": True, "tag": "a"}
    assert [type(v) for v in stored.values()] == [float, int, bool, str]


def test_directory_and_close(tmp_path):
    m = utils.CheckpointManager(tmp_path / "a" / "b")
    assert m.directory == str(tmp_path / "a" / "b")
    assert "CheckpointManager(" in repr(m)
    m.save(3, [1, 2])
    m.close()
    m.close()  # a second close does nothing
    with pytest.raises(ValueError, match="closed"):
        m.save(4, [1])
    with pytest.raises(ValueError, match="closed"):
        m.restore()
    assert m.all_steps() == [3]


def test_one_writer_per_folder(tmp_path):
    m = utils.CheckpointManager(tmp_path)
    with pytest.raises(RuntimeError, match="in use by another CheckpointManager"):
        utils.CheckpointManager(tmp_path)
    m.close()
    utils.CheckpointManager(tmp_path).close()  # released by close


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, error",
    [
        (True, TypeError),
        (np.bool_(False), TypeError),
        (3.0, TypeError),
        ("4", TypeError),
        (None, TypeError),
        (-1, ValueError),
        (10**12, ValueError),
        (5, ValueError),  # == newest
        (2, ValueError),  # older than the newest
    ],
)
def test_bad_step_changes_nothing(tmp_path, step, error):
    with utils.CheckpointManager(tmp_path, max_to_keep=2) as m:
        m.save(1, {"a": 1})
        m.save(5, {"a": 5})
        m.wait()
        before = folder_bytes(tmp_path)
        with pytest.raises(error, match=re.escape(repr(step))):
            m.save(step, {"a": 6})
        m.wait()
        assert folder_bytes(tmp_path) == before
        assert m.all_steps() == [1, 5]
        m.save(np.int64(6), {"a": 6})  # numpy integers are ints
    assert utils.CheckpointManager(tmp_path).all_steps() == [5, 6]


@pytest.mark.parametrize(
    "metrics, error",
    [
        ([("a", 1.0)], TypeError),
        ({1: 1.0}, TypeError),
        ({"a": np.ones(2)}, TypeError),
        ({"a": 1 + 2j}, TypeError),
        ({"a": None}, TypeError),
        ({"a": float("nan")}, ValueError),  # best_fn's score must be finite
        ({"b": 1.0}, KeyError),  # best_fn's own error
    ],
)
def test_bad_metrics_change_nothing(tmp_path, metrics, error):
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["a"]) as m:
        m.save(1, {"a": 1}, metrics={"a": 0.5})
        m.wait()
        before = folder_bytes(tmp_path)
        with pytest.raises(error):
            m.save(2, {"a": 2}, metrics=metrics)
        m.wait()
        assert folder_bytes(tmp_path) == before


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(max_to_keep=0), ValueError),
        (dict(max_to_keep=True), TypeError),
        (dict(max_to_keep=2.0), TypeError),
        (dict(keep_every_n_steps=-5), ValueError),
        (dict(best_fn="loss"), TypeError),
        (dict(best_mode="maximum"), ValueError),
        (dict(best_mode=max), TypeError),
        (dict(background=1), TypeError),
    ],
)
def test_bad_arguments_create_nothing(tmp_path, kwargs, error):
    with pytest.raises(error):
        utils.CheckpointManager(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_directory_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"not a folder")
    with pytest.raises(ValueError, match="not a folder"):
        utils.CheckpointManager(path)
    assert path.read_bytes() == b"not a folder"
    assert sorted(os.listdir(tmp_path)) == ["file"]
    with pytest.raises(TypeError):
        utils.CheckpointManager(b"/tmp/bytes-path")
    with pytest.raises(TypeError):
        utils.CheckpointManager(3)


# -- retention -----------------------------------------------------------------------------


def model_kept(saved, max_to_keep, every, best_mode):
    """The steps the rules keep, from the whole history ``[(step, score or None), ...]``."""
    steps = [s for s, _ in saved]
    kept = set(steps if max_to_keep is None else steps[max(0, len(steps) - max_to_keep) :])
    if every is not None:
        windows = {}
        for s in steps:
            windows.setdefault(s // every, s)
        kept |= set(windows.values())
    best = None
    for s, score in saved:  # ties: the newer step wins
        if score is None:
            continue
        if best is None or (score >= best[1] if best_mode == "max" else score <= best[1]):
            best = (s, score)
    if best is not None:
        kept.add(best[0])
    return kept, None if best is None else best[0]


@settings(max_examples=25, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 12), min_size=1, max_size=30),
    scores=st.lists(st.one_of(st.none(), st.integers(-3, 3)), min_size=30, max_size=30),
    max_to_keep=st.one_of(st.none(), st.integers(1, 4)),
    every=st.one_of(st.none(), st.integers(1, 25)),
    best_mode=st.one_of(st.none(), st.sampled_from(["max", "min"])),
    background=st.booleans(),
)
def test_retention_matches_a_model(gaps, scores, max_to_keep, every, best_mode, background):
    best_fn = None if best_mode is None else (lambda m: m["score"])
    kwargs = dict(max_to_keep=max_to_keep, keep_every_n_steps=every, best_fn=best_fn)
    kwargs["best_mode"] = best_mode or "max"
    with tempfile.TemporaryDirectory() as folder:
        saved, step = [], -1
        with utils.CheckpointManager(folder, background=background, **kwargs) as m:
            for gap, score in zip(gaps, scores):
                step += gap
                metrics = None if score is None else {"score": score}
                m.save(step, {"step": step}, metrics=metrics)
                saved.append((step, None if best_fn is None else score))
                m.wait()
                kept, best = model_kept(saved, max_to_keep, every, best_mode)
                assert m.all_steps() == sorted(kept)
                assert m.best_step() == best
        files = {n for n in os.listdir(folder) if not n.startswith(".")}
        with_metrics = {s for s, sc in zip([s for s, _ in saved], scores) if sc is not None}
        assert files == {ckpt(s) for s in kept} | {metrics_file(s) for s in kept & with_metrics}
        # a restarted manager agrees: steps and the best one come from the stored metrics
        with utils.CheckpointManager(folder, **kwargs) as m:
            assert m.all_steps() == sorted(kept)
            assert m.best_step() == best
            for s in kept:
                assert m.restore(s) == {"step": s}


def test_best_checkpoint_outlives_newer_ones(tmp_path):
    with utils.CheckpointManager(tmp_path, max_to_keep=1, best_fn=lambda m: -m["loss"]) as m:
        for step, loss in [(1, 5.0), (2, 0.5), (3, 2.0), (4, 3.0)]:
            m.save(step, {"step": step}, metrics={"loss": loss})
        m.wait()
        assert m.all_steps() == [2, 4]
        assert m.best_step() == 2
    with utils.CheckpointManager(
        tmp_path, max_to_keep=1, best_fn=lambda m: m["loss"], best_mode="min"
    ) as m:
        assert m.best_step() == 2  # the same ranking from the stored metrics


# -- background saves ----------------------------------------------------------------------


def test_mutating_the_state_after_save_does_not_change_the_checkpoint(tmp_path):
    buffer = PrioritizedReplayBuffer(8, random_seed=1)
    tracer = NStep(n=2, gamma=0.9)

    def transition(i):
        return TransitionBatch.from_single(
            s=np.full(2, i, np.float32),
            a=i % 2,
            logp=0.0,
            r=float(i),
            done=False,
            s_next=np.full(2, i + 1, np.float32),
            gamma=0.9,
        )

    for i in range(3):
        buffer.add(transition(i))
    shared = np.arange(6.0)
    donated = jnp.arange(4.0)
    state = {
        "slow": SlowToPickle(0.5),  # first in the dict: the arrays are pickled after 0.5 s
        "arr": shared,
        "alias": shared,
        "params": {
            "w": donated,
            "key": jax.random.key(3),
            "half": jnp.full(3, 1.5, jnp.bfloat16),
            "weak": jnp.asarray(2.0),  # weakly typed
        },
        "buffer": buffer,
        "tracer": tracer,
        "returns": [1.0, 2.0],
    }
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, state)
        # the training loop goes on at once: it overwrites, appends and donates
        shared[:] = -1
        state["returns"].append(3.0)
        for i in range(3, 6):
            buffer.add(transition(i))
        tracer.add(np.zeros(2, np.float32), 0, 1.0, False)
        donate = jax.jit(lambda x: x * 0, donate_argnums=0)
        donate(donated)  # on the CPU, jax declines it while the pending save views the buffer
        m.wait()
        donate(donated)  # the finished save holds nothing: the buffer can be donated now
        assert donated.is_deleted()
    loaded = utils.load(tmp_path / ckpt(1))
    np.testing.assert_array_equal(loaded["arr"], np.arange(6.0))
    assert loaded["alias"] is loaded["arr"]  # shared references stay shared
    np.testing.assert_array_equal(loaded["params"]["w"], np.arange(4.0))
    assert isinstance(loaded["params"]["w"], jax.Array)
    assert jax.random.key_data(loaded["params"]["key"]).tolist() == (
        jax.random.key_data(jax.random.key(3)).tolist()
    )
    assert loaded["params"]["half"].dtype == jnp.bfloat16
    assert loaded["params"]["weak"].weak_type and float(loaded["params"]["weak"]) == 2.0
    assert loaded["returns"] == [1.0, 2.0]
    assert len(loaded["buffer"]) == 3 and len(buffer) == 6
    assert not loaded["tracer"]


def test_deleting_a_jax_array_of_a_pending_save_never_gives_a_wrong_checkpoint(tmp_path):
    x = jnp.arange(5.0)
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, {"slow": SlowToPickle(0.3), "x": x, "y": jnp.arange(3.0)})
        x.delete()  # the save holds x itself: it writes x's memory, or fails
        try:
            m.wait()
        except RuntimeError as err:
            assert "deleted" in str(err) and m.all_steps() == [], err
        else:
            np.testing.assert_array_equal(m.restore()["x"], np.arange(5.0))
        m.save(2, {"y": jnp.arange(3.0)})  # the manager goes on
        m.wait()
        np.testing.assert_array_equal(m.restore(2)["y"], np.arange(3.0))


@pytest.mark.parametrize("background", [True, False])
def test_cyclic_and_shared_states_keep_their_shape(tmp_path, background):
    a = [13, jnp.arange(3.0)]
    b = {"a": a}
    cycle = [1]
    cycle.append(cycle)  # a list that holds itself
    node = {"name": "node"}
    node["self"] = node
    big = list(range(100_000))
    params = {"w": jnp.ones(4), "b": np.zeros(2)}
    opt = optax.adam(0.1).init({"w": params["w"]})  # NamedTuples holding jax arrays
    state = {
        "a": a,
        "b": b,
        "cycle": cycle,
        "node": node,
        "many": [big] * 20,  # one list, 20 references: copied once
        "params": params,
        "twice": (params, params["w"], params["b"]),
        "opt": opt,
    }
    with utils.CheckpointManager(tmp_path, background=background) as m:
        m.save(1, state)
        a.append(7)  # after save: not in the checkpoint
        m.wait()
        r = m.restore()
    assert r["b"]["a"] is r["a"] and r["a"][0] == 13 and len(r["a"]) == 2
    np.testing.assert_array_equal(r["a"][1], [0.0, 1.0, 2.0])
    assert r["cycle"][1] is r["cycle"] and r["cycle"][0] == 1
    assert r["node"]["self"] is r["node"] and r["node"]["name"] == "node"
    assert all(x is r["many"][0] for x in r["many"]) and r["many"][0] == big
    assert r["twice"][0] is r["params"]
    assert r["twice"][1] is r["params"]["w"] and r["twice"][2] is r["params"]["b"]
    assert isinstance(r["params"]["w"], jax.Array) and isinstance(r["params"]["b"], np.ndarray)
    assert jax.tree_util.tree_structure(r["opt"]) == jax.tree_util.tree_structure(opt)
    assert type(r["opt"][0]) is type(opt[0])
    np.testing.assert_array_equal(r["opt"][0].mu["w"], np.zeros(4))


def test_large_arrays_are_copied_whole_before_save_returns(tmp_path):
    # large arrays are copied in pieces of 8 MB on several threads: every piece must land
    rng = np.random.default_rng(0)
    c_order = rng.integers(0, 2**62, 3_000_000)  # 24 MB
    f_order = np.asfortranarray(rng.random((1500, 1500)))  # 18 MB, not C-contiguous
    strided = c_order[::2]  # a view that is not contiguous
    odd = rng.integers(0, 255, 3 * (1 << 23) + 5, dtype=np.uint8)  # pieces of unequal sizes
    on_jax = jnp.asarray(rng.random(3_000_000, dtype=np.float32))  # 12 MB
    state = {"c": c_order, "f": f_order, "strided": strided, "odd": odd, "jax": on_jax}
    expected = {k: np.array(v) for k, v in state.items()}
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, state)
        for arr in (c_order, f_order, odd):
            arr[...] = 0  # the loop overwrites its arrays as soon as save returns
        m.wait()
        restored = m.restore()
    for key, value in expected.items():
        np.testing.assert_array_equal(restored[key], value)
        assert restored[key].dtype == value.dtype
    assert isinstance(restored["jax"], jax.Array)


def test_a_save_from_an_atexit_handler(tmp_path):
    # at exit no new thread pool can start: the copy falls back to one thread
    out = run_python(
        """
        import atexit, sys
        import numpy as np
        from coax_utils import utils

        m = utils.CheckpointManager(sys.argv[1])
        x = np.arange(5_000_000)

        def at_exit():
            m.save(1, {"x": x})
            x[:] = -1
            m.close()

        atexit.register(at_exit)
        """,
        tmp_path,
    )
    assert out.returncode == 0 and not out.stderr, out.stderr[-2000:]
    np.testing.assert_array_equal(utils.load(tmp_path / ckpt(1))["x"], np.arange(5_000_000))


def test_background_error_surfaces_in_wait_save_and_close(tmp_path):
    m = utils.CheckpointManager(tmp_path)
    m.save(1, {"ok": 1})
    m.save(2, {"bad": FailsToPickle()})
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        m.wait()
    m.wait()  # raised once, then cleared
    assert m.all_steps() == [1]
    assert temp_files(tmp_path) == []

    m.save(2, {"bad": FailsToPickle()}, metrics={"x": 1.0})
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        m.save(3, {"ok": 3})  # the next save raises it (and is not made)
    assert m.all_steps() == [1]
    assert not (tmp_path / metrics_file(2)).exists()

    m.save(3, {"bad": FailsToPickle()})
    with pytest.raises(RuntimeError, match="refuses to be pickled"):
        m.close()
    assert m.all_steps() == [1]
    with utils.CheckpointManager(tmp_path) as m2:  # close released the folder
        assert m2.all_steps() == [1]
        m2.save(2, {"ok": 2})


def test_save_waits_for_the_previous_one(tmp_path):
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, {"slow": SlowToPickle(0.4)})
        assert m.latest_step() is None  # returned while the pickling (0.4 s) still runs
        m.save(2, {"x": 2})  # waits for step 1: one writer at a time
        assert m.all_steps() in ([1], [1, 2])
        m.wait()
        assert m.all_steps() == [1, 2]


def test_interpreter_exit_finishes_the_pending_save(tmp_path):
    out = run_python(
        """
        import sys, time
        import numpy as np
        from coax_utils import utils

        class SlowToPickle:
            def __deepcopy__(self, memo):
                return SlowToPickle()
            def __reduce__(self):
                time.sleep(1.0)
                return (SlowToPickle, ())

        m = utils.CheckpointManager(sys.argv[1])
        m.save(5, {"slow": SlowToPickle(), "x": np.arange(10)})
        print("save returned", m.latest_step(), flush=True)
        # no close(): the interpreter exits with the save pending
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "save returned None" in out.stdout
    assert utils.load(tmp_path / ckpt(5))["x"].tolist() == list(range(10))


def test_a_background_error_at_exit_is_printed(tmp_path):
    out = run_python(
        """
        import sys
        from coax_utils import utils

        class FailsToPickle:
            def __deepcopy__(self, memo):
                return FailsToPickle()
            def __reduce__(self):
                raise RuntimeError("this object refuses to be pickled")

        m = utils.CheckpointManager(sys.argv[1])
        m.save(5, {"bad": FailsToPickle()})
        """,
        tmp_path,
    )
    assert "this object refuses to be pickled" in out.stderr
    assert not (tmp_path / ckpt(5)).exists()


def test_interpreter_exit_finishes_a_pending_save_of_a_large_state(tmp_path):
    out = run_python(
        """
        import sys
        import numpy as np
        from coax_utils import utils

        m = utils.CheckpointManager(sys.argv[1])
        m.save(5, {"x": np.random.default_rng(0).random(8_000_000)})  # 64 MB
        """,
        tmp_path,
    )
    assert out.returncode == 0 and (tmp_path / ckpt(5)).exists(), out.stderr[-2000:]


# -- kills, restarts, corrupt files --------------------------------------------------------

TRAINER = """
import sys
import numpy as np
from coax_utils import utils

m = utils.CheckpointManager(sys.argv[1], max_to_keep=2, keep_every_n_steps=10,
                            best_fn=lambda metrics: metrics["score"])
step = 0 if m.latest_step() is None else m.latest_step() + 1
while True:
    x = np.random.default_rng(step).integers(0, 2**62, 1_000_000)  # 8 MB, incompressible
    m.save(step, {"step": step, "x": x}, metrics={"score": step % 7})
    print(step, flush=True)
    step += 1
"""


def check_state(state, step):
    assert state["step"] == step
    np.testing.assert_array_equal(
        state["x"], np.random.default_rng(step).integers(0, 2**62, 1_000_000)
    )


@pytest.mark.slow
def test_sigkill_during_background_saves_then_restore_the_newest_complete_step(tmp_path):
    folder = tmp_path / "run"
    newest = -1
    for delay in np.linspace(0.0, 0.6, 10):  # kill at many moments of the save cycle
        proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(folder)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = proc.stdout.readline()  # the first save() has returned
        assert first, proc.stderr.read()
        assert int(first) == newest + 1  # each run goes on from the newest checkpoint
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        printed = [int(first)] + [int(line) for line in proc.stdout.read().split()]
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        # save(k) returned, so step k - 1 had completed (save waits for the previous save)
        completed = printed[-1] - 1
        with utils.CheckpointManager(
            folder, max_to_keep=2, keep_every_n_steps=10, best_fn=lambda metrics: metrics["score"]
        ) as m:
            assert temp_files(folder) == []  # unfinished files were removed
            latest = m.latest_step()
            if latest is None:  # killed before the first save completed
                assert max(completed, newest) < 0
                continue
            assert latest >= max(completed, newest)
            check_state(m.restore(), latest)
            for step in m.all_steps():  # every retained checkpoint loads
                check_state(m.restore(step), step)
            names = [n for n in os.listdir(folder) if n.startswith("ckpt_")]
            assert sorted(names) == sorted(
                [ckpt(s) for s in m.all_steps()] + [metrics_file(s) for s in m.all_steps()]
            )
            best = m.best_step()
            assert best is not None and best % 7 == max(s % 7 for s in m.all_steps())
            newest = latest
    assert newest > 0


def save_steps(folder, steps, **kwargs):
    with utils.CheckpointManager(folder, max_to_keep=None, **kwargs) as m:
        for step in steps:
            m.save(step, {"step": step, "x": np.arange(100_000)}, metrics={"s": step})


def damage(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("safe", [False, True])
def test_restore_falls_back_past_a_damaged_checkpoint_and_keeps_it(tmp_path, safe):
    save_steps(tmp_path, (10, 20, 30))
    damage(tmp_path / ckpt(30))
    before = folder_bytes(tmp_path)
    with utils.CheckpointManager(tmp_path, max_to_keep=None) as m:
        with pytest.warns(RuntimeWarning, match=r"not restoring step 30: it is damaged") as rec:
            state = m.restore(safe=safe)
        assert ckpt(30) in str(rec[0].message)
        assert state["step"] == 20
        # nothing renamed, deleted or forgotten: the manager still names the file on disk
        assert folder_bytes(tmp_path) == before
        assert m.all_steps() == [10, 20, 30] and m.latest_step() == 30
        with pytest.raises(utils.CheckpointDamagedError, match=ckpt(30)):
            m.restore(30)  # an explicit step is loaded or fails, never skipped
        with pytest.raises(ValueError, match="not after the newest saved step 30"):
            m.save(21, {"step": 21})
        assert folder_bytes(tmp_path) == before
        with pytest.raises(FileNotFoundError, match="no checkpoint of step 25"):
            m.restore(25)


def test_quarantine_moves_damaged_checkpoints_aside(tmp_path):
    save_steps(tmp_path, (10, 20, 30))
    damage(tmp_path / ckpt(30))
    damaged = (tmp_path / ckpt(30)).read_bytes()
    with utils.CheckpointManager(tmp_path, max_to_keep=None) as m:
        with pytest.warns(RuntimeWarning, match=r"step 30: .*renamed to"):
            assert m.restore(quarantine=True)["step"] == 20
        assert (tmp_path / (ckpt(30) + ".corrupt")).read_bytes() == damaged
        assert m.all_steps() == [10, 20]
        m.save(21, {"step": 21})  # training goes on from step 20, without metrics
        m.wait()
        assert m.restore()["step"] == 21
    # the metrics of the moved step are removed as a leftover by the next manager
    with utils.CheckpointManager(tmp_path, max_to_keep=None) as m:
        assert m.all_steps() == [10, 20, 21]
    assert not (tmp_path / metrics_file(30)).exists()


def test_quarantine_of_a_checkpoint_that_cannot_be_renamed(tmp_path):
    # a folder already named <checkpoint>.corrupt: the file stays, and so does its step
    save_steps(tmp_path, (10, 20))
    (tmp_path / ckpt(20)).write_bytes((tmp_path / ckpt(20)).read_bytes()[:10])
    (tmp_path / (ckpt(20) + ".corrupt")).mkdir()
    with utils.CheckpointManager(tmp_path, max_to_keep=3) as m:
        with pytest.warns(RuntimeWarning, match="could not be renamed"):
            assert m.restore(quarantine=True)["step"] == 10
        assert (tmp_path / ckpt(20)).exists() and m.all_steps() == [10, 20]


def test_restore_with_nothing_to_load(tmp_path):
    with utils.CheckpointManager(tmp_path) as m:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            m.restore()
        m.save(1, {"a": 1})
        m.save(2, {"a": 2})
    for step in (1, 2):
        (tmp_path / ckpt(step)).write_bytes(b"garbage")
    with utils.CheckpointManager(tmp_path) as m:
        with pytest.warns(RuntimeWarning, match="not restoring step 2"):
            with pytest.warns(RuntimeWarning, match="not restoring step 1"):
                # every step damaged: an error, not a silent start from scratch
                with pytest.raises(utils.CheckpointDamagedError, match=r"steps \[1, 2\]"):
                    m.restore()
        assert m.all_steps() == [1, 2]


def test_safe_restore_of_a_newer_checkpoint_with_a_pickle_section_raises(tmp_path):
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, {"step": 1})
        m.save(2, {"step": 2, "fn": lambda x: x + 1})  # a function: the pickle section
    before = folder_bytes(tmp_path)
    with utils.CheckpointManager(tmp_path) as m:
        with pytest.raises(utils.UnsafeCheckpointError, match=ckpt(2)):
            m.restore(safe=True)  # not step 1 with a warning while latest_step() says 2
        assert folder_bytes(tmp_path) == before
        assert m.latest_step() == 2
        assert m.restore()["fn"](1) == 2  # trusted: safe=False reads it


# a module of the user's: a NamedTuple that must be registered before its checkpoints load
USER_TYPES = """
from typing import NamedTuple

from coax_utils import utils


class Counter(NamedTuple):
    count: int
    total: float


def register():
    utils.register_checkpoint_type(Counter, "user.Counter")
"""

# argv: folder, mode ('save', 'forget' or 'fixed'), what ('registration' or 'x64')
RESUME = """
import sys

import jax

folder, mode, what = sys.argv[1:]
if what == "x64" and mode != "forget":
    jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import user_types

from coax_utils import utils

if what == "registration" and mode != "forget":
    user_types.register()
manager = utils.CheckpointManager(folder, max_to_keep=2)
if mode == "save":
    for step in (100, 200, 300):
        if what == "x64":
            state = {"step": step, "w": jnp.full(3, step + 0.5, jnp.float64)}
        else:
            state = {"step": step, "w": user_types.Counter(step, step + 0.5)}
        manager.save(step, state)
    manager.close()
    sys.exit(0)
# the documented resume pattern
step = 0
if manager.latest_step() is not None:
    try:
        state = manager.restore()
    except utils.CheckpointNotReadableError as err:
        print("not readable:", type(err).__name__, err)
        sys.exit(3)
    step = state["step"]
    w = state["w"]
    print("resumed", step, type(w).__name__, getattr(w, "dtype", None), flush=True)
manager.close()
"""


@pytest.mark.parametrize("what", ["registration", "x64"])
def test_a_process_that_cannot_read_the_checkpoints_changes_nothing(tmp_path, what):
    (tmp_path / "user_types.py").write_text(USER_TYPES)
    folder = tmp_path / "run"

    def run(mode):
        env = dict(os.environ, PYTHONPATH=str(tmp_path), JAX_PLATFORMS="cpu")
        return subprocess.run(
            [sys.executable, "-c", RESUME, str(folder), mode, what],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )

    out = run("save")
    assert out.returncode == 0, out.stderr[-3000:]
    before = folder_bytes(folder)
    assert set(before) == {ckpt(200), ckpt(300), ".coax_utils-lock"}
    # a process that forgot the registration (or the x64 flag): an error, and no change
    out = run("forget")
    assert out.returncode == 3, (out.stdout, out.stderr[-3000:])
    assert "not readable: CheckpointNotReadableError" in out.stdout
    assert "register_checkpoint_type" in out.stdout or "jax_enable_x64" in out.stdout
    assert folder_bytes(folder) == before
    assert sorted(os.listdir(folder)) == sorted(before)
    # fixed, it resumes from the newest step
    out = run("fixed")
    assert out.returncode == 0, out.stderr[-3000:]
    expected = "Counter None" if what == "registration" else "ArrayImpl float64"
    assert f"resumed 300 {expected}" in out.stdout
    assert folder_bytes(folder) == before


def test_restart_removes_unfinished_files_and_keeps_foreign_ones(tmp_path):
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": 1}, metrics={"r": 1.0})
    # what a save killed at various moments leaves behind: a temp file of dump (of a process
    # that has ended), metrics written without their checkpoint
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / f".coax_utils-{dead}-0123456789ab.tmp").write_bytes(b"half a checkpoint")
    utils.dump({"r": 2.0}, tmp_path / metrics_file(2))
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "ckpt_5.pkl.lz4").write_bytes(b"not the manager's naming")
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"]) as m:
        assert m.all_steps() == [1]
        assert m.best_step() == 1
        assert temp_files(tmp_path) == []
        assert not (tmp_path / metrics_file(2)).exists()
        m.save(2, {"a": 2})
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "ckpt_5.pkl.lz4").exists()


def test_folder_of_an_older_version_opens(tmp_path):
    # older versions wrote through a pending folder; what one left there is ignored
    with utils.CheckpointManager(tmp_path) as m:
        m.save(1, {"a": 1}, metrics={"r": 1.0})
    pending = tmp_path / ".coax_utils-pending"
    pending.mkdir()
    (pending / ckpt(2)).write_bytes(b"half a checkpoint")
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"]) as m:
        assert m.all_steps() == [1] and m.best_step() == 1
        m.save(2, {"a": 2})
        m.wait()
        assert m.restore() == {"a": 2}
    assert (pending / ckpt(2)).read_bytes() == b"half a checkpoint"


def test_corrupt_metrics_file_is_ignored_with_a_warning(tmp_path):
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"]) as m:
        m.save(1, {"a": 1}, metrics={"r": 5.0})
        m.save(2, {"a": 2}, metrics={"r": 1.0})
    (tmp_path / metrics_file(1)).write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match=metrics_file(1)):
        m = utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"])
    assert m.best_step() == 2
    m.close()


def test_names_with_non_ascii_digits_are_foreign(tmp_path):
    # "\d" also matches e.g. Arabic-Indic digits, which int() reads: such a file became a
    # phantom step 111111111111 that blocked every later save and broke restore()
    with utils.CheckpointManager(tmp_path, background=False) as m:
        m.save(5, {"a": 5})
    foreign = tmp_path / ("ckpt_" + "\u0661" * 12 + ".pkl.lz4")
    foreign.write_bytes(b"not the manager's")
    metrics_like = tmp_path / ("ckpt_" + "\u0662" * 12 + ".metrics.pkl.lz4")
    metrics_like.write_bytes(b"not the manager's either")
    with utils.CheckpointManager(tmp_path, background=False, max_to_keep=1) as m:
        assert m.all_steps() == [5]
        assert m.restore() == {"a": 5}
        m.save(6, {"a": 6})
        assert m.all_steps() == [6]
    assert foreign.read_bytes() == b"not the manager's"
    assert metrics_like.exists()


@pytest.mark.parametrize(
    "best_fn", [lambda m: m["return"], lambda m: m["loss"]], ids=["missing key", "nan score"]
)
def test_stored_metrics_that_best_fn_cannot_score_do_not_lock_the_folder(tmp_path, best_fn):
    with utils.CheckpointManager(tmp_path, background=False) as m:  # no best_fn yet
        m.save(1, {"a": 1}, metrics={"loss": float("nan")})
        m.save(2, {"a": 2}, metrics={"loss": 0.5, "return": 3.0})
    with pytest.warns(RuntimeWarning, match="step 1 has no score"):
        m = utils.CheckpointManager(tmp_path, best_fn=best_fn, background=False)
    with m:
        assert m.all_steps() == [1, 2]
        assert m.best_step() == 2
        assert m.restore() == {"a": 2}


@pytest.mark.parametrize("kind", ["dangling symlink", "symlink", "fifo"])
def test_lock_file_must_be_a_regular_file(tmp_path, kind):
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / ".coax_utils-lock"
    target = tmp_path / "target"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        if kind == "symlink":
            target.write_bytes(b"someone's file")
        lock.symlink_to(target)
    with pytest.raises(ValueError, match="lock file"):
        utils.CheckpointManager(folder)
    # the link was not followed: nothing created or changed where it points
    if kind == "dangling symlink":
        assert not target.exists()
    elif kind == "symlink":
        assert target.read_bytes() == b"someone's file"
    assert os.listdir(folder) == [".coax_utils-lock"]


def test_restore_skips_a_newest_checkpoint_removed_from_the_folder(tmp_path):
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"]) as m:
        m.save(1, {"a": 1}, metrics={"r": 1.0})
        m.save(2, {"a": 2}, metrics={"r": 2.0})
        m.wait()
        os.unlink(tmp_path / ckpt(2))
        with pytest.warns(RuntimeWarning, match="step 2: its file is gone"):
            assert m.restore() == {"a": 1}
        assert m.all_steps() == [1] and m.best_step() == 1
        m.save(2, {"a": 22})  # without metrics: the old metrics of step 2 do not count
        m.wait()
        assert m.restore() == {"a": 22}
        assert m.best_step() == 1
    assert not (tmp_path / metrics_file(2)).exists()
    with utils.CheckpointManager(tmp_path, best_fn=lambda m: m["r"]) as m:
        assert m.all_steps() == [1, 2] and m.best_step() == 1


def test_folders_with_metrics_names_are_foreign(tmp_path):
    # a folder named like the metrics file of a complete step (5) or of no step (7) made
    # the folder impossible to open (IsADirectoryError from load or unlink)
    with utils.CheckpointManager(tmp_path, max_to_keep=1, background=False) as manager:
        manager.save(5, {"w": np.arange(3)})
    (tmp_path / metrics_file(5)).mkdir()
    (tmp_path / metrics_file(7)).mkdir()
    with utils.CheckpointManager(tmp_path, max_to_keep=1, best_fn=lambda m: m["r"]) as manager:
        assert manager.all_steps() == [5] and manager.best_step() is None
        manager.save(6, {"w": np.arange(4)})
        manager.wait()  # retention removed step 5 and left the folder of its name alone
        assert manager.all_steps() == [6]
        with pytest.raises(OSError):  # the metrics of step 7 cannot take a folder's name
            manager.save(7, {"w": np.arange(5)}, {"r": 1.0})
            manager.wait()
        assert manager.all_steps() == [6]
        np.testing.assert_array_equal(manager.restore()["w"], np.arange(4))
    assert (tmp_path / metrics_file(5)).is_dir() and (tmp_path / metrics_file(7)).is_dir()
    assert not (tmp_path / ckpt(5)).exists() and not (tmp_path / ckpt(7)).exists()
    with utils.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [6]


def test_saves_of_states_that_grow_shrink_and_change_keep_their_own_data(tmp_path):
    # each background save copies into the memory of the previous save's copies (once that
    # save is written): every checkpoint must still hold its own state, whatever the sizes
    rng = np.random.default_rng(0)
    states = [
        {"a": rng.random(300_000), "b": np.arange(10)},
        {"a": rng.random(600_000), "b": rng.integers(0, 9, (700, 300)).astype(np.int8)},
        {
            "a": rng.random(100_000).astype(np.float32),
            "f": np.asfortranarray(rng.random((300, 80))),  # copied into C order
            "v": rng.random(300_000)[::3],  # not contiguous
        },
        {"a": rng.random(600_000), "s": np.zeros(5, [("x", np.int16), ("y", np.float64)])},
        {"a": np.zeros((0, 3)), "u": rng.integers(0, 255, 2_000_001, dtype=np.uint8)},
    ]
    expected = [{k: v.copy() for k, v in s.items()} for s in states]
    with utils.CheckpointManager(tmp_path, max_to_keep=None) as m:
        for step, state in enumerate(states):
            m.save(step, state)
            for value in state.values():
                value[...] = 1  # overwritten as soon as save returns
        m.wait()
        for step, state in enumerate(expected):
            restored = m.restore(step)
            assert restored.keys() == state.keys()
            for key, value in state.items():
                np.testing.assert_array_equal(restored[key], value)
                assert restored[key].dtype == value.dtype and restored[key].shape == value.shape
