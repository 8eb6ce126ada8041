"""Does it learn? Fit recipes on several datasets, then measure on held-out clips what the model learned.

    python benchmarks/learning.py [--out runs/learning] [--size full|smoke] [--datasets synth ...]
                                  [--recipes recipe requirement ...] [--steps 2500] [--study-steps 1000] [--seed 0]

For each dataset (made here, every one at the demo's 32x32 pixels through the pixel codec: the synthetic world,
with distractors, with look-alike worlds that only their dynamics tell apart, and Atari footage of four games) and
each recipe (``configs/demo.yaml`` as it is, with the requirement's settings, without one of its changes, or with
one of the requirement's open questions), it runs ``lwm fit`` (the recipe and the requirement's setting for
``--steps``, the ablations and questions beside the recipe for ``--study-steps``), then evaluates the final
checkpoint on held-out clips (a recording of its own, made with another seed) with :func:`lwm.study.evaluate`:
PSNR of frames 1..4 generated from frame 0 against copy-last-frame, action sensitivity (random, dictionary and
another clip's codes), world sensitivity and the leak check, NMI and linear probes against the true actions and
worlds, code usage. Prints the tables, writes ``OUT/learning.json`` and ``OUT/learning.png``. Finished runs are
reused: run it again to add recipes or datasets.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from lwm.inference.study import LABELLED, load_clips

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo.yaml"
FOOTAGE = ROOT / "configs" / "footage.yaml"  # Atari at 64x64 pixels: [16, 32, 32] latents
SIZE = 32  # pixels: [16, 16, 16] latents, the demo's
GAMES = ("pong", "breakout", "freeway", "boxing")

SYNTH = dict(frames=16, distractors=0, look_alike=False)
ATARI64 = dict(frames=256, size=64, config=FOOTAGE)
# name -> (maker, train settings, held-out settings, recipes) per size; settings' size: pixels, config: the recipe
DATASETS = {
    "full": {
        "synth": ("synth", dict(SYNTH, episodes=1024), dict(SYNTH, episodes=256), "ablations questions"),
        "synth_distractors": ("synth", dict(SYNTH, episodes=1024, distractors=2),
                              dict(SYNTH, episodes=256, distractors=2), ""),
        "synth_look_alike": ("synth", dict(SYNTH, episodes=1024, look_alike=True),
                             dict(SYNTH, episodes=256, look_alike=True), "world"),
        "atari": ("atari", dict(episodes=24, frames=256), dict(episodes=4, frames=256), "ablations"),
        "atari64": ("atari", dict(ATARI64, episodes=24), dict(ATARI64, episodes=4), "footage"),
    },
    "smoke": {
        "synth": ("synth", dict(SYNTH, episodes=16), dict(SYNTH, episodes=8), ""),
        "atari": ("atari", dict(episodes=2, frames=32), dict(episodes=1, frames=32), ""),
        "atari64": ("atari", dict(ATARI64, episodes=2, frames=32), dict(ATARI64, episodes=1, frames=32), ""),
    },
}

# The recipe is configs/demo.yaml as it is; each other entry overrides it: the requirement's settings, the recipe
# without one of its changes (ablations), and the requirement's open questions.
NET = "--model.net."
REQUIREMENT = [f"{NET}residual=false", f"{NET}action_input=tokens", f"{NET}action_spatial_pe=true",
               f"{NET}codebook_sizes_action=[4, 8]", f"{NET}codebook_sizes_world=[4, 8]", f"{NET}context_dropout=0",
               f"{NET}world_frames=null", f"{NET}world_curriculum=[0, 0]", f"{NET}action_shift=0",
               f"{NET}world_contrast=0"]
ABLATIONS = {
    "no_residual": [f"{NET}residual=false"],
    "token_actions": [f"{NET}action_input=tokens"],
    "action_spatial_pe": [f"{NET}action_spatial_pe=true"],
    "no_action_shift": [f"{NET}action_shift=0"],
    "action_codes_4x8": [f"{NET}codebook_sizes_action=[4, 8]"],
    "world_codes_4x8": [f"{NET}codebook_sizes_world=[4, 8]"],
    "no_context_dropout": [f"{NET}context_dropout=0"],
    "world_sees_clip": [f"{NET}world_frames=null"],
    "no_world_warmup": [f"{NET}world_curriculum=[0, 0]"],
    "no_world_contrast": [f"{NET}world_contrast=0"],
}
WORLD_QUESTIONS = {
    "world_sees_clip": ABLATIONS["world_sees_clip"],
    "no_world_warmup": ABLATIONS["no_world_warmup"],
    "world_codes_64": [f"{NET}codebook_sizes_world=[64]"],
    "world_codes_4": [f"{NET}codebook_sizes_world=[4]"],
    "world_sees_2_frames": [f"{NET}world_frames=2"],
    "no_world_contrast": ABLATIONS["no_world_contrast"],
}
QUESTIONS = dict(WORLD_QUESTIONS)
# real footage: a fraction of the transitions labelled (the label head, LAOM's 2.5%; ALE has 18 actions)
FOOTAGE_RECIPES = {"labels": [f"{NET}action_labels=18", "--data.label_fraction=0.025"],
                   "label_weight_1": [f"{NET}label_weight=1"], "label_fraction_0.25": ["--data.label_fraction=0.25"],
                   "context_dropout_0.5": [f"{NET}context_dropout=0.5"],
                   "action_codes_8": [f"{NET}codebook_sizes_action=[8]"], "max_pool": [f"{NET}action_max_pool=true"]}
RECIPES = {"recipe": [], "requirement": REQUIREMENT, **ABLATIONS, **QUESTIONS, **FOOTAGE_RECIPES}
PLANS = {"": ["recipe", "requirement"], "ablations": list(ABLATIONS),
         "footage": ["context_dropout_0.5", "action_codes_8", "labels"],
         "questions": [q for q in QUESTIONS if q not in ABLATIONS], "world": list(WORLD_QUESTIONS)}


def recipe_name(name: str) -> str:
    """A recipe of :data:`RECIPES`, or several joined by "+"."""
    unknown = [part for part in name.split("+") if part not in RECIPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]}: not a recipe ({', '.join(RECIPES)})")
    return name


def make_data(out: Path, name: str, maker: str, settings: dict, seed: int, games: tuple[str, ...]) -> Path:
    """The dataset's manifest (made once; a second call finds it)."""
    manifest = out / "manifest.json"
    if manifest.is_file():
        return manifest
    if maker == "synth":
        from lwm.data.synth import make_dataset

        return make_dataset(out, settings["episodes"], settings["frames"], seed, size=settings.get("size", SIZE),
                            distractors=settings["distractors"], look_alike=settings["look_alike"])
    from lwm.data.atari import make_dataset
    from lwm.data.codecs import PixelCodec

    return make_dataset(out, list(games), settings["episodes"], settings["frames"], seed,
                        codec=PixelCodec(size=settings.get("size", SIZE)), log=lambda line: None)


def fit(run_dir: Path, manifest: Path, steps: int, overrides: list[str], smoke: bool, config: Path = CONFIG) -> float:
    """``lwm fit`` of ``config`` with ``overrides`` for ``steps`` steps into ``run_dir``; its wall time."""
    args = [sys.executable, "-m", "lwm", "fit", "--config", str(config), f"--data.manifest={manifest}",
            f"--trainer.default_root_dir={run_dir}", f"--trainer.max_steps={steps}",
            "--trainer.enable_progress_bar=false", *overrides]
    if smoke:
        args += ["--trainer.val_check_interval=null", "--data.batch_size=4"]
    if (run_dir / "checkpoints" / "last.ckpt").exists():  # an interrupted benchmark: the fit goes on
        args += ["--ckpt_path", "last"]
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"lwm fit failed for {run_dir} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def evaluate_run(run_dir: Path, test_manifest: Path, synthetic: bool, manifest: Path | None = None) -> dict:
    """The study of the run's last checkpoint on the held-out clips; with the training ``manifest`` (footage) also the
    label efficiency of its action codes, the mapping fitted on its clips."""
    from lwm.training.checkpoint import load_checkpoint, trained_window
    from lwm.inference.dictionary import load_dictionaries
    from lwm.inference.study import evaluate, label_efficiency

    raw, module = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    model = module.model.eval()
    clips = load_clips(test_manifest, None, trained_window(raw), per_file=16)  # every file of the held-out recording
    dictionary = load_dictionaries(run_dir / "checkpoints" / "codes.pt")["Action_Encoder"]
    phase = model.world_phase_of_weights(int(raw["global_step"]))
    factors = None
    if synthetic:  # what the synthetic worlds differ in besides their background: speed and edges
        from lwm.data.synth import WORLDS

        factors = {name: torch.tensor([getattr(WORLDS[w], name) for w in clips.worlds.tolist()]).long()
                   for name in ("speed", "wrap")}
    result = evaluate(model, clips, t=4, dictionary=dictionary, world_phase=phase, world_factors=factors)
    if manifest is not None:
        labelled = load_clips(manifest, None, trained_window(raw), per_file=8)
        for world, by_size in label_efficiency(model, labelled, clips).items():
            result["per_world"][world]["labelled"] = by_size
    return result


def action_effect(game: str, size: int = SIZE, states: int = 38, t: int = 4, seed: int = 1) -> float:
    """How much the actions change frame ``t`` of a game at the benchmark's size: from ``states`` states along a
    sticky-random play, the mean latent MSE between two futures played ``t`` steps with independent uniform actions
    (the emulator is deterministic, so the actions alone make them differ). A model's error at frame ``t`` (MSE e)
    grows by about this much under wrong actions: its action sensitivity is at most about 10 log10(1 + effect / e)."""
    import numpy as np

    from lwm.data.atari import _ale, stretch
    from lwm.data.codecs import PixelCodec

    ale_py, codec = _ale(), PixelCodec(size=size)
    ale = ale_py.ALEInterface()
    ale.setLoggerMode(ale_py.LoggerMode.Error)
    ale.setInt("random_seed", seed)
    ale.setFloat("repeat_action_probability", 0.0)
    ale.loadROM(ale_py.roms.get_rom_path(game))
    legal, rng = list(ale.getMinimalActionSet()), np.random.default_rng(seed)
    effects, choice = [], 0
    for step in range(20 + 10 * states):
        if rng.random() >= 0.75:  # the recordings' sticky policy
            choice = int(rng.integers(len(legal)))
        for _ in range(4):  # the recordings' frame skip
            ale.act(legal[choice])
        if step < 20 or step % 10:
            continue
        state, futures = ale.cloneState(), []
        for _ in range(2):
            ale.restoreState(state)
            for _ in range(t):
                action = legal[int(rng.integers(len(legal)))]
                for _ in range(4):
                    ale.act(action)
            futures.append(ale.getScreenRGB())
        ale.restoreState(state)
        latents = codec.encode(stretch(np.stack(futures), size))
        effects.append(float(((latents[0] - latents[1]) ** 2).mean()))
    return float(np.mean(effects))


def against(d: dict | None, value: str, chance: str, margin: str) -> str:
    """A code measure beside its chance level and 3 sd, e.g. ``0.91 (0.01+0.01)``."""
    return f"{d[value]:.2f} ({d[chance]:.2f}+{d[margin]:.2f})" if d else "-"


def row(key: str, r: dict) -> str:
    nmi = lambda d: against(d, "nmi", "nmi_chance", "nmi_margin")
    probe = lambda d: against(d, "probe", "chance", "margin")
    a, w = r["action"], r["world"]
    return (f"| {' | '.join(key.split('/'))} | {r['psnr'][0]:.2f} / {r['copy_psnr'][0]:.2f} | {r['psnr'][-1]:.2f} / "
            f"{r['copy_psnr'][-1]:.2f} | {r['action_dpsnr']['random']:.2f} / {r['action_dpsnr']['dictionary']:.2f} / "
            f"{r['action_dpsnr']['other_clip']:.2f} | {r['world_dpsnr']['random']:.2f} / "
            f"{r['world_dpsnr']['same_world']:.2f} | {nmi(a)} | {probe(a)} | {nmi(w)} | {probe(w)} | "
            f"{r['action_usage']['tuples']} / {r['world_usage']['tuples']} | {r['fit_seconds'] / 60:.1f} |")


HEADER = ("| data | recipe | steps | PSNR t=1 / copy | PSNR t=4 / copy | action dPSNR rand / dict / other clip | "
          "world dPSNR rand / same-world gap | action NMI | action probe | world NMI | world probe | "
          "tuples used a / w | fit min |\n|" + "---|" * 13)


def per_world_rows(key: str, r: dict, names: dict[int, str]) -> list[str]:
    return [f"| {' | '.join(key.split('/'))} | {names.get(int(k), k)} | {v['psnr'][0]:.2f} / {v['copy_psnr'][0]:.2f} | "
            f"{v['psnr'][-1]:.2f} / {v['copy_psnr'][-1]:.2f} | {v['action_dpsnr_dictionary']:.2f} | "
            f"{v['action_dpsnr_other_clip']:.2f} | {v['world_gap_same_world']:.2f} | "
            f"{against(v['action'], 'nmi', 'nmi_chance', 'nmi_margin')} | "
            f"{against(v['action'], 'probe', 'chance', 'margin')} |"
            for k, v in sorted(r["per_world"].items(), key=lambda kv: int(kv[0]))]


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({k.split("/")[0] for k in results})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        copy = None
        for key, r in results.items():
            d, recipe, steps = key.split("/")
            if d != dataset:
                continue
            ax.plot(range(1, len(r["psnr"]) + 1), r["psnr"], marker="o", label=f"{recipe} ({steps} steps)")
            copy = r["copy_psnr"]
        if copy:
            ax.plot(range(1, len(copy) + 1), copy, "k--", label="copy last frame")
        ax.set_title(dataset)
        ax.set_xlabel("frame generated from frame 0")
        ax.set_ylabel("PSNR (dB, latents)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/learning", help="data, runs and results (default runs/learning)")
    p.add_argument("--size", choices=sorted(DATASETS), default="full", help="full (by hand) or smoke (CI)")
    p.add_argument("--datasets", nargs="+", help="default: every one of the size")
    p.add_argument("--recipes", nargs="+", type=recipe_name, metavar="RECIPE",
                   help="default: recipe and requirement everywhere, ablations and open questions where planned; "
                   "A+B: both's overrides")
    p.add_argument("--steps", type=int, help="training steps of the recipe and the requirement's setting (default: "
                   "2500 full, the study's; 3 smoke)")
    p.add_argument("--study-steps", type=int, default=1000, help="training steps of the ablations and open questions, "
                   "each beside the recipe at as many steps (default 1000)")
    p.add_argument("--games", nargs="+", default=list(GAMES), help=f"Atari games (default {' '.join(GAMES)})")
    p.add_argument("--seed", type=int, default=0, help="the fits' seed_everything (default 0, the demo's); another "
                   "labels its runs RECIPE+seedN: the spread between seeds")
    p.add_argument("--no-fit", action="store_true", help="fit nothing: report the finished runs of the datasets")
    args = p.parse_args(argv)
    smoke = args.size == "smoke"
    headline = args.steps or (3 if smoke else 2500)
    datasets = {k: v for k, v in DATASETS[args.size].items() if not args.datasets or k in args.datasets}
    out = Path(args.out)
    if args.no_fit and not (out / "results").is_dir():
        p.error(f"--no-fit: {out / 'results'} not found: no finished run under --out {out}")
    results: dict[str, dict] = {}
    names: dict[str, dict[int, str]] = {}
    for dataset, (maker, train, test, plans) in datasets.items():
        if args.no_fit and not (out / "data" / dataset / "manifest.json").is_file():
            continue
        manifest = make_data(out / "data" / dataset, dataset, maker, train, 0, tuple(args.games))
        test_manifest = make_data(out / "data" / f"{dataset}_test", dataset, maker, test, 1, tuple(args.games))
        names[dataset] = dict(enumerate(args.games)) if maker == "atari" else {}
        runs = [(r, headline) for r in args.recipes or PLANS[""]]
        studied = [r for plan in plans.split() for r in PLANS[plan]] if not args.recipes else []
        runs += [(r, args.study_steps) for r in (["recipe"] if studied else []) + studied]
        for recipe, steps in runs:
            overrides = [o for part in recipe.split("+") for o in RECIPES[part]]
            overrides += [f"--seed_everything={args.seed}"] if args.seed else []
            recipe += f"+seed{args.seed}" if args.seed else ""
            key = f"{dataset}/{recipe}/{steps}"
            saved = out / "results" / f"{dataset}__{recipe}__{steps}.json"
            if saved.is_file():
                results[key] = json.loads(saved.read_text())
                continue
            if args.no_fit:
                continue
            run_dir = out / "runs" / dataset / f"{recipe}__{steps}"
            print(f"fit {key}: {steps} steps ...", flush=True)
            seconds = fit(run_dir, manifest, steps, overrides, smoke, train.get("config", CONFIG))
            r = evaluate_run(run_dir, test_manifest, maker == "synth", manifest if "config" in train else None)
            r.update(fit_seconds=seconds, steps=steps, overrides=overrides, date=str(date.today()))
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(r, indent=1))
            results[key] = json.loads(saved.read_text())  # as a later call reads it (world labels as strings)
        if args.no_fit:  # and the dataset's other finished runs
            for saved in sorted((out / "results").glob(f"{dataset}__*.json")):
                results.setdefault("/".join(saved.stem.split("__")), json.loads(saved.read_text()))
    print("\nconfigs/demo.yaml (atari64: configs/footage.yaml) with each recipe's overrides, held-out clips of T=8; PSNR "
          "on latents (dB); NMI, probes and label accuracy: chance level+3 sd in brackets\n")
    print(HEADER)
    for key, r in results.items():
        print(row(key, r))
    print("\n| data | recipe | steps | world | PSNR t=1 / copy | PSNR t=4 / copy | action dPSNR dict | action dPSNR "
          "other clip | world gap same-world | action NMI | action probe |\n|" + "---|" * 11)
    for key, r in results.items():
        print("\n".join(per_world_rows(key, r, names[key.split("/")[0]])))
    labelled = [(key, r) for key, r in results.items() if any("labelled" in v for v in r["per_world"].values())]
    if labelled:
        print("\n| data | recipe | steps | game | " + " | ".join(f"accuracy from {n} labels" for n in LABELLED)
              + " |\n|" + "---|" * (4 + len(LABELLED)))
        for key, r in labelled:
            for k, v in sorted(r["per_world"].items(), key=lambda kv: int(kv[0])):
                cells = [v.get("labelled", {}).get(str(n)) for n in LABELLED]
                print(f"| {' | '.join(key.split('/'))} | {names[key.split('/')[0]].get(int(k), k)} | " + " | ".join(
                    against(c, "accuracy", "chance", "margin") for c in cells) + " |")
    for dataset, (maker, train, *_) in datasets.items():
        if maker != "atari" or smoke:
            continue
        size = train.get("size", SIZE)
        print(f"\n{dataset} ({size}x{size} pixels)\n| game | action effect on frame 4 (MSE) | recipe's MSE at frame 4 "
              "| bound on action dPSNR (dB) |\n|---|---|---|---|")
        recipe = results.get(f"{dataset}/recipe/{headline}")
        for label, game in enumerate(args.games):
            effect = action_effect(game, size)
            error = 10 ** (-recipe["per_world"][str(label)]["psnr"][-1] / 10) if recipe else float("nan")
            print(f"| {game} | {effect:.2e} | {error:.2e} | {10 * math.log10(1 + effect / error):.2f} |")
    (out / "learning.json").write_text(json.dumps(results, indent=1))
    if results:  # the headline runs, where there are some
        figure({k: r for k, r in results.items() if k.endswith(f"/{headline}")} or results, out / "learning.png")
    print(f"\n{out / 'learning.json'}, {out / 'learning.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
