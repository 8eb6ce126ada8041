"""Real game footage from the Arcade Learning Environment: ``lwm data atari``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from lwm.data.codecs import PixelCodec
from lwm.data.convert import CODECS, frames_note, make_codec, stretch, write_latents  # (stretch: nothing cropped)
from lwm.data.manifest import existing_h5, index_directory
from lwm.utils.args import ArgumentParser, bounded, fraction, non_negative_int, positive_int
from lwm.utils.errors import DataError, refuse_first

SCREEN = (210, 160)
ALE_FPS = 60  # the emulator's frames per second


def _ale():
    try:
        import ale_py
        import ale_py.roms  # noqa: F401  (a submodule, not imported by the package)
    except ImportError:
        raise DataError("lwm data atari needs ale-py, an optional extra: pip install 'lwm[atari]'") from None
    return ale_py


def games() -> list[str]:
    """The game ids ale-py ships ROMs for."""
    return sorted(_ale().roms.get_all_rom_ids())


def record(game: str, seed: int, frames: int, frame_skip: int = 4, sticky: float = 0.75,
           hold: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Play ``game`` from a reset: ``(frames uint8 [F, 210, 160, 3], actions int64 [F])`` with ``F <= frames``
    (shorter at game over)."""
    ale_py, rng = _ale(), np.random.default_rng(seed)
    ale = ale_py.ALEInterface()
    ale.setLoggerMode(ale_py.LoggerMode.Error)
    ale.setInt("random_seed", int(seed % 2**31))
    ale.setFloat("repeat_action_probability", 0.0)  # the stickiness is ours, so the recorded action is the true one
    ale.setInt("frame_skip", 1)
    ale.loadROM(ale_py.roms.get_rom_path(game))  # a game of games(), as check_arguments made sure
    legal = list(ale.getMinimalActionSet())
    video, actions = np.empty((frames, *SCREEN, 3), dtype=np.uint8), np.empty(frames, dtype=np.int64)
    choice = int(rng.integers(len(legal)))
    for t in range(frames):
        video[t] = ale.getScreenRGB()
        if t % hold == 0 and t > 0 and rng.random() >= sticky:
            choice = int(rng.integers(len(legal)))
        actions[t] = legal[choice].value
        for _ in range(frame_skip):
            ale.act(legal[choice])
        if ale.game_over():
            return video[: t + 1], actions[: t + 1]
    return video, actions


def check_arguments(out_dir: str | Path, game_list: list[str], episodes: int, overwrite: bool = False) -> None:
    """Refuse the games and the folder in one line, before anything is recorded or loaded (the numbers: argparse)."""
    repeated = sorted({g for g in game_list if game_list.count(g) > 1})
    known = set(games())
    unknown = [g for g in game_list if g not in known]
    refuse_first(
        (f"--games: {', '.join(repeated)} named twice (each game is one world label)", bool(repeated)),
        (f"--games: unknown game(s) {', '.join(unknown)} (ale-py knows {len(known)}, e.g. pong, breakout)",
         bool(unknown)), error=DataError)
    if Path(out_dir).is_dir():
        existing_h5(Path(out_dir), {f"{game}_{i:03d}.h5" for game in game_list for i in range(episodes)},
                    ", which would join the manifest; record into another --out",
                    None if overwrite else "--overwrite replaces it, or record into another --out")


def make_dataset(out_dir: str | Path, game_list: list[str], episodes: int = 8, frames: int = 256, seed: int = 0,
                 frame_skip: int = 4, sticky: float = 0.75, codec=None, val_fraction: float = 0.125, log=print,
                 overwrite: bool = False) -> Path:
    """Record ``episodes`` per game into ``out_dir/<game>_NNN.h5`` and index them; returns the manifest path."""
    check_arguments(out_dir, game_list, episodes, overwrite)
    codec = codec or PixelCodec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for label, game in enumerate(game_list):
        for i in range(episodes):
            ep_seed = int(np.random.SeedSequence([seed, label, i]).generate_state(1)[0])
            video, actions = record(game, ep_seed, frames, frame_skip, sticky, hold=codec.frames_per_latent)
            target = out / f"{game}_{i:03d}.h5"
            clipped, shape = write_latents(target, codec, stretch(video, codec.size), actions, world_label=label,
                                           attrs={"game": game, "fps": ALE_FPS / frame_skip})
            note = f", {clipped} values clipped to [-1, 1] ({clipped / np.prod(shape):.2%})" if clipped else ""
            log(f"wrote {target} ({frames_note(codec, len(video))}, latents {shape}{note})")
    return index_directory(out, val_fraction=val_fraction, seed=seed).path


def main(argv: list[str]) -> int:
    """``lwm data atari --games G... --out DIR ...``."""
    parser = ArgumentParser(prog="lwm data atari", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--games", nargs="+", required=True, help="ALE game ids, e.g. pong breakout (world_label = position)")
    add("--out", required=True, help="output folder (h5 files and manifest.json)")
    add("--episodes", type=positive_int, default=8, help="episodes per game (default 8)")
    add("--frames", type=bounded(int, 2), default=256, help="frames per episode at most (default 256)")
    add("--seed", type=non_negative_int, default=0, help="seed of the episodes and the train/val split (default 0)")
    add("--frame-skip", type=positive_int, default=4, help="emulator frames per recorded frame (default 4)")
    add("--sticky", type=bounded(float, 0, 1), default=0.75, help="probability of repeating the previous action")
    add("--val-fraction", type=fraction, default=0.125, help="fraction of files in the val split (default 0.125)")
    add("--codec", default="pixel", choices=CODECS, help="pixel (128x128) or a VAE (needs --vae)")
    add("--vae", help="local folder with the VAE's diffusers weights")
    add("--size", type=int, help="frame size (default: 128 pixel, 512 VAEs)")
    add("--device", default="cpu", help="where a VAE runs")
    add("--overwrite", action="store_true", help="replace an earlier recording's files of these names in --out "
        "(default: refused)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    check_arguments(args.out, args.games, args.episodes, args.overwrite)  # before a VAE is loaded
    codec = make_codec(args.codec, args.vae, args.size, args.device)
    path = make_dataset(args.out, args.games, args.episodes, args.frames, args.seed, args.frame_skip, args.sticky,
                        codec, args.val_fraction, overwrite=args.overwrite)
    print(f"{path}: {args.episodes} episodes of {', '.join(args.games)} ({time.perf_counter() - start:.1f}s)")
    return 0
