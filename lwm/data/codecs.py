"""Codecs between video frames and lwm's 16-channel latents ``[T, 16, 64, 64]`` in [-1, 1]."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange

from lwm.data.vae import CLASSES, VAECodec
from lwm.utils.errors import DataError

LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # ITU-R BT.601


@dataclass(frozen=True)
class PixelCodec:
    """RGB ``uint8 [T, 128, 128, 3]`` <-> latents ``float32 [T, 16, 64, 64]`` in [-1, 1]."""

    size: int = 128  # frame height and width in pixels
    name: str = "pixel"
    version: int = 1
    frames_per_latent: int = 1  # video frames per latent step

    @property
    def attr(self) -> str:
        """The h5 ``codec`` attribute of files this codec wrote."""
        return json.dumps({"name": self.name, "version": self.version, "size": self.size})

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """``uint8 [T, S, S, 3]`` -> ``float32 [T, 16, S/2, S/2]`` in [-1, 1]."""
        rgb = torch.from_numpy(np.asarray(frames, dtype=np.float32))  # [T, S, S, 3] in 0..255
        luma = rgb @ torch.from_numpy(LUMA)  # [T, S, S]
        colour = rearrange(rgb, "t (h a) (w b) c -> t (c a b) h w", a=2, b=2)  # [T, 12, S/2, S/2]
        bright = rearrange(luma, "t (h a) (w b) -> t (a b) h w", a=2, b=2)  # [T, 4, S/2, S/2]
        return (torch.cat([colour, bright], dim=1) / 127.5 - 1.0).numpy()

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """``[T, 16, S/2, S/2]`` in [-1, 1] -> ``uint8 [T, S, S, 3]`` (from the colour channels)."""
        latents = torch.as_tensor(np.asarray(latents, dtype=np.float32))
        colour = ((latents[:, :12].clamp(-1, 1) + 1.0) * 127.5).round()
        rgb = rearrange(colour, "t (c a b) h w -> t (h a) (w b) c", a=2, b=2)
        return rgb.to(torch.uint8).numpy()


def codec_spec(attr: object, path: str = "") -> dict | None:
    """A file's ``codec`` attribute parsed (None when there is none)."""
    if attr is None:
        return None
    try:
        spec = json.loads(attr if isinstance(attr, str) else bytes(attr).decode())
    except (ValueError, TypeError):  # (UnicodeDecodeError is a ValueError)
        spec = None
    if not isinstance(spec, dict) or "name" not in spec:
        raise DataError(f"{path}: attribute 'codec' is not JSON with a 'name': {str(attr)[:80]}")
    return spec


def codec_from_attr(attr: object, path: str = "", vae: str | None = None, device: str = "cpu", tiling: bool = False):
    """The codec a file's ``codec`` attribute names; None where there is none, it is unknown, or it is a VAE
    (:mod:`lwm.data.vae`) and no ``vae`` weights folder is given."""
    spec = codec_spec(attr, path)
    if vae is not None and (spec is None or spec["name"] not in CLASSES):
        raise DataError(f"--vae {vae}: {path} is not encoded with a VAE ({missing_codec(attr, path)}): leave --vae "
                        f"out")
    if spec is not None and spec["name"] == "pixel":
        return PixelCodec(size=int(spec.get("size", 128)))
    return VAECodec.from_attr(spec, vae, device, tiling=tiling) if vae is not None else None


def missing_codec(attr: object, path: str = "") -> str:
    """Why :func:`codec_from_attr` gave None, as a phrase for messages."""
    spec = codec_spec(attr, path)
    if spec is None:
        return "the file names no codec"
    if spec["name"] == "pixel":
        return "the file names the pixel codec, which has no weights"
    if spec["name"] in CLASSES:
        return f"the file was encoded with the {spec['name']} VAE: pass --vae PATH (its diffusers weights) to decode it"
    return f"the file names a codec lwm does not know ({spec['name']!r})"
