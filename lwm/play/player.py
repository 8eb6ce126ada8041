"""What ``lwm play`` loads once (:class:`Player`) and each page's state (:class:`Session`: a start frame, a world code,
the rollout and its recording). No web here: :mod:`lwm.play.server` checks the page's requests."""

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
from lwm.inference.generation import to_pixels, warn_world_phase
from lwm.play.controls import key_bindings
from lwm.play.rollout import Rollout
from lwm.training.checkpoint import load_checkpoint, trained_window
from lwm.training.run_dir import checkpoint_file
from lwm.utils.errors import ConfigError, DataError
from lwm.utils.video import write_video

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
    """Latents to ``uint8 [.., S, S, 3]`` pixels through the files' codec, else latent channels 0-2 as RGB."""

    def __init__(self, decoder, why: str) -> None:
        self.decoder, self.why = decoder, why  # why: where there is no decoder, why (a phrase)
        self.name = decoder.name if decoder is not None else "latent channels 0-2"
        self.is_vae = getattr(decoder, "frames_per_latent", 1) > 1

    def video(self, latents: Tensor, before: np.ndarray | None = None) -> np.ndarray:
        """The video of ``latents [T, C, H, W]`` (a VAE: every frame, after the file's latents ``before``)."""
        return to_pixels(self.decoder, latents, before)

    def frames(self, new: Tensor, history: list[Tensor]) -> np.ndarray:
        """A frame per latent of ``new [K, C, H, W]`` (a VAE: the last video frame of each, decoded after the last
        :data:`VAE_HISTORY` latents of ``history``)."""
        if not self.is_vae:
            return self.video(new)
        before = torch.stack(history[-VAE_HISTORY:]).float().cpu().numpy() if history else None
        return np.stack([self.video(x[None], before)[-1] for x in new])


@dataclass(eq=False)
class Player:
    """The model and everything the sessions share (read only once loaded)."""

    model: torch.nn.Module
    ckpt_path: Path
    global_step: int
    trained: int | None  # frames per training window (None: unknown)
    dictionaries: dict
    files: list[DataFile]
    display: Display
    fps: float  # the data's frame rate
    hold_fps: float  # steps per second while a key is held
    device: torch.device

    def __post_init__(self) -> None:
        self.window = self.trained - 1 if self.trained else None  # predictor inputs, as `lwm generate`'s default
        self.number_keys, self.arrow_keys, self.noop_key = key_bindings(
            self.model, self.dictionaries["Action_Encoder"], [f.path for f in self.files], self.trained, self.device)

    def world_choices(self) -> list[dict]:
        """The dictionary's most frequent world tuples with their shares."""
        d = self.dictionaries["World_Encoder"]
        order = torch.argsort(d.counts, descending=True, stable=True)[:WORLD_CHOICES]
        return [{"indices": d.tuples[i].tolist(), "share": float(d.counts[i]) / d.total} for i in order.tolist()]

    def read(self, file: int, frame: int, frames: int = 1) -> Tensor:
        """Frames ``frame..frame+frames-1`` of file number ``file`` (as far as it has them), ``[t, C, H, W]``."""
        f = self.files[file]
        with h5py.File(f.path, "r") as h5:
            block = np.asarray(h5[f.key][frame : frame + frames], dtype=np.float32)
        check_frames(block, f.path, f.key, frame)
        return torch.from_numpy(block).to(self.device)

    def infer_world(self, file: int, frame: int) -> Tensor:
        """The world code tuple ``[Lh]`` of the clip from ``frame`` of file ``file``."""
        with torch.no_grad():
            return self.model.encode_world(self.read(file, frame, self.trained or 1)[None]).indices[0].cpu()

    def before(self, file: int, frame: int) -> np.ndarray | None:
        """A VAE file's latents before ``frame``, which its decoder needs for the frames from there (else None)."""
        return self.read(file, 0, frame).cpu().numpy() if self.display.is_vae and frame > 0 else None


class Session:
    """One page's play: a start (file, frame), a world code, the rollout from there."""

    def __init__(self, player: Player, sid: str) -> None:
        self.player, self.sid = player, sid
        self.lock = threading.Lock()  # one request at a time
        self.world_mode = "own"
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
        if mode == "dictionary":
            choice = self.player.world_choices()[index]
            self.world_indices = torch.tensor(choice["indices"])
            self.world_source = f"dictionary tuple {tuple(choice['indices'])} ({choice['share']:.0%})"
        elif mode == "clip":
            self.world_indices = self.player.infer_world(file, frame)
            self.world_source = f"inferred from {self.player.files[file].path.name} from frame {frame}"
        self.world_mode = mode
        self.start(self.file, self.frame)

    @property
    def path(self) -> Path:
        return self.player.files[self.file].path

    def step(self, action: list[int]) -> Tensor:
        """Play ``action`` (one code per level): the next frame ``[C, H, W]``."""
        return self.rollout.step(torch.tensor(action))

    def undo(self) -> bool:
        return self.rollout.undo()

    def reset(self) -> None:
        self.start(self.file, self.frame)

    def pixels(self) -> np.ndarray:
        """The current frame's pixels ``[S, S, 3]``."""
        return self.player.display.frames(self.rollout.frames[-1][None], self.rollout.frames[:-1])[0]

    def previews(self, keys: slice = slice(None)) -> np.ndarray:
        """The pixels of the next frame under each number key's tuple (those of ``keys``), ``[K, S, S, 3]``."""
        actions = torch.tensor([b.action for b in self.player.number_keys[keys]])
        return self.player.display.frames(self.rollout.previews(actions), self.rollout.frames)

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
        command = shlex.join([
            "lwm", "generate", "--ckpt_path", str(p.ckpt_path), "--data", str(self.path), "--start", str(self.frame),
            "--context", "1", "--steps", str(len(actions)), "--rollouts", "1",
            "--action-indices", json.dumps(actions, separators=(",", ":")),
            "--world-indices", json.dumps(world, separators=(",", ":")),
        ]) if actions else None
        return {"checkpoint": str(p.ckpt_path), "global_step": p.global_step, "data": str(self.path),
                "start": self.frame, "steps": len(actions), "window": p.window, "action_indices": actions,
                "world_indices": world, "world_source": self.world_source, "command": command}

    def video(self, suffix: str) -> bytes:
        """The session's frames as an ``.mp4`` or ``.gif`` file's bytes, enlarged to at least :data:`RECORDING_SIDE`."""
        frames = self.player.display.video(self.rollout.latents(), self.player.before(self.file, self.frame))
        scale = max(1, -(-RECORDING_SIDE // frames.shape[1]))
        with tempfile.TemporaryDirectory() as tmp:
            frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
            return write_video(Path(tmp) / f"play{suffix}", frames, self.player.fps).read_bytes()


def load_player(ckpt_path: str, data: list[str], manifest: str | None, codes: str | None, vae: str | None,
                vae_tiling: bool, hold_fps: float) -> Player:
    """Everything ``lwm play`` needs, checked, each problem one line naming the file."""
    path = checkpoint_file(ckpt_path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    raw, module = load_checkpoint(path, map_location=device)
    model, step = module.model.eval(), int(raw["global_step"])
    dictionaries = dictionaries_for(path, codes, raw.get("global_step"), model)  # the keys play its action tuples
    warn_world_phase(model, step, "play")
    files = _data_files(model, data, manifest, raw)
    with h5py.File(files[0].path, "r") as f:
        attr, fps = f.attrs.get("codec"), file_fps(f)
    decoder = codec_from_attr(attr, str(files[0].path), vae, str(device), vae_tiling)
    display = Display(decoder, "" if decoder is not None else missing_codec(attr, str(files[0].path)))
    return Player(model, path, step, trained_window(raw), dictionaries, files, display, fps, hold_fps, device)


def _data_files(model, data: list[str], manifest: str | None, raw: dict) -> list[DataFile]:
    """``--data`` files, else the ``--manifest``'s, else those of the manifest the checkpoint trained on."""
    shape = [model.config.in_channels, model.config.height, model.config.width]
    if data:  # (their values are checked as they are read)
        infos = [inspect_h5(p, *shape, check_values=False) for p in data]
        return [DataFile(Path(p), info.key, info.frames) for p, info in zip(data, infos)]
    if manifest is None:
        manifest = (raw.get("datamodule_hyper_parameters") or {}).get("manifest")
        if not manifest or not Path(manifest).is_file():
            raise ConfigError("no data to start from: give --data FILE.h5 or --manifest M (the checkpoint's training "
                              f"manifest {manifest or '(not recorded)'} is not there)")
        print(f"lwm play: the files of the training manifest {manifest} (--data or --manifest for others)",
              file=sys.stderr)
    m = Manifest.load(manifest)
    if [m.channels, m.height, m.width] != shape:
        raise DataError(f"{manifest}: latents [{m.channels}, {m.height}, {m.width}], but the checkpoint's model takes "
                        f"{shape}")
    return [DataFile(m.resolve(e), e.key, e.frames) for e in m.entries]
