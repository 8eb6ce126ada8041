"""``lwm demo``: the whole main job on a CPU, with no data of your own and no network."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lwm.callbacks.slurm import interrupted_by
from lwm.cli.generate import parse as generate_args
from lwm.cli.lightning_cli import LwmCLI, read_config
from lwm.data.manifest import Manifest
from lwm.data.synth import distractors_arg, frames_arg, make_dataset, size_arg
from lwm.inference.dictionary import load_dictionaries
from lwm.inference.generation import run as generate
from lwm.inference.study import evaluate, load_clips, probe_margin
from lwm.training.run_dir import RunDir
from lwm.utils.args import ArgumentParser, bounded, non_negative_int, positive_int
from lwm.utils.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
LAST = "checkpoints/last.ckpt"
OWN_KEYS = ("--ckpt_path", "--trainer.default_root_dir", "--checkpoint.dirpath", "--data.manifest")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="lwm demo", description=__doc__.split("\n\n")[0].replace("``", ""),
                       epilog="Other --section.key=value arguments go to `lwm fit`.")
    p.add_argument("--out", default="runs/demo", help="output folder")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the fit config (default configs/demo.yaml)")
    p.add_argument("--steps", type=positive_int, help="training steps (default: the config's trainer.max_steps)")
    p.add_argument("--episodes", type=bounded(int, 2), default=1024,
                   help="synthetic episodes (one in eight held out for validation)")
    p.add_argument("--frames", type=frames_arg, default=16, help="frames per episode")
    p.add_argument("--size", type=size_arg, default=32, help="frame size in pixels; latents are size/2")
    p.add_argument("--distractors", type=distractors_arg, default=0, help="drifting discs in the world")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the data and of the fit")
    args, rest = p.parse_known_args(argv or [])
    for key in OWN_KEYS:
        if any(a.split("=")[0] == key for a in rest):
            raise ConfigError(f"{key}: lwm demo sets it (its run lives in --out; run it again with the same --out "
                              f"to resume it)")
    console = Console()
    out = Path(args.out)
    run_dir, times = out / "run", {}
    resume = RunDir(run_dir).latest()  # an interrupted (or finished) demo continues, never starts over
    side = args.size // 2  # of the latents
    shape = [f"--model.net.height={side}", f"--model.net.width={side}"]
    config = read_config(["--config", args.config, *shape, *rest])  # a bad option: refused before the data is made
    window = int(config["data"]["window"])
    if args.frames < window:
        raise ConfigError(f"--frames {args.frames}: shorter than the fit's window (data.window {window}): the "
                          f"episodes must hold one")
    earlier = out / "data" / "manifest.json"  # more episodes than an earlier run's
    listed = len(Manifest.load(earlier).entries) if earlier.is_file() else args.episodes
    if listed != args.episodes:
        raise ConfigError(f"{earlier}: lists {listed} episodes (this run: --episodes {args.episodes}); run the demo "
                          f"with its earlier settings, or into another --out")
    start = time.perf_counter()
    console.rule("[bold]1/4 data[/]: the synthetic world")
    manifest_path = make_dataset(out / "data", args.episodes, args.frames, args.seed, val_fraction=0.125,
                                 size=args.size, distractors=args.distractors,
                                 remedy="run the demo with its earlier settings, or into another --out")
    manifest = Manifest.load(manifest_path)
    console.print(f"{len(manifest.entries)} episodes x {args.frames} frames of [16, {side}, {side}] latents "
                  f"({len(manifest.split('train'))} train, {len(manifest.split('val'))} val): {manifest_path}",
                  soft_wrap=True)
    times["data"] = time.perf_counter() - start

    common = ["--config", args.config, f"--data.manifest={manifest_path}", f"--trainer.default_root_dir={run_dir}",
              *shape, f"--seed_everything={args.seed}",
              *([f"--trainer.max_steps={args.steps}"] if args.steps else []), *rest]
    console.rule("[bold]2/4 fit[/]: lwm fit --config " + args.config + (" --ckpt_path last" if resume else ""))
    if resume:
        console.print(f"{resume} exists: resuming that run (it stops at once if it had finished)", soft_wrap=True)
    t = time.perf_counter()
    signum = interrupted_by(LwmCLI(args=["fit", *common, *(["--ckpt_path", "last"] if resume else [])]).trainer)
    times["fit"] = time.perf_counter() - t
    if signum:
        console.print(f"stopped by {signal.Signals(signum).name}: run the same command again to continue the demo")
        return 128 + signum

    console.rule("[bold]3/4 validate[/]: the final checkpoint on every validation window")
    t = time.perf_counter()
    cli = LwmCLI(args=[*common, f"--trainer.default_root_dir={run_dir / 'validate'}",  # as `lwm validate` logs
                       f"--checkpoint.dirpath={run_dir / 'checkpoints'}",  # (the fit's: no "dirpath has changed")
                       "--data.val_size_percent=1.0"], run=False)
    metrics = {k: float(v) for k, v in cli.trainer.validate(cli.model, datamodule=cli.datamodule,
                                                            ckpt_path=str(run_dir / LAST), verbose=False)[0].items()}
    dm, codes = cli.datamodule, run_dir / "checkpoints" / "codes.pt"
    study = None  # the held-out study (lwm.inference.study) needs windows longer than t=4, and codes.pt
    if dm.window > 4 and codes.is_file():
        study = evaluate(cli.model.model.eval(), load_clips(manifest_path, "val", dm.window), t=4,
                         dictionary=load_dictionaries(codes)["Action_Encoder"])
    times["validate"] = time.perf_counter() - t

    console.rule("[bold]4/4 video[/]: rollouts of a validation episode")
    t = time.perf_counter()
    episode = str(manifest.resolve(manifest.split("val")[0]))
    steps = min(args.frames - 1, 2 * (dm.window - 1))
    common_gen = ["--ckpt_path", str(run_dir / LAST), "--data", episode, "--steps", str(steps), "--fps", "4",
                  "--overwrite"]  # the demo's own videos
    inferred = generate(generate_args([*common_gen, "--actions", "inferred", "--rollouts", "1",
                                       "--out", str(out / "rollout_inferred.mp4")]))
    sampled = generate(generate_args([*common_gen, "--actions", "dictionary", "--rollouts", "4",
                                      "--out", str(out / "rollout_sampled.mp4")]))
    times["video"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - start

    report(console, metrics, times, study)
    console.print("\n[bold]outputs[/]")
    for label, path in (
        ("data (h5 + manifest)", manifest_path.parent), ("run: metrics, config", run_dir / "metrics.csv"),
        ("final validation: metrics", run_dir / "validate" / "metrics.csv"),
        ("checkpoint", run_dir / LAST), ("code dictionaries", run_dir / "checkpoints" / "codes.pt"),
        ("rollout videos at validation", run_dir / "videos"),
        ("rollout with inferred actions (top: ground truth)", inferred),
        ("rollouts with sampled actions", sampled),
    ):
        if path.exists():  # a very short --steps logs no training row and validates nothing during the fit
            console.print(f"  {label:<52} {path}", soft_wrap=True)
    console.print(f"  figures: lwm plot {run_dir}", soft_wrap=True)
    console.print(f"\n[bold]play it[/]: lwm play --ckpt_path {run_dir} --manifest {manifest_path}", soft_wrap=True)
    return 0


def report(console: Console, m: dict[str, float], times: dict[str, float], study: dict | None = None) -> None:
    """The table and the verdicts, from the validation metrics and the held-out study (:mod:`lwm.inference.study`)."""
    tf, copy = m["Val_Dynamics_Predictor/tf_loss"], m["Val_Dynamics_Predictor/copy_last_loss"]
    table = Table(title="validation (every window of the held-out episodes)")
    for col in ("", "model", "baseline / chance"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row("one-step MSE (teacher forcing) vs copy-last-frame", f"{tf:.4f}", f"{copy:.4f}")
    table.add_row("one-step PSNR, dB (of the mean MSE)", f"{m['Val_Dynamics_Predictor/tf_psnr']:.2f}",
                  f"{m['Val_Dynamics_Predictor/copy_last_psnr']:.2f}")
    for k in (1, 2):
        key = f"Val_Dynamics_Predictor/rollout_{k}_loss"
        if key in m:
            table.add_row(f"rollout pass {k} MSE (own predictions fed back)", f"{m[key]:.4f}", "")
    verdicts = [("beats copy-last-frame", tf < copy, f"MSE {tf:.4f} {'<' if tf < copy else '>='} {copy:.4f}")]
    for name, what in (("Action_Encoder", "actions"), ("World_Encoder", "worlds")):
        acc, chance = m.get(f"Val_{name}/probe_accuracy"), m.get(f"Val_{name}/probe_chance")
        if acc is None:
            continue
        table.add_row(f"linear probe: latent {what[:-1]} code -> true {what[:-1]} (held out)", f"{acc:.3f}",
                      f"{chance:.3f}")
        table.add_row(f"NMI(latent {what[:-1]} codes, true {what})", f"{m[f'Val_{name}/nmi']:.3f}", "0")
        samples = int(m[f"Val_{name}/probe_samples"])
        margin = probe_margin(chance, samples)
        claim, held_out = {"Action_Encoder": ("latent actions carry information about the true actions",
                                              "transitions"),
                           "World_Encoder": ("the world codes carry information about the true worlds", "clips")}[name]
        verdicts.append((claim, acc > chance + margin,
                         f"probe {acc:.3f} vs chance {chance:.3f} + 3 sd {margin:.3f} ({samples} held-out {held_out})"))
    if study is not None:
        a, w = study["action_dpsnr"], study["world_dpsnr"]
        table.add_row("frame 1 / frame 4 from frame 0: PSNR, dB", f"{study['psnr'][0]:.2f} / {study['psnr'][-1]:.2f}",
                      f"{study['copy_psnr'][0]:.2f} / {study['copy_psnr'][-1]:.2f}")
        table.add_row("action sensitivity at frame 4, dB: vs random / dictionary / another clip's codes",
                      f"{a['random']:.2f} / {a['dictionary']:.2f} / {a['other_clip']:.2f}", "0")
        table.add_row("world sensitivity at frame 4, dB: vs a random code / same-world clip's code",
                      f"{w['random']:.2f} / {w['same_world']:.2f}", "0")
        verdicts.append(("the latent actions steer the predictions", a["dictionary"] > 1.0,
                         f"{a['dictionary']:.2f} dB better than actions drawn from the code dictionary (> 1 dB)"))
        verdicts.append(("the world code is the world's, not the clip's", abs(w["same_world"]) <= 0.2,
                         f"another clip of the same world's code predicts {w['same_world']:.2f} dB worse (<= 0.2 dB)"))
    console.print(table)
    for text, ok, detail in verdicts:
        console.print(f"  {'[green]yes[/]' if ok else '[red]not yet[/]'}  {text}: {detail}", soft_wrap=True)
    console.print("  time: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))

