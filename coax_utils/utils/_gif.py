"""Record one episode of a gymnasium env as an animated GIF."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from coax_utils._checks import check_int
from coax_utils._files import atomic_write
from coax_utils.utils._envs import get_env_attr

__all__ = ["generate_gif"]

logger = logging.getLogger("coax_utils.generate_gif")

#: episodes with a step budget above this report progress by default
_PROGRESS_MIN_STEPS = 1000
#: largest per-channel error accepted when mapping a frame onto the shared palette
_TOLERANCE = 40


def _frame(env: Any, what: str) -> np.ndarray:
    frame = env.render()
    if isinstance(frame, list) and frame:  # a list of frames rendered since the last call
        frame = frame[-1]
    arr = np.asarray(frame) if isinstance(frame, np.ndarray) else None
    if (
        arr is None
        or arr.dtype != np.uint8
        or not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4)))
    ):
        got = type(frame).__name__ if arr is None else f"array {arr.dtype}{list(arr.shape)}"
    elif arr.size == 0:
        got = f"an empty frame of shape {list(arr.shape)}"
    else:
        return arr
    raise RuntimeError(
        f"generate_gif needs env.render() to return rgb_array frames (non-empty uint8 arrays "
        f"of shape (height, width, 3)), but {what} it returned {got}"
    )


class _Quantizer:
    """Map RGB frames to a shared 256-colour palette, recomputing it only when needed.

    The palette comes from the first frame. Each later frame is mapped onto it (a cheap
    nearest-colour lookup); only when some pixel then ends up more than
    ``_TOLERANCE`` away from its colour in a channel (a colour the palette lacks), that frame
    is quantized from scratch and its palette becomes the shared one.
    """

    def __init__(self) -> None:
        self._palette: Image.Image | None = None
        self._colours = np.zeros((0, 3), np.uint8)

    def __call__(self, img: Image.Image) -> Image.Image:
        if self._palette is not None:
            q = img.quantize(palette=self._palette, dither=Image.Dither.NONE)
            arr = np.asarray(img)
            approx = self._colours[np.asarray(q)]
            if np.array_equal(approx, arr):
                return q
            if np.abs(approx.astype(np.int16) - arr).max() <= _TOLERANCE:
                return q
        q = img.quantize(256, method=Image.Quantize.MEDIANCUT)
        self._palette = q
        colours = np.asarray(q.getpalette(), np.uint8).reshape(-1, 3)
        self._colours = np.concatenate([colours, np.zeros((256 - len(colours), 3), np.uint8)])
        return q


class _Progress:
    """tqdm when it is installed, else a log line every 10% of the step budget."""

    def __init__(self, total: int, enabled: bool, filepath: str) -> None:
        self.total, self.enabled, self.n = total, enabled, 0
        self._bar = None
        self._every = max(1, total // 10)
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                logger.info("recording up to %d steps to %s", total, filepath)
            else:
                self._bar = tqdm(total=total, desc="generate_gif", unit="step", leave=False)

    def update(self) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        elif self.n % self._every == 0:
            logger.info("generate_gif: %d / %d steps", self.n, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def generate_gif(
    env: Any,
    filepath: str | os.PathLike,
    policy: Callable[[Any], Any] | None = None,
    resize_to: tuple[int, int] | None = None,
    duration: float = 50,
    max_episode_steps: int | None = None,
    *,
    progress: bool | None = None,
) -> None:
    """Store a gif from the episode frames.

    Runs one episode: the frame after ``env.reset()`` plus one frame after every step, until
    the episode terminates or is truncated, or after ``max_episode_steps`` steps. Frames are
    mapped onto a shared 256-colour palette, computed from the first frame and recomputed
    only from a frame with colours the palette lacks (more than 40 off in a channel), so
    that the colours of rendered envs stay exact while most frames cost one palette lookup
    instead of a full quantization. Folders in ``filepath`` are created.

    Parameters
    ----------
    env : gymnasium environment
        The environment to record from, made with ``render_mode="rgb_array"``.
    filepath : str
        Location of the output gif file.
    policy : callable, optional
        A policy objects that is used to pick actions: ``a = policy(s)``. If left
        unspecified, we'll just take random actions instead, i.e.
        ``a = env.action_space.sample()``.
    resize_to : tuple of ints, optional
        The size of the output frames, ``(width, height)``. Notice the ordering: first
        **width**, then **height**. This is the convention PIL uses.
    duration : float, optional
        Time between frames in the animated gif, in milliseconds.
    max_episode_steps : int, optional
        The maximum number of step in the episode. If left unspecified, we'll attempt to get
        the value from ``env.spec.max_episode_steps`` and if that fails we default to 10000.
    progress : bool, optional
        Report progress (a tqdm bar, or log lines on the ``coax_utils.generate_gif`` logger
        when tqdm is missing). By default on when the step budget exceeds 1000 steps.

    Raises
    ------
    RuntimeError
        When the env does not render ``rgb_array`` frames (non-empty uint8 arrays), or (without
        ``resize_to``) a frame's size differs from the first frame's.
    TypeError, ValueError
        For malformed ``resize_to``, ``duration`` or ``max_episode_steps``.
    """
    if resize_to is not None:
        if not (
            isinstance(resize_to, (tuple, list))
            and len(resize_to) == 2
            and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in resize_to)
        ):
            raise TypeError(f"expected a tuple of two ints, resize_to=(w, h), got {resize_to!r}")
        if min(resize_to) <= 0:
            raise ValueError(f"resize_to=(w, h) must be positive, got {resize_to!r}")
        resize_to = (int(resize_to[0]), int(resize_to[1]))
    if isinstance(duration, bool) or not isinstance(duration, (int, float, np.number)):
        raise TypeError(f"duration must be a positive number of milliseconds, got {duration!r}")
    if not duration > 0:
        raise ValueError(f"duration must be a positive number of milliseconds, got {duration!r}")
    if max_episode_steps is None:
        spec = getattr(env, "spec", None)
        max_episode_steps = getattr(spec, "max_episode_steps", None) or 10000
    max_episode_steps = check_int(max_episode_steps, "max_episode_steps", low=1)
    if policy is not None and not callable(policy):
        raise TypeError(f"policy must be callable, got {policy!r}")
    render_mode = get_env_attr(env, "render_mode", default=None)
    if render_mode != "rgb_array":
        raise RuntimeError(
            f"generate_gif needs an env that renders rgb_array frames, but env.render_mode is "
            f"{render_mode!r}; make the env with render_mode='rgb_array'"
        )
    if progress is None:
        progress = max_episode_steps > _PROGRESS_MIN_STEPS

    quantize = _Quantizer()

    def to_image(arr: np.ndarray, what: str) -> Image.Image:
        img = Image.fromarray(arr).convert("RGB")
        if resize_to is not None and img.size != resize_to:
            img = img.resize(resize_to)
        elif frames and img.size != frames[0].size:  # a GIF's frames share one size
            raise RuntimeError(
                f"{what} env.render() returned a frame of (width, height) {img.size}, but the "
                f"first frame was {frames[0].size}; pass resize_to=(w, h) for envs whose frame "
                f"size changes"
            )
        return quantize(img)

    frames: list[Image.Image] = []
    s, _ = env.reset()
    frames.append(to_image(_frame(env, "after reset"), "after reset"))
    bar = _Progress(int(max_episode_steps), bool(progress), os.fspath(filepath))
    try:
        for t in range(int(max_episode_steps)):
            a = env.action_space.sample() if policy is None else policy(s)
            s, _, terminated, truncated, _ = env.step(a)
            frames.append(to_image(_frame(env, "after a step"), f"after step {t + 1}"))
            bar.update()
            if terminated or truncated:
                break
    finally:
        bar.close()

    gif = io.BytesIO()
    frames[0].save(
        gif, format="GIF", save_all=True, append_images=frames[1:], duration=duration, loop=0
    )
    # written atomically: a failure leaves an earlier file at filepath as it was
    data = gif.getbuffer()
    atomic_write(os.fspath(filepath), lambda place: place(0, data))
    logger.info("recorded episode (%d frames) to: %s", len(frames), os.fspath(filepath))
