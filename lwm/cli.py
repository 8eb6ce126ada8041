"""The ``lwm`` command. Verbs so far:

    lwm data index DIR [--val-fraction F] [--out MANIFEST] [--seed S] [--tolerance TOL]
    lwm demo [--steps N]

Errors exit non-zero with one line per problem, naming the file or field.
"""

from __future__ import annotations

import argparse
import sys

from lwm.data.h5 import DataError


def _data_index(args: argparse.Namespace) -> int:
    from lwm.data.manifest import index_directory

    manifest = index_directory(args.directory, out=args.out, val_fraction=args.val_fraction, seed=args.seed,
                               tolerance=args.tolerance)
    n_train, n_val = len(manifest.split("train")), len(manifest.split("val"))
    frames = sum(e.frames for e in manifest.entries)
    print(f"{manifest.path}: {len(manifest.entries)} files checked ({n_train} train, {n_val} val), {frames} frames "
          f"of [{manifest.channels}, {manifest.height}, {manifest.width}]")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from lwm import demo

    demo.main(args.demo_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lwm", description="Latent world models from video latents.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    data = verbs.add_parser("data", help="make, check or convert data").add_subparsers(dest="data_verb", required=True)
    index = data.add_parser("index", help="check every h5 file under DIR and write the manifest")
    index.add_argument("directory", help="folder searched recursively for *.h5 / *.hdf5")
    index.add_argument("--out", help="manifest path (default: DIR/manifest.json)")
    index.add_argument("--val-fraction", type=float, default=0.1, help="fraction of files in the val split")
    index.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    index.add_argument("--tolerance", type=float, default=1e-3, help="allowed excess over [-1, 1]")
    index.set_defaults(func=_data_index)

    demo = verbs.add_parser("demo", help="train a tiny model on a built-in synthetic world (CPU)", add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DataError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
