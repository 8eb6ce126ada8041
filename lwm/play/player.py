"""What ``lwm play`` loads once (:class:`Player`: the model, its code dictionaries, the data files, the codec to
pixels, the keys) and the state of each page (:class:`Session`: a start frame, a world code, the rollout, and its
recording as ``lwm generate --action-indices/--world-indices`` replays it). No web here: :mod:`lwm.play.server`.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch
from torch import Tensor

from lwm.data.codecs import codec_from_attr, missing_codec
from lwm.data.h5 import check_frames, file_fps, inspect_h5
from lwm.data.manifest import Manifest
from lwm.inference.dictionary import dictionaries_for
from lwm.inference.generation import warn_world_phase
from lwm.play.controls import action_names, Binding, cooccurrence, most_frequent_noop, number_keys, true_action_keys
from lwm.play.rollout import Rollout
from lwm.training.checkpoint import load_checkpoint, read_checkpoint, trained_window
from lwm.training.run_dir import checkpoint_file
from lwm.utils.errors import ConfigError, DataError
from lwm.utils.video import latent_preview, write_video

VAE_HISTORY = 3  # latents a video VAE decodes before a new one on the page
WORLD_CHOICES = 32  # the dictionary's most frequent world tuples offered on the page
RECORDING_SIDE = 256  # recorded videos are enlarged
WORLD_MODES = ("own", "dictionary", "clip")  # the start clip's own world, a dictionary tuple, another clip's


@dataclass(frozen=True)
class DataFile:
    """A file the page can start from."""

    path: Path
    key: str  # its latents dataset
    frames: int


class Display:
    """Latents to ``uint8 [.., S, S, 3]`` pixels through the files' codec (pixel, a diffusers VAE), else latent
    channels 0-2 as RGB."""

    def __init__(self, decoder, why: str) -> None:
        self.decoder = decoder
        self.name = decoder.name if decoder is not None else "latent channels 0-2"
        self.why = why  # where there is no decoder: why (a phrase)

    @property
    def is_vae(self) -> bool:
        return getattr(self.decoder, "frames_per_latent", 1) > 1

    def frames(self, new: Tensor, history: Tensor | None = None) -> np.ndarray:
        """The pixels of each latent of ``new [K, C, H, W]``, ``[K, S, S, 3]`` (a VAE: the last video frame of each,
        decoded after the latents of ``history [h, C, H, W]`` before it)."""

        if self.decoder is None:
            return latent_preview(new.cpu())
        if not self.is_vae:
            return self.decoder.decode(new.float().cpu().numpy())
        before = None if history is None or not len(history) else history[-VAE_HISTORY:].float().cpu().numpy()
        return np.stack([self.decoder.decode(x[None].float().cpu().numpy(), before)[-1] for x in new])

    def video(self, latents: Tensor, before: np.ndarray | None = None) -> np.ndarray:
        """The video of ``latents [T, C, H, W]`` (a VAE: every frame, after the file's latents ``before``)."""

        if self.decoder is None:
            return latent_preview(latents.cpu())
        if self.is_vae:
            return self.decoder.decode(latents.float().cpu().numpy(), before)
        return self.decoder.decode(latents.float().cpu().numpy())


class Player:
    """The model and everything the sessions share (read only once loaded)."""

    def __init__(self, model, ckpt_path: Path, global_step: int, trained: int | None, dictionaries: dict,
                 files: list[DataFile], display: Display, fps: float, hold_fps: float, device: torch.device) -> None:
        self.model = model
        self.ckpt_path = ckpt_path
        self.global_step = global_step
        self.trained = trained  # frames per training window (None: unknown)
        self.window = trained - 1 if trained else None  # predictor inputs attended, as `lwm generate`'s default
        self.dictionaries = dictionaries
        self.files = files
        self.display = display
        self.fps = fps  # the data's frame rate
        self.hold_fps = hold_fps  # steps per second while a key is held
        self.device = device
        self.number_keys = number_keys(dictionaries["Action_Encoder"].tuples, dictionaries["Action_Encoder"].counts)
        self.arrow_keys: list[Binding] = []
        self.noop_key = most_frequent_noop(self.number_keys)

    def map_true_actions(self, max_files: int | None = None) -> None:
        """Arrow / WASD keys (and a named no-op) from the labeled files' true actions, where they have any."""
        counts = cooccurrence(self.model, [f.path for f in self.files], self.trained, self.device,
                              **({"max_files": max_files} if max_files else {}))
        labeled = next((f.path for f in self.files if _has_actions(f.path)), None) if counts else None
        arrows, noop = true_action_keys(counts, action_names(labeled) if labeled else {})
        self.arrow_keys = arrows
        if noop is not None:
            self.noop_key = noop

    @property
    def bindings(self) -> list[Binding]:
        return [*self.number_keys, *self.arrow_keys, self.noop_key]

    def world_choices(self) -> list[dict]:
        """The dictionary's most frequent world tuples with their shares."""
        d = self.dictionaries["World_Encoder"]
        order = torch.argsort(d.counts, descending=True, stable=True)[:WORLD_CHOICES]
        return [{"indices": d.tuples[i].tolist(), "share": float(d.counts[i]) / d.total} for i in order.tolist()]

    def read(self, file: int, frame: int, frames: int = 1) -> Tensor:
        """Frames ``frame..frame+frames-1`` of file number ``file`` (as far as it has them), ``[t, C, H, W]`` on the
        device."""

        if not (0 <= file < len(self.files) and 0 <= frame < self.files[file].frames):
            has = f"; {self.files[file].path} frames 0..{self.files[file].frames - 1}" if 0 <= file < len(self.files) \
                else ""
            raise ConfigError(f"file {file} frame {frame}: the page has files 0..{len(self.files) - 1}{has}")
        f = self.files[file]
        with h5py.File(f.path, "r") as h5:
            block = np.asarray(h5[f.key][frame : frame + frames], dtype=np.float32)
        check_frames(block, f.path, f.key, frame)
        return torch.from_numpy(block).to(self.device)

    def infer_world(self, file: int, frame: int) -> Tensor:
        """The world code tuple ``[Lh]`` of the clip from ``frame`` of file ``file``."""
        clip = self.read(file, frame, self.trained or 1)
        with torch.no_grad():
            return self.model.encode_world(clip[None]).indices[0].cpu()

    def before(self, file: int, frame: int) -> np.ndarray | None:
        """A VAE file's latents before ``frame``, which its decoder needs for the frames from there (else None)."""
        if not self.display.is_vae or frame == 0:
            return None
        return self.read(file, 0, frame).cpu().numpy()


def _has_actions(path: Path) -> bool:
    with h5py.File(path, "r") as f:
        return "actions" in f


class Session:
    """One page's play: a start (file, frame), a world code, the rollout from there."""

    def __init__(self, player: Player, sid: str) -> None:
        self.player = player
        self.sid = sid
        self.lock = threading.Lock()  # one request at a time
        self.file, self.frame = 0, 0
        self.world_mode, self.world_source = "own", ""
        self.world_indices = torch.zeros(0, dtype=torch.long)
        self.rollout: Rollout | None = None
        self.start(0, 0)

    def start(self, file: int, frame: int) -> None:
        """Start from ``frame`` of file ``file`` (the world: the new clip's own, unless one was picked)."""
        latent = self.player.read(file, frame)[0]
        self.file, self.frame = file, frame
        if self.world_mode == "own":
            self.world_indices = self.player.infer_world(file, frame)
            self.world_source = f"the start clip's own ({self.path.name} from frame {frame})"
        self.rollout = Rollout(self.player.model, latent, self.world_indices, self.player.window)

    def set_world(self, mode: str, index: int = 0, file: int = 0, frame: int = 0) -> None:
        """The world code: the start clip's own (``own``), the dictionary's ``index``-th most frequent tuple
        (``dictionary``), or inferred from ``frame`` of file ``file`` (``clip``)."""
        choices = self.player.world_choices()
        if mode not in WORLD_MODES or (mode == "dictionary" and not 0 <= index < len(choices)):
            raise ConfigError(f"world: mode {mode!r}, index {index}: the page offers the modes "
                              f"{', '.join(WORLD_MODES)}, and dictionary tuples 0..{len(choices) - 1}")
        if mode == "dictionary":
            self.world_indices = torch.tensor(choices[index]["indices"])
            self.world_source = f"dictionary tuple {tuple(choices[index]['indices'])} ({choices[index]['share']:.0%})"
        elif mode == "clip":
            self.world_indices = self.player.infer_world(file, frame)
            self.world_source = f"inferred from {self.player.files[file].path.name} from frame {frame}"
        self.world_mode = mode
        self.start(self.file, self.frame)

    @property
    def path(self) -> Path:
        return self.player.files[self.file].path

    def step(self, action: list[int]) -> Tensor:
        """Play ``action`` (one code per level): the next frame ``[C, H, W]``; anything else is one line."""
        try:  # decode_indices checks the levels, the type and the range
            self.player.model.quantizers["Action_Encoder"].decode_indices(torch.tensor(action)[None])
        except (TypeError, ValueError, RuntimeError) as e:  # (torch.tensor of text, None: TypeError, RuntimeError)
            raise ConfigError(f"action {action!r}: {e}") from None
        return self.rollout.step(torch.tensor(action))

    def undo(self) -> bool:
        return self.rollout.undo()

    def reset(self) -> None:
        self.start(self.file, self.frame)

    def pixels(self) -> np.ndarray:
        """The current frame's pixels ``[S, S, 3]``."""
        frames = self.rollout.frames
        history = torch.stack(frames[-1 - VAE_HISTORY : -1]) if self.player.display.is_vae and len(frames) > 1 else None
        return self.player.display.frames(frames[-1][None], history)[0]

    def previews(self, keys: slice = slice(None)) -> np.ndarray:
        """The pixels of the next frame under each number key's tuple (those of ``keys``), ``[K, S, S, 3]``."""
        actions = torch.tensor([b.action for b in self.player.number_keys[keys]])
        history = torch.stack(self.rollout.frames[-VAE_HISTORY:]) if self.player.display.is_vae else None
        return self.player.display.frames(self.rollout.previews(actions), history)

    def state(self) -> dict:
        """What the page shows besides the frame."""
        r, p = self.rollout, self.player
        trained_positions = p.model.config.max_time_offset + p.trained - 2 if p.trained else None
        return {"sid": self.sid, "step": r.steps, "file": self.file, "frame": self.frame, "path": str(self.path),
                "world": r.world_indices.tolist(), "world_mode": self.world_mode, "world_source": self.world_source,
                "can_undo": r.steps > 0, "last_action": r.actions[-1].tolist() if r.actions else None,
                "past_trained": trained_positions is not None and r.steps - 1 > trained_positions}

    def recording(self) -> dict:
        """The session as JSON: its codes and the ``lwm generate`` command that plays the same frames."""
        r, p = self.rollout, self.player
        actions, world = r.action_indices().tolist(), r.world_indices.tolist()
        command = None
        if actions:
            command = shlex.join([
                "lwm", "generate", "--ckpt_path", str(p.ckpt_path), "--data", str(self.path), "--start",
                str(self.frame), "--context", "1", "--steps", str(len(actions)), "--rollouts", "1",
                "--action-indices", json.dumps(actions, separators=(",", ":")),
                "--world-indices", json.dumps(world, separators=(",", ":")),
            ])
        return {"checkpoint": str(p.ckpt_path), "global_step": p.global_step, "data": str(self.path),
                "start": self.frame, "steps": len(actions), "window": p.window, "action_indices": actions,
                "world_indices": world, "world_source": self.world_source, "command": command}

    def video(self, suffix: str) -> bytes:
        """The session's frames as an ``.mp4`` or ``.gif`` file's bytes (the start frame first), at the data's fps,
        enlarged (nearest) to at least :data:`RECORDING_SIDE` pixels."""

        frames = self.player.display.video(self.rollout.latents(), self.player.before(self.file, self.frame))
        scale = max(1, -(-RECORDING_SIDE // frames.shape[1]))
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
        with tempfile.TemporaryDirectory() as tmp:
            out = write_video(Path(tmp) / f"play{suffix}", frames, self.player.fps)
            return out.read_bytes()


def load_player(ckpt_path: str, data: list[str], manifest: str | None, codes: str | None, vae: str | None,
                vae_tiling: bool, hold_fps: float) -> Player:
    """Everything ``lwm play`` needs, checked, each problem one line naming the file."""
    path = checkpoint_file(ckpt_path)
    step = int(read_checkpoint(path, what="lwm checkpoint")["global_step"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw, module = load_checkpoint(path, map_location=device)
    model = module.model.eval()
    dictionaries = dictionaries_for(path, codes, raw.get("global_step"), model)  # the keys play its action tuples
    warn_world_phase(model, step, "play")
    files = _data_files(model, data, manifest, raw)
    with h5py.File(files[0].path, "r") as f:
        attr, fps = f.attrs.get("codec"), file_fps(f)
    decoder = codec_from_attr(attr, str(files[0].path), vae, str(device), vae_tiling)
    display = Display(decoder, "" if decoder is not None else missing_codec(attr, str(files[0].path)))
    player = Player(model, path, step, trained_window(raw), dictionaries, files, display, fps, hold_fps, device)
    player.map_true_actions()
    return player


def _data_files(model, data: list[str], manifest: str | None, raw: dict) -> list[DataFile]:
    """The files to start from: ``--data`` files, else the ``--manifest``'s, else the manifest the checkpoint trained
    on."""

    c = model.config
    shape = [c.in_channels, c.height, c.width]
    if data:  # (their values are checked as they are read)
        infos = [inspect_h5(p, *shape, check_values=False) for p in data]
        return [DataFile(Path(p), info.key, info.frames) for p, info in zip(data, infos)]
    if manifest is None:
        trained_on = (raw.get("datamodule_hyper_parameters") or {}).get("manifest")
        if not trained_on or not Path(trained_on).is_file():
            raise ConfigError("no data to start from: give --data FILE.h5 or --manifest M (the checkpoint's training "
                              f"manifest {trained_on or '(not recorded)'} is not there)")
        manifest = trained_on
        print(f"lwm play: the files of the training manifest {manifest} (--data or --manifest for others)",
              file=sys.stderr)
    m = Manifest.load(manifest)
    if [m.channels, m.height, m.width] != shape:
        raise DataError(f"{manifest}: latents [{m.channels}, {m.height}, {m.width}], but the checkpoint's model takes "
                        f"{shape}")
    return [DataFile(m.resolve(e), e.key, e.frames) for e in m.entries]
