"""States read from disk whose numbers would make a restore crash, hang or allocate in
proportion to a number rather than to the bytes of the file: each is refused with a
ValueError before anything is built."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from coax_utils import utils
from coax_utils._checks import checked_dtype
from coax_utils._numpy_random import bit_generator_from_state, random_state_from_state
from coax_utils.replay import FrameStackReplayBuffer, NStep, SimpleReplayBuffer, TransitionBatch
from coax_utils.utils._checkpoint import container as _ckpt_container


def frames_batch(n, k=2):
    s = np.arange(n * k * 4, dtype=np.uint8).reshape(n, k, 2, 2)
    return TransitionBatch(
        S=s,
        A=np.zeros(n, np.int64),
        logP=np.zeros(n, np.float32),
        Rn=np.ones(n, np.float32),
        In=np.full(n, 0.9, np.float32),
        S_next=s + 1,
        W=np.ones(n, np.float32),
    )


def small_batch(n):
    return frames_batch(n).replace(
        S=np.zeros((n, 3), np.float32), S_next=np.ones((n, 3), np.float32)
    )


def test_only_plain_dtype_descriptors_reach_numpy():
    for desc in ["<f4", "|u1", "|b1", "<i8", ">f8", "<c8", "<V2"]:
        assert checked_dtype(desc, "dtype") == np.dtype(desc)
    # numpy's parser crashes the process on the first (SIGFPE), raises SyntaxError on others
    for desc in ["M8[Y/0]", "(a,)i4", ",", "a1", "|O", "f", "<f4,<f4", "U0", "|V0", 4, None]:
        with pytest.raises(ValueError, match="plain dtype"):
            checked_dtype(desc, "dtype")
    buffer = SimpleReplayBuffer(8, random_seed=0)
    buffer.add(small_batch(5))
    state = buffer.__checkpoint_state__()
    packed = next(spec for spec in state["leaves"] if isinstance(spec, dict))
    packed["dtype"] = "M8[Y/0]"
    with pytest.raises(ValueError, match="invalid dtype"):
        SimpleReplayBuffer.__checkpoint_restore__(state)


def test_zero_size_text_dtypes_are_refused():
    for desc in ["|S0", "<U0"]:  # a billion elements of nothing: no bytes in the file
        structure = {"root": ["a", 0, desc, [10**9], "C", 0], "buffers": [[2, 0, 0]], "pickled": []}
        segments = [json.dumps(structure).encode(), b"", b""]
        data = _ckpt_container.container_bytes(2, {}, [[memoryview(x)] for x in segments], 1)
        assert len(data) < 1000
        with pytest.raises(ValueError, match="not an allowed plain-data dtype"):
            utils.loads(data, safe=True)


def test_nstep_n_is_bounded():
    with pytest.raises(ValueError, match="n must be"):
        NStep(n=2**21, gamma=0.9)
    state = NStep(n=3, gamma=0.9).__checkpoint_state__()
    state["n"] = 10**8  # would allocate 800 MB of discount powers
    with pytest.raises(ValueError, match="n must be"):
        NStep.__checkpoint_restore__(state)


def test_frames_without_bytes_are_refused():
    buffer = FrameStackReplayBuffer(capacity=4, stack_size=2, random_seed=0)
    buffer.add(frames_batch(3))
    state = buffer.__checkpoint_state__()
    state["frame_capacity"] = 10**8
    state["frames"] = np.zeros((10**8, 0), np.uint8)  # no bytes, yet sized by a number
    with pytest.raises(ValueError, match="non-empty rows"):
        FrameStackReplayBuffer.__checkpoint_restore__(state)


def test_noise_seeds_and_broadcasts_are_bounded():
    noise = utils.OrnsteinUhlenbeckNoise(mu=np.zeros(3), random_seed=1)
    state = noise.__checkpoint_state__()
    with pytest.raises(ValueError, match="random_seed"):
        utils.OrnsteinUhlenbeckNoise.__checkpoint_restore__({**state, "random_seed": 2**200})
    wide = {**state, "mu": 0.0, "noise": None}
    wide["min_value"], wide["max_value"] = np.zeros((3000, 1)), np.ones((1, 3000))
    with pytest.raises(ValueError, match="broadcast to a shape larger"):
        utils.OrnsteinUhlenbeckNoise.__checkpoint_restore__(wide)
    restored = utils.OrnsteinUhlenbeckNoise.__checkpoint_restore__(copy.deepcopy(state))
    np.testing.assert_array_equal(restored(np.zeros(3)), noise(np.zeros(3)))


def test_generators_that_seeding_cannot_produce_are_refused(tmp_path):
    state = np.random.MT19937(0).state
    state["state"]["key"] = np.zeros(624, np.uint32)  # returns 0 forever: some draws never end
    with pytest.raises(ValueError, match="all zeros"):
        bit_generator_from_state("MT19937", state)
    legacy = np.random.RandomState(0).get_state(legacy=False)
    legacy["state"]["key"][:] = 0
    with pytest.raises(ValueError, match="all zeros"):
        random_state_from_state(legacy)
    # the same check guards a replay folder's generator
    buffer = SimpleReplayBuffer(8, random_seed=0)
    buffer.add(small_batch(5))
    buffer.save(tmp_path / "buf")
    meta = utils.load(tmp_path / "buf" / "meta.lz4", safe=True)
    meta["generators"]["rng"] = {"name": "MT19937", "state": state}
    utils.dump(meta, tmp_path / "buf" / "meta.lz4")
    with pytest.raises(ValueError, match="all zeros"):
        SimpleReplayBuffer.load(tmp_path / "buf")


def test_a_reducer_name_never_imports_a_module():
    code = textwrap.dedent(
        """
        import sys
        from coax_utils.utils import SegmentTree
        import numpy as np
        state = SegmentTree(4, np.add, 0.0).__checkpoint_state__()
        for name in ("matlib", "f2py", "testing", "ctypeslib"):
            try:
                SegmentTree.__checkpoint_restore__({**state, "reducer": name})
            except ValueError as e:
                assert "not a NumPy ufunc" in str(e)
            else:
                raise AssertionError(name)
        print(sorted(m for m in sys.modules if m.startswith(("numpy.matlib", "numpy.f2py"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_a_random_state_whose_cached_gaussian_is_not_a_normal_draw_is_refused():
    rs = np.random.RandomState(3)
    rs.standard_normal()  # one value of the pair drawn, the other cached
    state = rs.get_state(legacy=False)
    assert state["has_gauss"] == 1
    again = random_state_from_state(copy.deepcopy(state))
    assert again.standard_normal() == rs.standard_normal()
    for bad in (float("nan"), float("inf"), -float("inf"), 1e300):
        with pytest.raises(ValueError, match="gauss must be a finite float"):
            random_state_from_state({**state, "gauss": bad})
    # through a checkpoint: the file is damaged, nothing draws a NaN
    source = _ckpt_container.MemorySource(memoryview(utils.dumps({"rng": rs})))
    container = _ckpt_container.parse(source, 2)
    segments = _ckpt_container.read_segments(source, container, [0, 1, 2])
    structure = re.sub(rb'\["gauss",[^\]]*\]', b'["gauss",NaN]', segments[0].tobytes())
    assert structure != segments[0].tobytes()
    parts = [structure, segments[1].tobytes(), segments[2].tobytes()]
    forged = _ckpt_container.container_bytes(2, {}, [[memoryview(p)] for p in parts], 1)
    with pytest.raises(utils.CheckpointDamagedError, match="gauss"):
        utils.loads(forged, safe=True)
