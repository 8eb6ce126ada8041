"""The ``lwm`` command."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import time
import warnings
from typing import Any

from lwm.utils.args import ArgumentParser, bounded, fraction, frame_rate, non_negative_int, positive_int
from lwm.utils.errors import LwmError, NonFiniteLossError

LIGHTNING_VERBS = ("fit", "validate", "test", "predict")
TILING = ("{} in overlapping spatial tiles (diffusers' enable_tiling): far less GPU memory at 512 px and up, faint "
          "seams possible")
GPU_HINT = (" (trainer.accelerator=gpu, as in configs/base.yaml, ddp.yaml and deepspeed.yaml, but this machine has no "
            "GPU: use configs/tiny.yaml, or this config's model on the CPU with --trainer.accelerator=cpu "
            "--trainer.precision=32-true --model.compile=false: compiling takes many minutes on a CPU, and bf16 is "
            "emulated on one without bf16 instructions)")  # what to do about Lightning's error, which does not say


def _data_index(args: argparse.Namespace) -> int:
    from lwm.data.manifest import index_directory, val_count

    manifest = index_directory(args.directory, out=args.out, val_fraction=args.val_fraction, seed=args.seed,
                               tolerance=args.tolerance, resplit=args.resplit)
    n_train, n_val = len(manifest.split("train")), len(manifest.split("val"))
    asked = val_count(args.val_fraction, len(manifest.entries))
    frames = sum(e.frames for e in manifest.entries)
    print(f"{manifest.path}: {len(manifest.entries)} files checked ({n_train} train, {n_val} val), {frames} frames "
          f"of [{manifest.channels}, {manifest.height}, {manifest.width}]")
    if n_val != asked:  # the files listed before kept their split
        print(f"  the files the manifest listed before kept their split (--val-fraction {args.val_fraction} would "
              f"put {asked} in val): --resplit draws every file's again")
    return 0


def _data_encode(args: argparse.Namespace) -> int:
    import torch

    from lwm.data.convert import encode_videos

    encode_videos(args.videos, args.out, args.codec, args.stride, args.vae, args.size, args.device,
                  getattr(torch, args.dtype), segment=args.segment, tiling=args.vae_tiling, overwrite=args.overwrite)
    return 0


def _data_decode(args: argparse.Namespace) -> int:
    from lwm.data.convert import decode_file

    path = decode_file(args.file, args.out, args.fps, args.vae, args.vae_tiling, device=args.device,
                       overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def _lightning(verb: str, rest: list[str]) -> int:
    from unittest import mock

    import rich

    from lwm.callbacks.slurm import interrupted_by
    from lwm.cli.lightning_cli import LwmCLI

    if verb != "fit":  # evaluating a checkpoint needs none of its callbacks' states
        warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used to create")
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if not sys.stdout.isatty():  # a log, SLURM's output: 200 columns for Lightning's results table (rich: 80)
            stack.enter_context(mock.patch.dict(os.environ, {"COLUMNS": "200"}))
            rich.reconfigure(width=200)
            stack.callback(rich.reconfigure)
        trainer = getattr(LwmCLI(args=[verb, *rest]), "trainer", None)
    signum = interrupted_by(trainer)
    stopped = any(getattr(c, "preempted", False) for c in getattr(trainer, "callbacks", []))  # a signal: saved
    if verb == "fit" and trainer is not None and trainer.is_global_zero and not signum and not stopped:
        from lwm.callbacks.progress import fit_summary

        print(fit_summary(trainer, time.monotonic() - start))
    return 128 + signum if signum else 0  # a fit stopped by Ctrl-C or kill


_OWN_PARSERS = {  # verbs that parse their own arguments: (the module whose main(argv) runs it, its help)
    "overfit": ("lwm.cli.overfit", "the overfit test: one window, many steps"),
    "codes": ("lwm.cli.codes", "code dictionaries of a checkpoint's encoders"),
    "generate": ("lwm.cli.generate", "play a trained model forward, write the video"),
    "play": ("lwm.cli.play", "play the learned world on a local web page, with the keyboard"),
    "plot": ("lwm.cli.plot", "PNG figures of a run from RUN_DIR/metrics.csv"),
    "demo": ("lwm.cli.demo", "the main job on a CPU: synthetic world, fit, validate, videos, report"),
    "resume-info": ("lwm.cli.resume_info", "RUN_DIR and the checkpoint that continues it (for the SLURM scripts)"),
    "data synth": ("lwm.data.synth", "make the built-in synthetic world"),
    "data atari": ("lwm.data.atari", "record Atari games (ale-py) with true actions, game id as world label"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="lwm", description="Latent world models from video latents.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    for verb in LIGHTNING_VERBS:  # (main runs them and _OWN_PARSERS: here for --help)
        verbs.add_parser(verb, add_help=False, help=f"Lightning {verb} (`lwm {verb} --help`): --config configs/X.yaml "
                                                    f"[overrides]")
    data = verbs.add_parser("data", help="make, check or convert data").add_subparsers(dest="data_verb", required=True)
    index = data.add_parser("index", help="check every h5 file under DIR and write the manifest")
    index.add_argument("directory", help="folder searched recursively for *.h5 / *.hdf5")
    index.add_argument("--out", help="manifest path (default: DIR/manifest.json)")
    index.add_argument("--val-fraction", type=fraction, default=0.1, help="fraction of files in the val split")
    index.add_argument("--seed", type=non_negative_int, default=0, help="seed of the train/val split")
    index.add_argument("--tolerance", type=bounded(float, 0), default=1e-3, help="allowed excess over [-1, 1]")
    index.add_argument("--resplit", action="store_true", help="draw every file's split again (default: files the "
                       "manifest already lists keep theirs)")
    index.set_defaults(func=_data_index)

    encode = data.add_parser("encode", help="encode videos to h5 latent files through a codec")
    encode.add_argument("videos", nargs="+", help="video files (anything PyAV reads)")
    encode.add_argument("--codec", default="pixel", help="pixel (built in, 128x128 RGB) or a diffusers video VAE "
                        "(needs --vae)")
    encode.add_argument("--out", required=True, help="folder for the h5 files (then `lwm data index` it)")
    encode.add_argument("--stride", type=positive_int, default=1, help="keep every N-th frame")
    encode.add_argument("--segment", type=positive_int, metavar="N", help="frames per h5 file (NAME_0000.h5, ...; "
                        "for VAE codecs 1 + 4k, e.g. 257): long videos in bounded memory (default: one file per video)")
    encode.add_argument("--vae", help="local folder with the VAE's diffusers weights (or a pipeline with vae/)")
    encode.add_argument("--size", type=int, help="frame size in pixels (default: 128 pixel, 512 VAEs)")
    encode.add_argument("--device", default="cpu", help="where the VAE runs (e.g. cuda)")
    encode.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="VAE dtype")
    encode.add_argument("--vae-tiling", action="store_true", help=TILING.format("encode"))
    encode.add_argument("--overwrite", action="store_true", help="replace the h5 files of each video's name already "
                        "in --out (NAME.h5, NAME_NNNN.h5) once the video is encoded (a failed encode leaves them); "
                        "without it they are refused")
    encode.set_defaults(func=_data_encode)

    decode = data.add_parser("decode", help="decode an h5 latent file to a video through its codec")
    decode.add_argument("file", help="h5 file with a `codec` attribute")
    decode.add_argument("--out", required=True, help="video path (.mp4 or .gif)")
    decode.add_argument("--fps", type=frame_rate, help="frame rate (default: the file's fps, which `lwm data "
                        "encode` records, else 8)")
    decode.add_argument("--vae", help="the VAE's local diffusers weights, for files encoded with a VAE")
    decode.add_argument("--vae-tiling", action="store_true", help=TILING.format("decode"))
    decode.add_argument("--device", default="cpu", help="where the VAE runs")
    decode.add_argument("--overwrite", action="store_true", help="replace an existing --out (default: refused)")
    decode.set_defaults(func=_data_decode)

    for verb, (_, text) in _OWN_PARSERS.items():
        (data if verb.startswith("data ") else verbs).add_parser(verb.split()[-1], add_help=False,
                                                                 help=f"{text} (`lwm {verb} --help`)")
    return parser


class _OutlivesItsReader:
    """A text stream (stdout, stderr) whose writes outlive its reader (`lwm fit | head`): then /dev/null."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._guarded(self._stream.write, text) or len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, method: Any, *args: Any) -> Any:
        try:
            return method(*args)
        except BrokenPipeError:
            with contextlib.suppress(OSError, ValueError, AttributeError):  # (no file descriptor: nothing to point)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())
                os.close(devnull)
                self._stream.flush()  # what the closed pipe did not take, to /dev/null
            return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _OutlivesItsReader(sys.stdout), _OutlivesItsReader(sys.stderr)
    # a warning as one line (Python's default adds the source line that raised it)
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: \
        f"{filename}:{lineno}: {category.__name__}: {message}\n"
    own = next((v for v in (" ".join(argv[:2]), *argv[:1]) if v in _OWN_PARSERS), None)
    try:
        if argv and argv[0] in LIGHTNING_VERBS:
            return _lightning(argv[0], argv[1:])
        if own is not None:
            return importlib.import_module(_OWN_PARSERS[own][0]).main(argv[len(own.split()):]) or 0
        args = build_parser().parse_args(argv)
        return args.func(args)
    except BaseException as e:
        code = _reported(e)
        if code is None:
            raise
        return code
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError):  # (a closed stream)
                stream.flush()
        sys.stdout, sys.stderr = streams


def _reported(e: BaseException) -> int | None:
    """The exit code of an exception lwm reports in a line of its own, without a traceback (None: not one)."""
    if isinstance(e, KeyboardInterrupt):
        print("\nstopped by Ctrl-C (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    if isinstance(e, SystemExit):  # Lightning's exit 1 after a Ctrl-C it caught
        from lwm.callbacks.slurm import hard_stopped

        return 128 + signal.SIGINT if e.code == 1 and hard_stopped() else None
    if isinstance(e, OSError) and e.filename is not None:  # exists, is a folder, no permission, ...
        lines = [f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") + f": {e.strerror or e}"]
    elif isinstance(e, (LwmError, NonFiniteLossError)) or type(e).__name__ == "MisconfigurationException":
        lines = [line + (GPU_HINT if line.startswith("No supported gpu backend found") else "")
                 for line in error_lines(e)]  # Lightning's configuration errors too
    else:
        return None
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    return 2


def error_lines(e: BaseException) -> list[str]:
    """The lines of an lwm error for the terminal (of a DataLoader worker's: its last raise's)."""
    lines = str(e).splitlines()
    if lines and lines[0].startswith("Caught ") and "Original Traceback" in str(e):
        prefix = f"{type(e).__module__}.{type(e).__qualname__}: "
        last = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(prefix)), None)
        if last is not None:
            return [lines[last][len(prefix):], *lines[last + 1:]]
    return lines
