"""A built-in synthetic world with known actions and known world factors: ``lwm data synth``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import h5py
import numpy as np

from lwm.data.codecs import PixelCodec
from lwm.data.convert import write_latents
from lwm.data.h5 import DataError
from lwm.data.manifest import existing_h5, index_directory, Manifest
from lwm.utils.args import ArgumentParser, bounded, fraction, non_negative_int, positive_int

SIZE = 128  # frame height and width in pixels at the default size
AGENT = 24  # agent side in pixels
AGENT_COLOUR = (255, 255, 255)  # unique in every frame
ACTIONS = ("stay", "up", "down", "left", "right")
MOVES = np.array([[0, 0], [-1, 0], [1, 0], [0, -1], [0, 1]], dtype=np.int64)  # action -> (dy, dx)
STICKY = 0.7  # probability of repeating the previous action
DISTRACTORS = 2
DISTRACTOR_RADIUS = 7
DISTRACTOR_COLOURS = ((225, 60, 50), (235, 190, 40), (40, 195, 210), (200, 80, 200))
frames_arg = bounded(int, 2)  # the argparse types of `lwm data synth` and `lwm demo`
size_arg = bounded(int, 16, multiple=16)  # every length scales by size/SIZE
distractors_arg = bounded(int, 0, len(DISTRACTOR_COLOURS))


@dataclass(frozen=True)
class World:
    name: str
    speed: int  # agent pixels per move (at SIZE)
    wrap: bool  # True: leaving one edge enters at the opposite one; False: walls (moves into them are never taken)
    background: str  # "flat", "checker", "hstripes" or "vstripes"
    colours: tuple[tuple[int, int, int], tuple[int, int, int]]  # the background's two colours


WORLDS = (
    World("navy, slow, walls", 8, False, "flat", ((25, 35, 80), (25, 35, 80))),
    World("green checker, fast, walls", 16, False, "checker", ((35, 75, 40), (65, 120, 60))),
    World("red stripes, slow, wrap", 8, True, "hstripes", ((100, 45, 35), (60, 25, 20))),
    World("grey bands, fast, wrap", 16, True, "vstripes", ((110, 110, 115), (70, 70, 75))),
)
K = len(WORLDS)


def scaled(length: int, size: int) -> int:
    """A length given at :data:`SIZE` in a world rendered at ``size`` (at least 1 pixel)."""
    return max(1, length * size // SIZE)


@lru_cache(maxsize=None)
def background(world: int, size: int = SIZE) -> np.ndarray:
    """The world's background, ``uint8 [size, size, 3]`` (read-only)."""
    w = WORLDS[world]
    yy, xx = np.mgrid[0:size, 0:size]
    cell, stripe = scaled(32, size), scaled(16, size)
    second = {"flat": np.zeros((size, size), dtype=bool), "checker": ((yy // cell) + (xx // cell)) % 2 == 1,
              "hstripes": (yy // stripe) % 2 == 1, "vstripes": (xx // stripe) % 2 == 1}[w.background]
    img = np.where(second[..., None], np.array(w.colours[1], np.uint8), np.array(w.colours[0], np.uint8))
    img.flags.writeable = False
    return img


def blocked(pos: np.ndarray, action: int, world: World, size: int = SIZE) -> bool:
    """Would ``action`` push the agent at ``pos`` (y, x) through a wall?"""
    new = step(pos, action, world, size)
    return not world.wrap and bool((new < 0).any() or (new > size - scaled(AGENT, size)).any())


def step(pos: np.ndarray, action: int, world: World, size: int = SIZE) -> np.ndarray:
    """The agent's position after ``action`` (never blocked: the policy avoids walls)."""
    new = pos + scaled(world.speed, size) * MOVES[action]
    return new % size if world.wrap else new


def episode_seed(seed: int, index: int) -> int:
    """The seed of episode ``index`` of a data set made with ``seed``."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def simulate(seed: int, frames: int, world: int | None = None, worlds: int = K, size: int = SIZE,
             distractors: int = DISTRACTORS):
    """The episode's state: ``(world, agent [T, 2], actions [T], discs [D, T, 2], colours [D])``."""
    rng = np.random.default_rng(seed)
    drawn = int(rng.integers(worlds))  # always drawn, so the streams below do not depend on ``world``
    world = drawn if world is None else int(world)
    w = WORLDS[world]
    agent_side, radius, grid = scaled(AGENT, size), scaled(DISTRACTOR_RADIUS, size), scaled(8, size)
    start = rng.integers(0, (size - agent_side) // grid + 1, size=2) * grid  # on the grid of both speeds
    d_pos = rng.integers(0, size - 2 * radius, size=(distractors, 2))
    d_vel = np.maximum(1, rng.integers(2, 4, size=(distractors, 2)) * size // SIZE) * rng.choice([-1, 1], size=(distractors, 2))
    d_col = rng.permutation(len(DISTRACTOR_COLOURS))[:distractors]
    repeat = rng.random(frames) < STICKY
    choice = rng.integers(0, len(ACTIONS), size=frames)
    redraw = rng.random(frames)
    agent, actions = np.empty((frames, 2), dtype=np.int64), np.empty(frames, dtype=np.int64)
    pos, prev = start.astype(np.int64), int(choice[0])
    for t in range(frames):
        agent[t] = pos
        a = prev if (t > 0 and repeat[t]) else int(choice[t])
        if blocked(pos, a, w, size):
            allowed = [b for b in range(len(ACTIONS)) if not blocked(pos, b, w, size)]
            a = allowed[int(redraw[t] * len(allowed))]
        actions[t] = prev = a
        pos = step(pos, a, w, size)
    discs = np.empty((distractors, frames, 2), dtype=np.int64)
    lo, hi = 0, size - 2 * radius  # top-left corner of the disc's box
    p, v = d_pos.copy(), d_vel.copy()
    for t in range(frames):
        discs[:, t] = p
        p = p + v
        over, under = p > hi, p < lo
        p = np.where(over, 2 * hi - p, np.where(under, 2 * lo - p, p))
        v = np.where(over | under, -v, v)
    return world, agent, actions, discs, d_col


def draw(world: int, agent: np.ndarray, discs: np.ndarray, colours: np.ndarray, size: int = SIZE,
         look_alike: bool = False) -> np.ndarray:
    """Render all frames at once: ``uint8 [T, size, size, 3]`` (``look_alike``: on the first world's background)."""
    T = agent.shape[0]
    frames = np.broadcast_to(background(0 if look_alike else world, size), (T, size, size, 3)).copy()
    grid = np.arange(size)
    r = scaled(DISTRACTOR_RADIUS, size)
    for d in range(discs.shape[0]):
        cy = discs[d, :, 0, None, None] + r - 0.5  # disc centres [T, 1, 1]
        cx = discs[d, :, 1, None, None] + r - 0.5
        mask = (grid[None, :, None] - cy) ** 2 + (grid[None, None, :] - cx) ** 2 <= r * r  # [T, S, S]
        frames[mask] = DISTRACTOR_COLOURS[colours[d]]
    side = scaled(AGENT, size)
    rows = (grid[None, :] - agent[:, :1]) % size < side  # [T, S]: cyclic, so a wrapping agent is split across edges
    cols = (grid[None, :] - agent[:, 1:]) % size < side
    frames[rows[:, :, None] & cols[:, None, :]] = AGENT_COLOUR
    return frames


def render_episode(seed: int, frames: int, world: int | None = None, worlds: int = K, size: int = SIZE,
                   distractors: int = DISTRACTORS, look_alike: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """``(frames uint8 [T, size, size, 3], actions int64 [T], world_label)`` of the episode with this seed."""
    world, agent, actions, discs, colours = simulate(seed, frames, world, worlds, size, distractors)
    return draw(world, agent, discs, colours, size, look_alike), actions, world


SETTINGS_ATTR = "synth"  # JSON of the settings an episode file was made with


def make_dataset(out_dir: str | Path, episodes: int = 64, frames: int = 32, seed: int = 0, val_fraction: float = 0.125,
                 worlds: int = K, size: int = SIZE, distractors: int = DISTRACTORS, overwrite: bool = False,
                 look_alike: bool = False,
                 remedy: str = "--overwrite replaces it, or synthesise into another folder") -> Path:
    """Write ``episodes`` files ``out_dir/ep_XXXX.h5`` (``latents`` float16 through the pixel codec, ``actions``
    int64 ``[T]``, attributes ``world_label``, ``codec`` and ``synth``: the settings) and index them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"ep_{i:04d}.h5" for i in range(episodes)]
    existing_h5(out, set(names), "; synthesise into an empty folder")
    settings = {"seed": seed, "frames": frames, "size": size, "worlds": worlds, "distractors": distractors,
                **({"look_alike": True} if look_alike else {})}
    if not overwrite:  # never replace the files of another data set without being asked
        existing = [i for i in range(episodes) if (out / names[i]).exists()]
        for i in existing:
            try:
                with h5py.File(out / names[i], "r") as f:
                    made = json.loads(f.attrs[SETTINGS_ATTR])
            except (OSError, KeyError, ValueError, TypeError):
                made = None  # no record of its settings
            if made != {**settings, "episode": i}:
                was = ("no record of its settings" if made is None else
                       ", ".join(f"{k} {made.get(k)}" for k in settings if made.get(k) != settings[k]))
                now = ", ".join(f"{k} {v}" for k, v in settings.items() if made is None or made.get(k) != v)
                raise DataError(f"{out / names[i]}: exists, made with {was} (this run: {now}); {remedy}")
        if not existing and (out / "manifest.json").exists():
            raise DataError(f"{out / 'manifest.json'}: exists; {remedy}")
    codec = PixelCodec(size=size)
    for i in range(episodes):
        video, actions, label = render_episode(episode_seed(seed, i), frames, i % worlds, size=size,
                                               distractors=distractors, look_alike=look_alike)
        write_latents(out / names[i], codec, video, actions, world_label=label,
                      attrs={SETTINGS_ATTR: json.dumps({**settings, "episode": i})})
    return index_directory(out, val_fraction=val_fraction, seed=seed).path


def main(argv: list[str]) -> int:
    """``lwm data synth --out DIR ...``."""
    parser = ArgumentParser(prog="lwm data synth", description="Write a synthetic data set with known actions and "
                            "worlds (an agent square moved by 5 actions in K worlds of different backgrounds, speeds "
                            "and edges) as pixel-codec h5 files and a manifest.")
    add = parser.add_argument
    add("--out", required=True, help="output folder (ep_XXXX.h5 files and manifest.json)")
    add("--episodes", type=positive_int, default=64, help="number of episodes, a file each (default 64)")
    add("--frames", type=frames_arg, default=32, help="frames per episode (default 32)")
    add("--seed", type=non_negative_int, default=0, help="data set seed (default 0)")
    add("--val-fraction", type=fraction, default=0.125, help="fraction of episodes for validation")
    add("--worlds", type=bounded(int, 1, K), default=K, help=f"number of worlds used, 1..{K} (default {K})")
    add("--size", type=size_arg, default=SIZE,
        help=f"frame size in pixels, a multiple of 16 (default {SIZE}; latents are size/2)")
    add("--distractors", type=distractors_arg, default=DISTRACTORS,
        help=f"drifting discs, 0..4 (default {DISTRACTORS})")
    add("--look-alike", action="store_true",
        help="every world on the same background: only the dynamics (speed, edges) tell them apart")
    add("--overwrite", action="store_true", help="replace episode files (and the manifest) in --out made with other "
        "settings (default: refused; the same settings again rewrite the same files)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = make_dataset(args.out, args.episodes, args.frames, args.seed, args.val_fraction, args.worlds, args.size,
                        args.distractors, overwrite=args.overwrite, look_alike=args.look_alike)
    manifest = Manifest.load(path)
    print(f"{path}: {args.episodes} synthetic episodes x {args.frames} frames in {args.worlds} worlds "
          f"({len(manifest.split('train'))} train, {len(manifest.split('val'))} val), "
          f"{time.perf_counter() - start:.1f}s")
    return 0
