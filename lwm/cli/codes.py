"""``lwm codes``: the code dictionaries of a checkpoint's encoders on its training data."""

from __future__ import annotations

import math
import sys

import torch

from lwm.cli.lightning_cli import LwmCLI
from lwm.inference.dictionary import check_out, collect, default_codes_path, save_dictionaries
from lwm.training.checkpoint import load_checkpoint, warn_window_mismatch
from lwm.training.run_dir import checkpoint_file, run_of, RunDir
from lwm.utils.args import ArgumentParser, config_files, positive_int
from lwm.utils.errors import ConfigError
from lwm.utils.video import check_output


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="lwm codes", description="Code dictionaries of a trained model on its training data.",
                            epilog="Every other argument is a `lwm fit` option: --config FILE and dotted overrides "
                                   "such as --data.manifest M.")
    parser.add_argument("--ckpt_path", required=True, help="the checkpoint whose encoders to use: a file, a run's "
                        "folder or `last` (the run's latest checkpoint: last.ckpt, or a newer step or hpc one)")
    parser.add_argument("--max-windows", type=positive_int, help="encode at most this many windows (default: all)")
    parser.add_argument("--out", help="output file (default: codes.pt beside last.ckpt, NAME.codes.pt beside "
                                      "another NAME.ckpt)")
    args, rest = parser.parse_known_args(argv)
    has_config = bool(config_files(rest))  # (--config F, --config=F, -c F)
    if args.ckpt_path == "last" and not has_config:
        raise ConfigError("--ckpt_path last: which run's? Give --config CFG (its trainer.default_root_dir), or the "
                          "run's folder as --ckpt_path RUN_DIR")
    run = run_of(args.ckpt_path)
    if run is not None and not has_config:
        config = run / "config.yaml"
        print(f"lwm codes: the run's config {config} (its data, window and seed; --config to give another)",
              file=sys.stderr)
        rest = ["--config", str(config), *rest]
    cli = LwmCLI(args=rest, run=False)
    dm = cli.datamodule  # the data; the model is the checkpoint's
    ckpt_path = checkpoint_file(args.ckpt_path, RunDir.of(cli.config).checkpoints)
    # before any work; the default path (lwm's own name beside the checkpoint) may be rewritten whatever it holds
    out = check_out(args.out) if args.out else check_output(default_codes_path(ckpt_path), "the code dictionary")
    checkpoint, module = load_checkpoint(ckpt_path)
    warn_window_mismatch(checkpoint, dm.window, ckpt_path)  # the codes depend on it
    dm.keep_checkpoint_seed(checkpoint)  # the fit's windows
    dm.setup("fit")
    module.check_data(dm.frame_shape, dm.window, str(dm.manifest_path), model_from=str(ckpt_path))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = module.model.to(device).eval()
    dictionaries, windows = collect(model, dm.code_loader(args.max_windows), device)
    out = save_dictionaries(out, dictionaries, windows, checkpoint.get("global_step"))
    for name, d in dictionaries.items():
        top = torch.argsort(d.counts, descending=True)[:3]
        common = ", ".join(f"{tuple(d.tuples[i].tolist())} x{int(d.counts[i])}" for i in top)
        what = "transitions" if name == "Action_Encoder" else "windows"  # a code per transition, per window
        print(f"{name}: {d.tuples.shape[0]} code tuples in use of {math.prod(d.codebook_sizes)} possible, over "
              f"{d.total} {what}; most frequent: {common}")
    print(f"{windows} windows encoded; wrote {out}")
    return 0
