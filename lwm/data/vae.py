"""Adapters for the diffusers 16-channel video VAEs: real video <-> lwm latents ``[t, 16, S/8, S/8]`` in [-1, 1]."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lwm.utils.errors import DataError, first_line

SPREAD = 4.0  # normalised latents are divided by this before clipping to [-1, 1]
TEMPORAL = 4  # video frames per latent step (after the first)
SPATIAL = 8  # pixels per latent cell
CLASSES = {"wan": "AutoencoderKLWan", "cogvideox": "AutoencoderKLCogVideoX", "hunyuan": "AutoencoderKLHunyuanVideo"}


def latent_frames(frames: int) -> int:
    """Latent steps of a video of ``frames`` frames: ``1 + (frames - 1) // 4``."""
    return 1 + (frames - 1) // TEMPORAL


def video_frames(latents: int) -> int:
    """Video frames that ``latents`` latent steps cover (and decode to): ``1 + 4 (latents - 1)``."""
    return 1 + TEMPORAL * (latents - 1)


def normalisation(name: str, config) -> tuple[list[float], list[float]]:
    """``(shift, scale)`` per channel with ``y = (z - shift) / scale`` for the VAE ``name`` with this config."""
    channels = int(config.get("z_dim", config.get("latent_channels", 16)))
    if name == "wan":
        return [float(m) for m in config["latents_mean"]], [float(s) * SPREAD for s in config["latents_std"]]
    factor = float(config["scaling_factor"])
    return [0.0] * channels, [SPREAD / factor] * channels


def _short(values) -> str:
    """A normalisation's values for a message: the first, and how many more."""
    return f"{float(values[0]):.4g}" + (f" (and {len(values) - 1} more)" if len(values) > 1 else "")


def geometry(name: str, config) -> tuple[int, int, int]:
    """``(spatial compression, temporal compression, patch size)`` that the VAE ``name``'s config declares."""
    if name == "wan":  # Wan 2.2's VAE is the same class with 16x space and 2x2 patches
        return (int(config.get("scale_factor_spatial") or 2 ** (len(config.get("dim_mult", [1] * 4)) - 1)),
                int(config.get("scale_factor_temporal") or TEMPORAL), int(config.get("patch_size") or 1))
    if name == "cogvideox":  # each down block but the last halves the size
        spatial = 2 ** (len(config.get("down_block_types", [None] * 4)) - 1)
        return spatial, int(config.get("temporal_compression_ratio", TEMPORAL)), 1
    return (int(config.get("spatial_compression_ratio", SPATIAL)),
            int(config.get("temporal_compression_ratio", TEMPORAL)), 1)


def load_vae(name: str, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             tiling: bool = False):
    """The diffusers VAE ``name`` from the local folder ``path`` (or its ``vae/``), in eval mode."""
    try:
        import diffusers
    except ImportError:
        raise DataError(f"the {name} codec needs diffusers, an optional extra: pip install 'lwm[vae]'") from None
    path = Path(path)
    try:  # --device cuda on a machine without CUDA: one line
        usable = torch.device(device).type != "cuda" or torch.cuda.is_available()
    except (RuntimeError, TypeError):
        usable = False
    if not usable:
        raise DataError(f"--device {device}: not a device torch can use on this machine (e.g. --device cpu)")
    try:  # (another class's weights fail to load, or leave tensors missing)
        vae, info = getattr(diffusers, CLASSES[name]).from_pretrained(
            path, subfolder="vae" if (path / "vae" / "config.json").is_file() else None, local_files_only=True,
            torch_dtype=dtype, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise DataError(f"--vae {path}: cannot load the {CLASSES[name]} ({first_line(e)})") from None
    missing = list(info.get("missing_keys") or []) + [k for k, *_ in info.get("mismatched_keys") or []]
    if missing:  # diffusers would go on with those weights random
        raise DataError(f"--vae {path}: the {CLASSES[name]}'s weights lack {len(missing)} tensors (e.g. "
                        f"{missing[0]}): incomplete or of another model")
    spatial, temporal, patch = geometry(name, vae.config)
    if (spatial, temporal, patch) != (SPATIAL, TEMPORAL, 1):
        raise DataError(f"--vae {path}: a {CLASSES[name]} of {spatial}x spatial and {temporal}x temporal compression"
                        f"{f' in {patch}x{patch} patches' if patch > 1 else ''}; the {name} codec takes "
                        f"{SPATIAL}x and {TEMPORAL}x without patches (Wan 2.1's VAE, not Wan 2.2's)")
    if tiling:
        vae.enable_tiling()
    return vae.to(device).eval()


@dataclass
class VAECodec:
    """RGB ``uint8 [F, S, S, 3]`` <-> latents ``float32 [1 + (F-1)//4, 16, S/8, S/8]`` in [-1, 1] through a VAE."""

    name: str
    vae: torch.nn.Module
    size: int = 512
    shift: tuple[float, ...] = ()
    scale: tuple[float, ...] = ()
    version: int = 1
    frames_per_latent: int = TEMPORAL

    @classmethod
    def load(cls, name: str, path: str | Path, size: int = 512, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, tiling: bool = False) -> VAECodec:
        """Load the VAE and take the normalisation from its config."""
        vae = load_vae(name, path, device, dtype, tiling)
        shift, scale = normalisation(name, vae.config)
        return cls(name, vae, size, tuple(shift), tuple(scale))

    @property
    def attr(self) -> str:
        """The h5 ``codec`` attribute: the transform ``y = (z - shift) / scale`` and the VAE's geometry."""
        return json.dumps({"name": self.name, "version": self.version, "size": self.size,
                           "frames_per_latent": self.frames_per_latent, "spatial": SPATIAL,
                           "shift": list(self.shift), "scale": list(self.scale)})

    def _affine(self, device) -> tuple[torch.Tensor, torch.Tensor]:  # shift, scale [C, 1, 1, 1]
        return tuple(torch.tensor(v, dtype=torch.float32, device=device)[:, None, None, None]
                     for v in (self.shift, self.scale))

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """``uint8 [F, S, S, 3]`` -> ``float32 [1 + (F-1)//4, 16, S/8, S/8]`` in [-1, 1]."""
        latents, _ = self.encode_counting(frames)
        return latents

    @torch.no_grad()
    def encode_counting(self, frames: np.ndarray) -> tuple[np.ndarray, int]:
        """:meth:`encode`, and how many values were clipped to [-1, 1]."""
        frames = np.asarray(frames)
        used = video_frames(latent_frames(len(frames)))
        device, dtype = next(self.vae.parameters()).device, next(self.vae.parameters()).dtype
        x = torch.from_numpy(frames[:used]).to(device).permute(3, 0, 1, 2)[None]  # [1, 3, F, S, S]
        x = (x.float() / 127.5 - 1.0).to(dtype)
        z = self.vae.encode(x).latent_dist.mode()[0].float()  # [C, t, S/8, S/8]
        shift, scale = self._affine(z.device)
        y = (z - shift) / scale
        clipped = int((y.abs() > 1).sum())
        return y.clamp(-1, 1).permute(1, 0, 2, 3).contiguous().cpu().numpy(), clipped

    @torch.no_grad()
    def decode(self, latents: np.ndarray, before: np.ndarray | None = None) -> np.ndarray:
        """``[t, 16, S/8, S/8]`` in [-1, 1] -> ``uint8 [1 + 4 (t-1), S, S, 3]``: the latents as a clip's start."""
        if before is not None and len(before):
            whole = np.concatenate([np.asarray(before, dtype=np.float32), np.asarray(latents, dtype=np.float32)])
            return self.decode(whole)[video_frames(len(before)):]
        device, dtype = next(self.vae.parameters()).device, next(self.vae.parameters()).dtype
        y = torch.as_tensor(np.asarray(latents, dtype=np.float32), device=device)
        shift, scale = self._affine(device)
        z = y.permute(1, 0, 2, 3) * scale + shift  # [C, t, h, w]
        t = z.shape[1]
        if self.name == "cogvideox" and t % 2 == 0:  # diffusers' CogVideoX decodes the latents after the first in pairs
            z = torch.cat([z, z[:, -1:]], dim=1)
        video = self.vae.decode(z[None].to(dtype)).sample[0].float()[:, : video_frames(t)]  # [3, F, S, S], ~[-1, 1]
        rgb = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return rgb.permute(1, 2, 3, 0).contiguous().cpu().numpy()

    @classmethod
    def from_attr(cls, spec: dict, vae_path: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, tiling: bool = False) -> VAECodec:
        """The codec a file's ``codec`` attribute describes, with the VAE weights from ``vae_path``."""
        vae = load_vae(spec["name"], vae_path, device, dtype, tiling)
        shift, scale = normalisation(spec["name"], vae.config)  # other weights of the class (CogVideoX 2b vs 5b):
        recorded = [float(v) for v in (*spec["shift"], *spec["scale"])]  # another scale, a wrong video silently
        if len(recorded) != len(shift) + len(scale) or not np.allclose(recorded, [*shift, *scale], rtol=1e-4):
            same_shift = len(spec["shift"]) == len(shift) and np.allclose(spec["shift"], shift, rtol=1e-4)
            field, loaded = ("scale", scale) if same_shift else ("shift", shift)  # (Wan: either may differ)
            raise DataError(f"--vae {vae_path}: not the weights the file was encoded with (its {spec['name']} "
                            f"normalisation differs: {field} {_short(loaded)} vs the file's {_short(spec[field])}); "
                            f"decode with the VAE that encoded it")
        return cls(spec["name"], vae, int(spec["size"]), tuple(spec["shift"]), tuple(spec["scale"]),
                   int(spec.get("version", 1)), int(spec.get("frames_per_latent", TEMPORAL)))
