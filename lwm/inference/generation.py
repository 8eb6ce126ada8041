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
    """The default video's name,
    ``FILE_START_CONTEXT+STEPS_ACTIONS-WORLD[_uniform][_codes-C][_windowW]_seedS_stepK.mp4`` (``K``: the
    checkpoint's global ``step``)."""
    transitions = args.context + args.steps - 1

    def source(text: str | None, option: str, ndim: int, chosen: str) -> str:
        if not text:
            return chosen
        value = _parse_indices(text, option, ndim)
        played = value[:transitions] if ndim == 2 and value.ndim == 2 else value
        return "given-" + hashlib.sha1(json.dumps(played.tolist()).encode()).hexdigest()[:6]

    actions = source(args.action_indices, "--action-indices", 2, args.actions)
    world = source(args.world_indices, "--world-indices", 1, args.world)
    drawn = "dictionary" in (actions, world)
    uniform = "_uniform" if drawn and args.sampling == "uniform" else ""  # draws of another distribution
    codes = f"_codes-{Path(args.codes).stem}" if drawn and args.codes else ""  # another dictionary
    window = f"_window{args.window}" if args.window is not None else ""
    return (f"{Path(args.data).stem}_{args.start}_{args.context}+{args.steps}_{actions}-{world}{uniform}{codes}{window}"
            f"_seed{args.seed}_step{step:07d}.mp4")


def _parse_indices(text: str, option: str, ndim: int) -> np.ndarray:
    """JSON integers (a tuple for ``ndim`` 1, a list of tuples for ``ndim`` 2); floats, bools, strings and ragged
    lists are refused in one line."""
    what = "a JSON list of integers, one per RVQ level" if ndim == 1 else "a JSON list of integer code tuples"
    try:
        parsed = json.loads(text)
        value, why = np.asarray(parsed), ""
    except (ValueError, TypeError) as e:  # not JSON, ragged lists
        value, why = None, f" ({e})"
    if value is None or value.dtype.kind not in "iu" or _has_bool(parsed):  # floats, strings, bools
        raise ConfigError(f"{option}: not {what}: {text[:80]}{why}")
    return value


def _indices(text: str, option: str, sizes: tuple[int, ...], ndim: int) -> torch.Tensor:
    """JSON code indices of a quantizer of codebook ``sizes``: one tuple, a code per level (``ndim`` 1), or a list of
    them (``ndim`` 2)."""
    value = _parse_indices(text, option, ndim)
    if value.ndim != ndim or value.shape[-1] != len(sizes) or (value < 0).any() or (value >= np.array(sizes)).any():
        expected = f"[{len(sizes)}]" if ndim == 1 else f"[transitions, {len(sizes)}]"
        raise ConfigError(f"{option}: expected shape {expected} of codes 0..k-1 of each level's codebook size k "
                          f"({list(sizes)}), got {text[:80]}")
    return torch.from_numpy(value.astype(np.int64))


def _has_bool(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, list) and any(_has_bool(v) for v in value))


def run(args: argparse.Namespace) -> Path:
    """``lwm generate``: checks, the checkpoint and the clip, the world and the actions, the rollouts, the files."""

    ckpt_path = checkpoint_file(args.ckpt_path)  # a run's folder: its latest checkpoint
    # missing, foreign, torn: said first (read memory-mapped: no weights loaded yet); its step names the video
    step = int(read_checkpoint(ckpt_path, what="lwm checkpoint")["global_step"])
    out, latents_path = _outputs(args, ckpt_path, step)
    drawn = (args.actions in ("dictionary", "random") and not args.action_indices,
             args.world == "dictionary" and not args.world_indices)
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
    given_world, given_actions = _given_codes(args, model, transitions, device)
    dictionaries = _dictionaries(args, ckpt_path, raw, model)
    clip, world_clip, codec, fps = _read_clips(args, model, trained, device)
    decoder = codec_from_attr(codec, str(args.data), args.vae, str(device), args.vae_tiling)  # before the work: a bad --vae fails now
    side = getattr(decoder, "size", None) if decoder is not None else PREVIEW_SCALE * model.config.height
    if out.suffix == ".mp4" and side:  # the grid's height, before the work
        check_mp4_size((1 + args.rollouts) * (side + GRID_PAD) - GRID_PAD, side, out)
    before = _latents_before(args, decoder, device)
    _warn_positions(model, trained, transitions)
    # the draws: the world's and the actions' in streams of their own, each a function of --seed alone, so
    # --world inferred and --world dictionary play the same drawn actions
    world_draws = seeded_generator("cpu", args.seed, WORLD_DRAWS)
    action_draws = torch.Generator().manual_seed(args.seed)  # from the dictionary
    random_action_draws = torch.Generator().manual_seed(args.seed)  # --actions random (on the CPU: any device)
    with torch.no_grad():
        world, world_idx = _world(args, model, world_clip, trained, given_world, dictionaries, world_draws)
        actions, action_idx = _actions(args, model, clip, trained, transitions, given_actions, dictionaries,
                                       action_draws, random_action_draws)  # [R, T, Da], [R, T, La]
        context = clip[:, : args.context].expand(args.rollouts, -1, -1, -1, -1)
        generated = model.generate(context, actions, world, args.steps, t0=0, window=window)  # [R, steps, C, H, W]
    rollouts = torch.cat([context, generated], dim=1).cpu()  # [R, context + steps, C, H, W]
    if args.fps is None and decoder is None:  # a latent preview
        spec = codec_spec(codec, str(args.data)) or {}  # frames_per_latent video frames of the file's rate
        fps = fps / max(1, int(spec.get("frames_per_latent", 1)))
    played = {"action_indices": action_idx.cpu(), "world_indices": world_idx.cpu(), "window": window}
    _write(args, out, latents_path, rollouts, clip, decoder, codec, args.fps or fps, played, before)
    return out


def _latents_before(args: argparse.Namespace, decoder, device: torch.device) -> np.ndarray | None:
    """The file's latents before ``--start`` where its codec is a video VAE (the decoders carry history: each row is
    decoded after them, as a decode of the whole file would; ``VAECodec.decode``), else None."""
    if decoder is None or getattr(decoder, "frames_per_latent", 1) == 1 or args.start == 0:
        return None
    print(f"note: each of the {1 + args.rollouts} rows is decoded after the file's {args.start} latents before "
          f"--start (the {decoder.name} VAE's decoder carries history: decoded alone, a window's frames would be "
          f"off)", file=sys.stderr)
    with h5py.File(args.data, "r") as f:
        return np.asarray(f[inspect_h5(args.data, check_values=False).key][: args.start], dtype=np.float32)


def _outputs(args: argparse.Namespace, ckpt_path: Path, step: int) -> tuple[Path, Path]:
    """The video (``--out``, else the default name in the run's ``generated/``) and its latents file, checked before
    any work."""
    out = Path(args.out) if args.out else _run_dir(ckpt_path) / "generated" / default_name(args, step)
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


def _warn_positions(model, trained: int | None, transitions: int) -> None:
    """A warning where the rollout feeds temporal positions past those training saw (a random start up to
    ``max_time_offset``, then a window's predictor inputs)."""
    last_position = transitions - 1  # the last frame fed to the predictor sits at temporal position T - 1
    offset = model.config.max_time_offset
    if trained and last_position > offset + trained - 2:
        print(f"warning: the rollout feeds temporal positions up to {last_position}; training saw up to "
              f"{offset + trained - 2} (a start up to model.net.max_time_offset {offset}, then the {trained - 1} predictor "
              f"inputs of a {trained}-frame window): later frames "
              f"are out of the trained range", file=sys.stderr)


def _run_dir(ckpt_path: Path) -> Path:
    """The run folder of a checkpoint: ``RUN_DIR`` of ``RUN_DIR/checkpoints/X.ckpt``, else the checkpoint's folder."""
    return ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent


def warn_world_phase(model, step: int, verb: str = "generation") -> None:
    """Under ``model.net.world_curriculum``, weights of global ``step`` that never trained with the world code (the
    predictor got no world token, or the encoder's output unquantized)."""
    phase = model.world_phase_of_weights(step)
    if phase != "quantized":
        curriculum = [int(n) for n in model.config.world_curriculum]
        print(f"warning: the checkpoint (step {step}) is in the {phase!r} phase of model.net.world_curriculum "
              f"{curriculum}: its predictor has not yet trained with the world code, which {verb} "
              f"feeds it (training does from step {model.quantized_world_from} on)", file=sys.stderr)


def _read_clips(args: argparse.Namespace, model, trained: int | None,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, str | None, float]:
    """From ``--data``: the clip from ``--start`` (context, and the ground truth as far as the rollout and the file
    go) ``[1, t, C, H, W]``, the world encoder's clip (a training window's length where the file has it), the
    file's ``codec`` attribute and frame rate."""
    c = model.config
    info = inspect_h5(args.data, c.in_channels, c.height, c.width, check_values=False)  # the frames read: below
    need_gt = args.actions == "inferred" and not args.action_indices
    first, last = args.start, args.start + args.context + (args.steps if need_gt else 0)
    if args.start < 0 or last > info.frames:
        wanted = f"frame {first}" if last - first == 1 else f"frames {first} to {last - 1}"
        why = f" (--context {args.context} + --steps {args.steps} ground-truth frames for --actions inferred)" \
            if need_gt else ""
        raise DataError(f"{args.data}: {info.frames} frames, but the request reads {wanted}{why}")
    with h5py.File(args.data, "r") as f:
        ds = f[info.key]
        gt_end = min(info.frames, args.start + args.context + args.steps)
        clip = torch.from_numpy(np.asarray(ds[args.start:gt_end], dtype=np.float32))[None].to(device)
        # the world encoder's clip: as long as in training (whatever --steps), or what the file has from --start
        world_end = min(info.frames, args.start + max(trained or args.context + args.steps, args.context))
        world_clip = torch.from_numpy(np.asarray(ds[args.start:world_end], dtype=np.float32))[None].to(device)
        codec, fps = f.attrs.get("codec"), file_fps(f)
    longer = clip if clip.shape[1] >= world_clip.shape[1] else world_clip  # (both from --start: one holds the other)
    check_frames(longer[0].cpu().numpy(), args.data, info.key, args.start)  # NaN in, NaN video out: refused
    return clip, world_clip, codec, fps


def _given_codes(args: argparse.Namespace, model, transitions: int,
                 device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The indices of ``--world-indices`` ``[1, Lh]`` and of the first ``transitions`` of ``--action-indices``
    ``[transitions, La]`` (None where not given), checked against the checkpoint's codebooks."""
    world = actions = None
    if args.world_indices:
        world = _indices(args.world_indices, "--world-indices", model.quantizers["World_Encoder"].codebook_sizes,
                         1).to(device)[None]
    if args.action_indices:
        idx = _indices(args.action_indices, "--action-indices", model.quantizers["Action_Encoder"].codebook_sizes, 2)
        if idx.shape[0] < transitions:
            raise ConfigError(f"--action-indices: {transitions} transitions needed ({_count(args.context, 'frame')} of context, "
                              f"{args.steps} steps), got {idx.shape[0]}")
        if idx.shape[0] > transitions:  # (the latents file records the ones played)
            print(f"warning: --action-indices: {idx.shape[0]} transitions given, the rollout plays the first "
                  f"{transitions} ({_count(args.context, 'frame')} of context, {args.steps} steps); --steps "
                  f"{idx.shape[0] - args.context + 1} plays them all", file=sys.stderr)
        actions = idx[:transitions].to(device)
    return world, actions


def _dictionaries(args: argparse.Namespace, ckpt_path: Path, raw: dict, model) -> dict | None:
    """The code dictionaries, where ``--world`` or ``--actions`` draws from one (else None), checked against the
    model."""
    needed = [name for name, used in (("Action_Encoder", args.actions == "dictionary" and not args.action_indices),
                                      ("World_Encoder", args.world == "dictionary" and not args.world_indices)) if used]
    return dictionaries_for(ckpt_path, args.codes, raw.get("global_step"), model, tuple(needed)) if needed else None


def _world(args: argparse.Namespace, model, world_clip: torch.Tensor, trained: int | None,
           given: torch.Tensor | None, dictionaries: dict | None, draws: torch.Generator) -> Codes:
    """The world of each rollout: its vector ``[R, Dh]`` and indices ``[R, Lh]``, given (``--world-indices`` ``[1,
    Lh]``), drawn from the dictionary, or inferred."""
    R, quantizer = args.rollouts, model.quantizers["World_Encoder"]
    if given is not None:
        idx = given.expand(R, -1)
    elif args.world == "dictionary":
        idx = dictionaries["World_Encoder"].sample((R,), args.sampling, draws).to(world_clip.device)
    else:
        if trained and world_clip.shape[1] < trained:
            print(f"warning: --world inferred from {_count(world_clip.shape[1], 'frame')} of {args.data} (from "
                  f"--start {args.start}); training inferred it from {trained}: the code may differ from a whole "
                  f"window's", file=sys.stderr)
        inferred = model.encode_world(world_clip)
        return inferred.quantized.expand(R, -1), inferred.indices.expand(R, -1)
    return quantizer.decode_indices(idx), idx


def _actions(args: argparse.Namespace, model, clip: torch.Tensor, trained: int | None, transitions: int,
             given: torch.Tensor | None, dictionaries: dict | None, draws: torch.Generator,
             random_draws: torch.Generator) -> Codes:
    """The actions of each rollout: vectors ``[R, transitions, Da]`` and indices ``[R, transitions, La]``, given
    (``--action-indices`` ``[transitions, La]``), inferred from the ground truth, or (``random``, ``dictionary``)
    the context's own transitions inferred and one drawn per step."""
    R, quantizer, device = args.rollouts, model.quantizers["Action_Encoder"], clip.device
    if given is not None:
        idx = given[None].expand(R, -1, -1)
        return quantizer.decode_indices(idx), idx
    if args.actions == "inferred":
        inferred = model.encode_actions(clip[:, : transitions + 1], window=trained)
        return inferred.quantized.expand(R, -1, -1), inferred.indices.expand(R, -1, -1)
    if args.actions == "random":  # one rollout after the other from one stream
        idx = torch.cat([random_indices(quantizer.codebook_sizes, (1, args.steps), random_draws) for _ in range(R)])
    else:
        idx = dictionaries["Action_Encoder"].sample((R, args.steps), args.sampling, draws)
    idx = idx.to(device)
    if args.context > 1:
        seen = model.encode_actions(clip[:, : args.context], window=trained).indices  # [1, c-1, La]
        idx = torch.cat([seen.expand(R, -1, -1), idx], dim=1)
    return quantizer.decode_indices(idx), idx


def _write(args: argparse.Namespace, out: Path, latents_path: Path, rollouts: torch.Tensor, clip: torch.Tensor,
           decoder, codec: str | None, fps: float, played: dict, before: np.ndarray | None = None) -> None:
    """The latents (first, before any decoding: kept if the decoder or the video fails) and the video grid."""
    R, T = rollouts.shape[:2]
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(latents_path, "w") as f:
        f["latents"] = rollouts.numpy()  # [R, T, C, H, W]
        f["ground_truth"] = clip[0].cpu().numpy()
        f["action_indices"] = played["action_indices"].numpy()
        f["world_indices"] = played["world_indices"].numpy()
        f.attrs["source"], f.attrs["start"], f.attrs["context"] = str(args.data), args.start, args.context
        f.attrs["actions"], f.attrs["world"], f.attrs["sampling"] = args.actions, args.world, args.sampling
        f.attrs["seed"], f.attrs["checkpoint"] = args.seed, str(args.ckpt_path)
        if played["window"] is not None:
            f.attrs["window"] = played["window"]
    if decoder is None:
        to_video = latent_preview
    elif before is not None:  # a VAE file's window from its middle
        to_video = lambda x: decoder.decode(x.float().numpy(), before)  # noqa: E731
    else:
        to_video = lambda x: decoder.decode(x.float().numpy())  # noqa: E731
    rows = [to_video(clip[0].cpu())] + [to_video(r) for r in rollouts]  # grid blanks the end of a short one
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
