"""``lwm generate``: play a trained world model forward from frames of an h5 file and write the video."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import torch

from lwm.data.codecs import codec_from_attr, codec_spec, missing_codec
from lwm.data.h5 import check_frames, DataError, file_fps, inspect_h5
from lwm.inference.dictionary import dictionaries_for
from lwm.training.checkpoint import load_checkpoint, read_checkpoint, trained_window
from lwm.training.run_dir import checkpoint_file
from lwm.utils.errors import ConfigError
from lwm.utils.metrics import random_indices
from lwm.utils.seeds import seeded_generator
from lwm.utils.video import (check_mp4_size, check_output, grid, GRID_PAD, latent_preview, PREVIEW_SCALE,
                             VIDEO_SUFFIXES, write_video)

ACTIONS = ("dictionary", "inferred", "random")
WORLDS = ("inferred", "dictionary")
WORLD_DRAWS = 1  # seeded_generator(--seed, WORLD_DRAWS): the world's dictionary draws, a stream of their own
Codes = tuple[torch.Tensor, torch.Tensor]  # vectors [..., D] and their indices [..., L]


def default_name(args: argparse.Namespace, step: int) -> str:
    """``FILE_START_CONTEXT+STEPS_ACTIONS-WORLD[_uniform][_codes-C][_windowW]_seedS_stepK.mp4``, ``K`` the
    checkpoint's step; given indices are ``given-`` a hash of those played."""
    transitions = args.context + args.steps - 1

    def source(value: np.ndarray | None, ndim: int, chosen: str) -> str:
        if value is None:
            return chosen
        played = value[:transitions] if ndim == 2 and value.ndim == 2 else value
        return "given-" + hashlib.sha1(json.dumps(played.tolist()).encode()).hexdigest()[:6]

    actions = source(args.action_indices, 2, args.actions)
    world = source(args.world_indices, 1, args.world)
    drawn = "dictionary" in (actions, world)
    uniform = "_uniform" if drawn and args.sampling == "uniform" else ""  # draws of another distribution
    codes = f"_codes-{Path(args.codes).stem}" if drawn and args.codes else ""  # another dictionary
    window = f"_window{args.window}" if args.window is not None else ""
    return (f"{Path(args.data).stem}_{args.start}_{args.context}+{args.steps}_{actions}-{world}{uniform}{codes}{window}"
            f"_seed{args.seed}_step{step:07d}.mp4")


def parse_indices(text: str, ndim: int) -> np.ndarray:
    """For argparse: JSON integers, a tuple (``ndim`` 1) or a list of tuples (``ndim`` 2); else one line."""
    what = "a JSON list of integers, one per RVQ level" if ndim == 1 else "a JSON list of integer code tuples"
    try:
        value, why = np.asarray(json.loads(text)), ""
    except (ValueError, TypeError) as e:  # not JSON, ragged lists
        value, why = None, f" ({e})"
    # (numpy takes bools among integers as integers: JSON integers have no letters)
    if value is None or value.dtype.kind not in "iu" or "true" in text or "false" in text:
        raise argparse.ArgumentTypeError(f"not {what}: {text[:80]}{why}")
    return value


def run(args: argparse.Namespace) -> Path:
    """``lwm generate``: checks, the checkpoint and the clip, the world and the actions, the rollouts, the files."""
    ckpt_path = checkpoint_file(args.ckpt_path)  # a run's folder: its latest checkpoint
    # missing, foreign, torn: said first (memory-mapped: no weights loaded yet); its step names the video
    step = int(read_checkpoint(ckpt_path, what="lwm checkpoint")["global_step"])
    out, latents_path = _outputs(args, ckpt_path, step)
    drawn = (args.actions != "inferred" and args.action_indices is None,
             args.world == "dictionary" and args.world_indices is None)
    if args.rollouts > 1 and not any(drawn):  # the predictor is deterministic
        print(f"note: nothing is drawn (the actions and the world are inferred or given), so the {args.rollouts} "
              f"rollouts are the same; --rollouts 1 writes one", file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw, module = load_checkpoint(ckpt_path, map_location=device)
    model = module.model.eval()
    trained = trained_window(raw)  # frames per training window (None: unknown)
    warn_world_phase(model, step)
    window = args.window if args.window is not None else (trained - 1 if trained else None)  # predictor inputs
    transitions = args.context + args.steps - 1  # actions the rollout needs
    # everything the checkpoint and the files can refuse, then the codec (a VAE: seconds and GPU memory to build)
    given = _given_codes(args, model, transitions, device)
    needed = tuple(name for name, used in (("Action_Encoder", drawn[0] and args.actions == "dictionary"),
                                           ("World_Encoder", drawn[1])) if used)
    dictionaries = dictionaries_for(ckpt_path, args.codes, raw.get("global_step"), model, needed) if needed else None
    clip, world_clip, codec, fps = _read_clips(args, model, trained, device)
    decoder = codec_from_attr(codec, str(args.data), args.vae, str(device), args.vae_tiling)  # a bad --vae: now
    side = getattr(decoder, "size", None) if decoder is not None else PREVIEW_SCALE * model.config.height
    if out.suffix == ".mp4" and side:  # the grid's height, before the work
        check_mp4_size((1 + args.rollouts) * (side + GRID_PAD) - GRID_PAD, side, out)
    before = _latents_before(args, decoder)
    last_position, offset = transitions - 1, model.config.max_time_offset  # the last frame fed sits at T - 1
    if trained and last_position > offset + trained - 2:  # training: a start up to the offset, then a window
        print(f"warning: the rollout feeds temporal positions up to {last_position}; training saw up to "
              f"{offset + trained - 2} (a start up to model.net.max_time_offset {offset}, then the {trained - 1} "
              f"predictor inputs of a {trained}-frame window): later frames are out of the trained range",
              file=sys.stderr)
    with torch.no_grad():
        (world, world_idx), (actions, action_idx) = _codes(args, model, clip, world_clip, trained,
                                                           given, dictionaries)  # [R, Dh|Lh], [R, T, Da|La]
        context = clip[:, : args.context].expand(args.rollouts, -1, -1, -1, -1)
        generated = model.generate(context, actions, world, args.steps, t0=0, window=window)  # [R, steps, C, H, W]
    rollouts = torch.cat([context, generated], dim=1).cpu()  # [R, context + steps, C, H, W]
    if args.fps is None and decoder is None:  # a latent preview: one frame per frames_per_latent video frames
        fps = fps / max(1, int((codec_spec(codec, str(args.data)) or {}).get("frames_per_latent", 1)))
    played = {"action_indices": action_idx.cpu(), "world_indices": world_idx.cpu()}
    _write(args, out, latents_path, rollouts, clip, decoder, codec, args.fps or fps, played, window, before)
    return out


def to_pixels(decoder, latents: torch.Tensor, before: np.ndarray | None = None) -> np.ndarray:
    """``uint8`` frames of ``latents [T, C, H, W]``: decoded (a video VAE's after ``before``), else channels 0-2."""
    if decoder is None:
        return latent_preview(latents.cpu())
    x = latents.float().cpu().numpy()
    return decoder.decode(x) if before is None else decoder.decode(x, before)


def _latents_before(args: argparse.Namespace, decoder) -> np.ndarray | None:
    """The file's latents before ``--start`` where its codec is a video VAE (its decoder carries history)."""
    if decoder is None or getattr(decoder, "frames_per_latent", 1) == 1 or args.start == 0:
        return None
    print(f"note: each of the {1 + args.rollouts} rows is decoded after the file's {args.start} latents before "
          f"--start (the {decoder.name} VAE's decoder carries history: decoded alone, a window's frames would be "
          f"off)", file=sys.stderr)
    with h5py.File(args.data, "r") as f:
        return np.asarray(f[inspect_h5(args.data, check_values=False).key][: args.start], dtype=np.float32)


def _outputs(args: argparse.Namespace, ckpt_path: Path, step: int) -> tuple[Path, Path]:
    """The video (``--out``, else the default name in the run's ``generated/``) and its latents file, checked."""
    run_dir = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
    out = Path(args.out) if args.out else run_dir / "generated" / default_name(args, step)
    latents_path = out.with_suffix(out.suffix + ".h5")
    inputs = {"--data": args.data, "--ckpt_path": ckpt_path, **({"--codes": args.codes} if args.codes else {})}
    check_output(out, "--out", inputs, VIDEO_SUFFIXES)
    check_output(latents_path, f"the latents of --out {out}", inputs)
    earlier = [path for path in (out, latents_path) if path.exists()]
    if earlier and not args.overwrite:
        more = f" and its latents {latents_path.name}" if len(earlier) > 1 else ""
        raise ConfigError(f"{earlier[0]}{more}: already there, where this rollout would be written (--overwrite "
                          f"replaces {'them' if more else 'it'}, or give another --out)")
    return out, latents_path


def warn_world_phase(model, step: int, verb: str = "generation") -> None:
    """Warn where the weights of ``step`` never trained with the world code (``model.net.world_curriculum``)."""
    phase = model.world_phase_of_weights(step)
    if phase != "quantized":
        curriculum = [int(n) for n in model.config.world_curriculum]
        print(f"warning: the checkpoint (step {step}) is in the {phase!r} phase of model.net.world_curriculum "
              f"{curriculum}: its predictor has not yet trained with the world code, which {verb} "
              f"feeds it (training does from step {model.quantized_world_from} on)", file=sys.stderr)


def _read_clips(args: argparse.Namespace, model, trained: int | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, str | None, float]:
    """From ``--start`` of ``--data``: the clip ``[1, t, C, H, W]`` (context and ground truth, as far as the file goes),
    the world encoder's (a training window, where the file has it), the file's ``codec`` attribute and frame rate."""
    c = model.config
    info = inspect_h5(args.data, c.in_channels, c.height, c.width, check_values=False)  # the frames read: below
    need_gt = args.actions == "inferred" and args.action_indices is None
    first, last = args.start, args.start + args.context + (args.steps if need_gt else 0)
    if args.start < 0 or last > info.frames:
        wanted = f"frame {first}" if last - first == 1 else f"frames {first} to {last - 1}"
        why = f" (--context {args.context} + --steps {args.steps} ground-truth frames for --actions inferred)" \
            if need_gt else ""
        raise DataError(f"{args.data}: {info.frames} frames, but the request reads {wanted}{why}")
    gt_end = min(info.frames, args.start + args.context + args.steps)
    world_end = min(info.frames, args.start + max(trained or args.context + args.steps, args.context))
    with h5py.File(args.data, "r") as f:
        block = np.asarray(f[info.key][args.start : max(gt_end, world_end)], dtype=np.float32)
        codec, fps = f.attrs.get("codec"), file_fps(f)
    check_frames(block, args.data, info.key, args.start)  # NaN in, NaN video out: refused
    x = torch.from_numpy(block)[None].to(device)
    return x[:, : gt_end - args.start], x[:, : world_end - args.start], codec, fps


def _given_codes(args: argparse.Namespace, model, transitions: int,
                 device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``--world-indices`` ``[1, Lh]`` and the ``transitions`` played of ``--action-indices`` (None: not given)."""
    given, played = [], f"{_count(args.context, 'frame')} of context, {args.steps} steps"
    for value, option, name, ndim in (args.world_indices, "--world-indices", "World_Encoder", 1), \
            (args.action_indices, "--action-indices", "Action_Encoder", 2):
        if value is None:
            given.append(None)
            continue
        sizes = model.quantizers[name].codebook_sizes
        bad = value.ndim != ndim or value.shape[-1] != len(sizes) or not ((0 <= value) & (value < sizes)).all()
        if bad or (ndim == 2 and len(value) < transitions):
            expected = f"[{len(sizes)}]" if ndim == 1 else f"[transitions, {len(sizes)}]"
            raise ConfigError(f"{option}: expected shape {expected} of codes 0..k-1 of each level's codebook size k "
                              f"({list(sizes)}), got {json.dumps(value.tolist())[:80]}" if bad else
                              f"{option}: {transitions} transitions needed ({played}), got {len(value)}")
        if ndim == 2 and len(value) > transitions:  # (the latents file records those played)
            print(f"warning: --action-indices: {len(value)} transitions given, the rollout plays the first "
                  f"{transitions} ({played}); --steps {len(value) - args.context + 1} plays them all", file=sys.stderr)
        value = value.astype(np.int64)
        given.append(torch.from_numpy(value[:transitions] if ndim == 2 else value[None]).to(device))
    return tuple(given)


def _codes(args: argparse.Namespace, model, clip: torch.Tensor, world_clip: torch.Tensor, trained: int | None,
           given: tuple, dictionaries: dict | None) -> tuple[Codes, Codes]:
    """Each rollout's world (``[R, Dh]``, ``[R, Lh]``) and actions (``[R, transitions, Da]``, ``[.., La]``): given,
    inferred, or drawn (actions after the context's own, inferred), in streams of their own, functions of --seed."""
    R, (given_world, given_actions) = args.rollouts, given
    q_world, q_action = model.quantizers["World_Encoder"], model.quantizers["Action_Encoder"]
    if given_world is None and args.world == "inferred":
        if trained and world_clip.shape[1] < trained:
            print(f"warning: --world inferred from {_count(world_clip.shape[1], 'frame')} of {args.data} (from "
                  f"--start {args.start}); training inferred it from {trained}: the code may differ from a whole "
                  f"window's", file=sys.stderr)
        inferred = model.encode_world(world_clip)
        world = inferred.quantized.expand(R, -1), inferred.indices.expand(R, -1)
    else:
        idx = given_world.expand(R, -1) if given_world is not None else dictionaries["World_Encoder"].sample(
            (R,), args.sampling, seeded_generator("cpu", args.seed, WORLD_DRAWS)).to(clip.device)
        world = q_world.decode_indices(idx), idx
    if given_actions is None and args.actions == "inferred":
        inferred = model.encode_actions(clip[:, : args.context + args.steps], window=trained)
        return world, (inferred.quantized.expand(R, -1, -1), inferred.indices.expand(R, -1, -1))
    if given_actions is not None:
        idx = given_actions[None].expand(R, -1, -1)
    else:
        draws = torch.Generator().manual_seed(args.seed)  # on the CPU: any device
        idx = (torch.cat([random_indices(q_action.codebook_sizes, (1, args.steps), draws) for _ in range(R)])
               if args.actions == "random" else  # one rollout after the other from one stream
               dictionaries["Action_Encoder"].sample((R, args.steps), args.sampling, draws)).to(clip.device)
        if args.context > 1:
            seen = model.encode_actions(clip[:, : args.context], window=trained).indices  # [1, c-1, La]
            idx = torch.cat([seen.expand(R, -1, -1), idx], dim=1)
    return world, (q_action.decode_indices(idx), idx)


def _write(args: argparse.Namespace, out: Path, latents_path: Path, rollouts: torch.Tensor, clip: torch.Tensor,
           decoder, codec: str | None, fps: float, played: dict, window: int | None, before: np.ndarray | None) -> None:
    """The latents (first: kept if the decoder or the video fails), then the video grid."""
    R, T = rollouts.shape[:2]
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(latents_path, "w") as f:
        for name, x in {"latents": rollouts, "ground_truth": clip[0].cpu(), **played}.items():  # [R, T, C, H, W], ..
            f[name] = x.numpy()
        f.attrs.update(source=str(args.data), start=args.start, context=args.context, actions=args.actions,
                       world=args.world, sampling=args.sampling, seed=args.seed, checkpoint=str(args.ckpt_path),
                       **({"window": window} if window is not None else {}))
    rows = [to_pixels(decoder, x, before) for x in (clip[0].cpu(), *rollouts)]  # grid blanks the end of a short one
    write_video(out, grid(rows), fps)
    shown = (f"decoded by the {decoder.name} codec" if decoder is not None else
             f"latent channels 0-2 shown as RGB: {missing_codec(codec, str(args.data))}")
    truth = "ground truth" if clip.shape[1] == T else f"ground truth: {clip.shape[1]} of {T} frames"
    megabytes = latents_path.stat().st_size / 1e6
    print(f"wrote {out} ({truth}, then {_count(R, 'rollout')} of "
          f"{_count(args.steps, 'frame')} after {_count(args.context, 'context frame')}; {shown}) and {latents_path} "
          f"({megabytes:.3g} MB: the rollouts' latents and the codes each played, which --action-indices and "
          f"--world-indices take back to play it again)")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
