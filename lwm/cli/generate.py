"""``lwm generate``: play a trained world model forward from frames of an h5 file and write the video."""

from __future__ import annotations

import argparse

from lwm.inference.dictionary import SAMPLING
from lwm.inference.generation import ACTIONS, parse_indices, run, WORLDS
from lwm.utils.args import ArgumentParser, bounded, frame_rate, positive_int


def parse(argv: list[str]) -> argparse.Namespace:
    p = ArgumentParser(prog="lwm generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt_path", required=True, help="a checkpoint of `lwm fit`, or a run's folder (its latest "
                                                             "checkpoint: last.ckpt, or a newer step or hpc one)")
    p.add_argument("--data", required=True, help="h5 file to take the context (and ground truth) from")
    p.add_argument("--start", type=int, default=0, help="first context frame")
    p.add_argument("--context", type=positive_int, default=1, help="ground-truth frames given to the model")
    p.add_argument("--steps", type=positive_int, default=16, help="frames to generate")
    p.add_argument("--rollouts", type=positive_int, default=4, help="rollouts, generated together as one batch")
    p.add_argument("--actions", choices=ACTIONS, default="dictionary", help="where the actions come from")
    p.add_argument("--sampling", choices=SAMPLING, default="frequency",
                   help="drawing from the dictionary: by frequency, or uniformly over the tuples in use")
    p.add_argument("--action-indices", type=lambda text: parse_indices(text, 2),
                   help="JSON list of action code tuples, one per transition (overrides --actions)")
    p.add_argument("--world", choices=WORLDS, default="inferred",
                   help="where the world code comes from (inferred: from the training window's length of frames "
                        "from --start, whatever --steps; the context's, where longer)")
    p.add_argument("--world-indices", type=lambda text: parse_indices(text, 1),
                   help="JSON world code tuple (overrides --world)")
    p.add_argument("--codes", help="code dictionary (default: codes.pt beside the checkpoint)")
    p.add_argument("--window", type=positive_int, help="frames the predictor attends to (default: its training "
                                                        "window)")
    p.add_argument("--seed", type=bounded(int, 0, 2**63 - 1), default=0)  # (the draws' generators take these)
    p.add_argument("--fps", type=frame_rate, help="frame rate (default: --data's fps, which `lwm data encode` "
                   "records, else 8)")
    p.add_argument("--vae", help="the VAE's local diffusers weights, to decode files encoded with a VAE")
    p.add_argument("--vae-tiling", action="store_true",
                   help="the VAE decodes in overlapping spatial tiles (far less GPU memory at 512 px and up)")
    p.add_argument("--out", help="video path, .mp4 or .gif (default: RUN_DIR/generated/FILE_START_CONTEXT+STEPS_"
                   "ACTIONS-WORLD_seedS_stepK.mp4, K the checkpoint's global step, e.g. "
                   "clip_0_1+16_dictionary-inferred_seed0_step0005000.mp4; given indices: given-HASH)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing video and its latents (VIDEO.mp4.h5); without it they are refused")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    run(parse(argv))
    return 0
