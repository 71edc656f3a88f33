"""generate_gif on a custom rgb env and on CartPole."""

import logging
import os
import sys

import gymnasium
import numpy as np
import pytest
from PIL import Image, ImageSequence

from coax_utils import utils

COLOURS = np.array([[255, 0, 0], [0, 200, 0], [0, 0, 255], [250, 250, 250]], np.uint8)


class CounterEnv(gymnasium.Env):
    """Ends after ``length`` steps; frame t shows the step counter, so all frames differ."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, length=7, render_mode="rgb_array", size=(12, 20)):
        self.observation_space = gymnasium.spaces.Discrete(1000)
        self.action_space = gymnasium.spaces.Discrete(4)
        self.render_mode = render_mode
        self.length, self.size = length, size
        self.actions = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.actions = []
        return self.t, {}

    def step(self, action):
        self.actions.append(int(action))
        self.t += 1
        return self.t, 1.0, self.t >= self.length, False, {}

    def frame(self, t):
        h, w = self.size
        img = np.zeros((h, w, 3), np.uint8)
        img[:, :] = COLOURS[3]
        img[: h // 2, : t + 1] = COLOURS[t % 3]  # a bar that grows with t
        return img

    def render(self):
        return self.frame(self.t)


def read_gif(path):
    with Image.open(path) as im:
        frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]
        durations = []
        im.seek(0)
        for f in ImageSequence.Iterator(im):
            durations.append(f.info["duration"])
        return frames, durations, im.size


def test_custom_env_one_frame_per_step_plus_reset(tmp_path):
    env = CounterEnv(length=7)
    path = tmp_path / "new" / "folder" / "episode.gif"
    utils.generate_gif(env, str(path), duration=40)
    frames, durations, size = read_gif(path)
    assert size == (20, 12)
    assert len(frames) == 8  # reset frame + 7 steps, all distinct
    assert sum(durations) == 8 * 40
    for t, frame in enumerate(frames):  # few colours: the shared palette keeps them exact
        np.testing.assert_array_equal(frame, env.frame(t))


def test_policy_is_used_and_max_episode_steps_caps_the_episode(tmp_path):
    env = CounterEnv(length=100)
    seen = []

    def policy(s):
        seen.append(s)
        return 3

    utils.generate_gif(env, tmp_path / "capped.gif", policy=policy, max_episode_steps=5)
    frames, durations, _ = read_gif(tmp_path / "capped.gif")
    assert seen == [0, 1, 2, 3, 4] and env.actions == [3] * 5
    assert len(frames) == 6 and sum(durations) == 6 * 50


def test_random_actions_without_policy(tmp_path):
    env = CounterEnv(length=40)
    env.action_space.seed(0)
    utils.generate_gif(env, tmp_path / "random.gif")
    assert len(env.actions) == 40 and len(set(env.actions)) > 1


def test_resize_to_is_width_then_height(tmp_path):
    utils.generate_gif(CounterEnv(length=3), tmp_path / "small.gif", resize_to=(10, 6))
    frames, _, size = read_gif(tmp_path / "small.gif")
    assert size == (10, 6) and frames[0].shape == (6, 10, 3)


def test_cartpole(tmp_path):
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    env.reset(seed=0)
    env.action_space.seed(0)
    steps = []

    def policy(s):
        steps.append(s)
        return len(steps) % 2

    path = tmp_path / "cartpole.gif"
    utils.generate_gif(env, path, policy=policy, resize_to=(150, 100), duration=20)
    frames, durations, size = read_gif(path)
    assert size == (150, 100)
    # Pillow merges identical consecutive frames, adding their durations: the total counts
    assert sum(durations) == 20 * (len(steps) + 1)
    assert len(frames) > len(steps) // 2  # the cart moves, so most frames are distinct
    assert len(steps) == 500 or abs(steps[-1][2]) > 0.15  # the episode really ended


def test_env_without_rgb_frames_raises_runtime_error(tmp_path):
    with pytest.raises(RuntimeError, match="render_mode='rgb_array'"):
        utils.generate_gif(CounterEnv(render_mode=None), tmp_path / "x.gif")
    with pytest.raises(RuntimeError, match="render_mode='rgb_array'"):
        utils.generate_gif(gymnasium.make("CartPole-v1"), tmp_path / "x.gif")

    class NoFrames(CounterEnv):
        def render(self):
            return None

    with pytest.raises(RuntimeError, match="rgb_array frames.*NoneType"):
        utils.generate_gif(NoFrames(), tmp_path / "x.gif")
    assert not (tmp_path / "x.gif").exists()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"resize_to": (10,)}, TypeError),
        ({"resize_to": (10, 0)}, ValueError),
        ({"resize_to": (1.5, 2)}, TypeError),
        ({"duration": 0}, ValueError),
        ({"max_episode_steps": 0}, ValueError),
        ({"policy": 3}, TypeError),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error):
    env = CounterEnv()
    with pytest.raises(error):
        utils.generate_gif(env, tmp_path / "bad.gif", **kwargs)
    assert env.actions == []  # rejected before the env was touched


def test_progress_with_tqdm(tmp_path, capsys):
    utils.generate_gif(CounterEnv(length=5), tmp_path / "p.gif", progress=True)
    assert "generate_gif" in capsys.readouterr().err


def test_progress_by_default_only_for_long_episodes(tmp_path, capsys):
    utils.generate_gif(CounterEnv(length=5), tmp_path / "p.gif", max_episode_steps=1000)
    assert "generate_gif" not in capsys.readouterr().err
    utils.generate_gif(CounterEnv(length=5), tmp_path / "p.gif", max_episode_steps=1001)
    assert "generate_gif" in capsys.readouterr().err


def test_progress_falls_back_to_logging_without_tqdm(tmp_path, monkeypatch, caplog):
    for name in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with caplog.at_level(logging.INFO, logger="coax_utils.generate_gif"):
        utils.generate_gif(CounterEnv(length=20), tmp_path / "p.gif", progress=True)
    messages = [r.getMessage() for r in caplog.records]
    assert any("20 / " in m or "/ 10000 steps" in m or "recording" in m for m in messages)
    assert any("recorded episode (21 frames)" in m for m in messages)


class ShapeEnv(CounterEnv):
    """A CounterEnv whose frame t has shape ``shapes[t]`` (the last one repeats)."""

    def __init__(self, shapes, length=3):
        super().__init__(length=length)
        self.shapes = shapes

    def render(self):
        h, w = self.shapes[min(self.t, len(self.shapes) - 1)][:2]
        return np.resize(self.frame(self.t), (h, w, 3)).astype(np.uint8)


def test_a_frame_of_another_size_raises_instead_of_being_cropped(tmp_path):
    # PIL pasted later frames of another size into the first frame's canvas (cropped or
    # padded), silently
    path = tmp_path / "episode.gif"
    with pytest.raises(RuntimeError, match=r"after step 1 .*\(6, 8\).*\(4, 4\).*resize_to"):
        utils.generate_gif(ShapeEnv([(4, 4), (8, 6), (2, 2)]), str(path))
    assert not path.exists()
    utils.generate_gif(ShapeEnv([(4, 4), (8, 6), (2, 2)]), str(path), resize_to=(5, 3))
    frames, _, size = read_gif(path)
    assert size == (5, 3) and len(frames) == 4


def test_an_empty_frame_raises_runtime_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"empty frame of shape \[0, 0, 3\]"):
        utils.generate_gif(ShapeEnv([(0, 0)]), str(tmp_path / "episode.gif"))


@pytest.mark.requires(pillow="13.0")
def test_a_failed_save_leaves_the_earlier_file(tmp_path):
    path = tmp_path / "episode.gif"
    path.write_bytes(b"an earlier gif")
    with pytest.raises(OverflowError):  # the GIF format's 16-bit width
        utils.generate_gif(ShapeEnv([(1, 70000)]), str(path))
    assert path.read_bytes() == b"an earlier gif"
    assert os.listdir(tmp_path) == ["episode.gif"]
