"""The diffusers video-VAE adapters on tiny randomly initialised configs (no weights can be downloaded)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types

import h5py
import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from lwm.data.codecs import codec_from_attr, missing_codec  # noqa: E402
from lwm.data.convert import decode_file, encode_videos  # noqa: E402
from lwm.data.vae import CLASSES, SPREAD, VAECodec, latent_frames, video_frames  # noqa: E402
from lwm.utils.errors import DataError  # noqa: E402

TINY = {
    "wan": dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                latents_mean=[0.1 * i for i in range(16)], latents_std=[0.5 + 0.1 * i for i in range(16)]),
    "cogvideox": dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16,
                      scaling_factor=0.7),
    "hunyuan": dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16,
                    mid_block_add_attention=False, scaling_factor=0.5),
}
SIZE = 32  # tiny frames: 4x4 latents


@pytest.fixture(scope="module")
def vae_dirs(tmp_path_factory):
    """Each tiny VAE saved as diffusers weights; wan as a pipeline folder with a ``vae/`` subfolder."""
    root = tmp_path_factory.mktemp("vaes")
    dirs = {}
    for name, kwargs in TINY.items():
        torch.manual_seed(0)
        vae = getattr(diffusers, CLASSES[name])(**kwargs)
        dirs[name] = root / name
        vae.save_pretrained(dirs[name] / "vae" if name == "wan" else dirs[name])
    return dirs


def frames(n: int = 9, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", sorted(TINY))
def test_encode_applies_the_vaes_own_normalisation_and_decode_inverts_it(name, vae_dirs):
    codec = VAECodec.load(name, vae_dirs[name], size=SIZE)
    video = frames(10)  # 10 frames: 3 latents cover 9, the last is dropped
    y = codec.encode(video)
    assert y.shape == (3, 16, SIZE // 8, SIZE // 8) and y.dtype == np.float32
    assert np.abs(y).max() <= 1.0

    x = torch.from_numpy(video[:9]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        z = codec.vae.encode(x).latent_dist.mode()[0].permute(1, 0, 2, 3).numpy()  # [t, C, h, w]
    config = TINY[name]
    if name == "wan":
        normalised = (z - np.array(config["latents_mean"])[:, None, None]) / np.array(config["latents_std"])[:, None, None]
    else:
        normalised = z * config["scaling_factor"]
    np.testing.assert_allclose(y, np.clip(normalised / SPREAD, -1, 1), rtol=1e-5, atol=1e-6)

    # the h5 attribute alone (plus the weights) decodes: the recorded transform inverts the encoding
    again = codec_from_attr(codec.attr, "f.h5", vae=str(vae_dirs[name]))
    decoded = again.decode(y)
    assert decoded.shape == (9, SIZE, SIZE, 3) and decoded.dtype == np.uint8
    with torch.no_grad():
        expected = codec.vae.decode(torch.from_numpy(z).permute(1, 0, 2, 3)[None]).sample[0]
    expected = ((expected.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    assert np.abs(normalised / SPREAD).max() <= 1  # nothing clipped, so decoding must give the VAE's own decode
    assert np.abs(decoded.astype(int) - expected.astype(int)).max() <= 1  # float rounding only


@pytest.mark.parametrize("name", sorted(TINY))
def test_decode_gives_the_frames_of_every_latent_count(name, vae_dirs):
    """t latents decode to 1 + 4 (t - 1) frames; for the causal decoders (Wan; CogVideoX up to its frame batches)
    the first frames of a longer clip's decode. CogVideoX decodes an even count in pairs without the lone first
    latent (2 latents: 8 frames, shifted in time): lwm pads it. (HunyuanVideo's GroupNorms span the frames.)"""
    codec = VAECodec.load(name, vae_dirs[name], size=SIZE)
    y = codec.encode(frames(17))  # 5 latents
    full = codec.decode(y)
    assert full.shape[0] == 17
    for t in (1, 2, 3, 4):
        part = codec.decode(y[:t])
        assert part.shape[0] == video_frames(t)
        if name != "hunyuan":
            assert np.abs(part.astype(int) - full[: len(part)].astype(int)).max() <= 8, t


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_tiled_decoding_splits_large_frames_and_stays_close(name, vae_dirs):
    """``--vae-tiling`` (``tiling=True``): 320 px frames are decoded in the VAE's 256 px tiles, blended: the same
    video up to the seams (a tiny random VAE: a few levels on average), not the same bytes (tiles were used)."""
    size = 320
    plain = VAECodec.load(name, vae_dirs[name], size=size)
    tiled = codec_from_attr(plain.attr, "f.h5", vae=str(vae_dirs[name]), tiling=True)
    assert tiled.vae.use_tiling and not plain.vae.use_tiling
    y = np.random.default_rng(0).uniform(-0.5, 0.5, (2, 16, size // 8, size // 8)).astype(np.float32)
    a, b = plain.decode(y).astype(int), tiled.decode(y).astype(int)
    assert a.shape == b.shape == (5, size, size, 3)
    assert 0 < np.abs(a - b).mean() < 8


@pytest.mark.parametrize("tiling", [False, True])
def test_decode_command_hands_vae_and_tiling_to_the_codec(tmp_path, monkeypatch, tiling):
    """``lwm data decode --vae PATH [--vae-tiling]`` load the VAE with tiling as asked (a stand-in VAE codec)."""
    from lwm.cli.main import main

    path = tmp_path / "clip.h5"
    with h5py.File(path, "w") as f:
        f["latents"] = np.zeros((2, 16, 4, 4), np.float16)
        f.attrs["codec"] = json.dumps({"name": "wan", "version": 1, "size": SIZE, "shift": [0.0] * 16,
                                       "scale": [1.0] * 16})
    asked = []

    def from_attr(spec, vae_path, device="cpu", dtype=torch.float32, tiling=False):
        asked.append((spec["name"], str(vae_path), tiling))
        return types.SimpleNamespace(decode=lambda latents: np.zeros((5, SIZE, SIZE, 3), np.uint8))

    monkeypatch.setattr(VAECodec, "from_attr", staticmethod(from_attr))
    argv = ["data", "decode", str(path), "--out", str(tmp_path / "clip.gif"), "--vae", "/weights/wan"]
    assert main(argv + (["--vae-tiling"] if tiling else [])) == 0
    assert asked == [("wan", "/weights/wan", tiling)]


def test_frame_alignment():
    assert [latent_frames(f) for f in (1, 4, 5, 8, 9, 13)] == [1, 1, 2, 2, 3, 4]
    assert [video_frames(t) for t in (1, 2, 3)] == [1, 5, 9]


@pytest.mark.slow
def test_encode_and_decode_through_the_command(tmp_path, vae_dirs):
    import imageio.v3 as iio

    video = tmp_path / "clip.mp4"
    iio.imwrite(video, frames(9, seed=1), plugin="pyav", codec="libx264", fps=8)
    lwm = [sys.executable, "-m", "lwm.cli"]
    run = subprocess.run([*lwm, "data", "encode", str(video), "--codec", "cogvideox", "--vae", str(vae_dirs["cogvideox"]),
                          "--size", str(SIZE), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with h5py.File(tmp_path / "out" / "clip.h5") as f:
        assert f["latents"].shape == (3, 16, 4, 4) and f["latents"].dtype == np.float16
        spec = json.loads(f.attrs["codec"])
    assert spec["name"] == "cogvideox" and spec["frames_per_latent"] == 4 and spec["scale"] == [SPREAD / 0.7] * 16

    run = subprocess.run([*lwm, "data", "decode", str(tmp_path / "out" / "clip.h5"), "--out", str(tmp_path / "back.mp4")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--vae" in run.stderr and "cogvideox" in run.stderr
    run = subprocess.run([*lwm, "data", "decode", str(tmp_path / "out" / "clip.h5"), "--out", str(tmp_path / "back.mp4"),
                          "--vae", str(vae_dirs["cogvideox"]), "--vae-tiling"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert iio.imread(tmp_path / "back.mp4", index=None).shape[0] == 9


def test_bad_vae_arguments_name_the_problem(tmp_path, vae_dirs):
    video = tmp_path / "clip.mp4"
    video.write_bytes(b"")
    with pytest.raises(DataError, match="--codec wan needs --vae"):
        encode_videos([str(video)], tmp_path / "out", codec="wan")
    for codec in ("hunyuan", "cogvideox"):  # another class's weights: tensors missing, or of other shapes
        with pytest.raises(DataError, match=rf"--vae {vae_dirs['wan']}: .*{CLASSES[codec]}"):
            encode_videos([str(video)], tmp_path / "out", codec=codec, vae=vae_dirs["wan"])
    with pytest.raises(DataError, match=rf"--vae {tmp_path}: cannot load the AutoencoderKLWan \(.*config\.json"):
        encode_videos([str(video)], tmp_path / "out", codec="wan", vae=tmp_path)
    assert "pass --vae" in missing_codec(json.dumps({"name": "hunyuan"}))
    assert codec_from_attr(json.dumps({"name": "hunyuan"})) is None  # no weights given: no decoder
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing written


def test_decoding_a_vae_file_without_weights_is_one_clear_error(tmp_path):
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["latents"] = np.zeros((2, 16, 4, 4), np.float16)
        f.attrs["codec"] = json.dumps({"name": "wan", "size": 32, "shift": [0.0] * 16, "scale": [1.0] * 16})
    with pytest.raises(DataError, match=r"f\.h5: cannot decode to pixels: .*wan VAE: pass --vae"):
        decode_file(path, tmp_path / "x.mp4")


def test_a_vae_of_other_geometry_is_refused_before_any_work(tmp_path):
    """Wan 2.2's VAE is an AutoencoderKLWan too, but of 16x space in 2x2 patches: refused, not encoded at the wrong
    size (it wrote [T, 48, S/16, S/16] latents recorded as S/8)."""
    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, patch_size=2, scale_factor_spatial=16,
        in_channels=12, out_channels=12, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
    ).save_pretrained(tmp_path / "wan22")
    with pytest.raises(DataError, match=r"wan22: a AutoencoderKLWan of 16x spatial and 4x temporal compression in "
                                        r"2x2 patches; the wan codec takes 8x and 4x without patches"):
        VAECodec.load("wan", tmp_path / "wan22", size=SIZE)


def test_a_vae_with_missing_weights_is_refused(tmp_path, vae_dirs):
    """A folder whose weights lack the decoder would load with a random decoder (diffusers only logs it)."""
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(vae_dirs["hunyuan"], partial)
    weights = next(partial.glob("*.safetensors"))
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("decoder.")}, weights)
    with pytest.raises(DataError, match=r"partial: the AutoencoderKLHunyuanVideo's weights lack \d+ tensors \(e.g. "
                                        r"decoder\..*\): incomplete or of another model"):
        VAECodec.load("hunyuan", partial, size=SIZE)


@pytest.mark.slow
def test_the_encode_log_says_the_latent_frames_and_the_frames_dropped(tmp_path, vae_dirs):
    """10 frames through a VAE are 3 latent frames covering 9; the 10th fills no group of 4 and is dropped."""
    from lwm.utils.video import write_video

    video = write_video(tmp_path / "clip.mp4", frames(10))
    lines: list[str] = []
    written = encode_videos([str(video)], tmp_path / "out", codec="wan", vae=vae_dirs["wan"], size=SIZE,
                            log=lines.append, tiling=True)
    assert lines == [f"wrote {written[0]} (10 frames -> 3 latent frames, the last 1 dropped (no whole group of 4), "
                     f"latents [3, 16, 4, 4])"]
    with h5py.File(written[0]) as f:
        assert f["latents"].shape[0] == 3


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_window_from_the_middle_of_a_file_decodes_after_the_latents_before_it(name, vae_dirs):
    """Latents 2..4 of a file cover its frames 5..16: decoded after latents 0..1 they give exactly those frames of a
    whole-file decode (decoded alone, latent 2 would be one frame and the rest would lack their past)."""
    codec = VAECodec.load(name, vae_dirs[name], size=SIZE)
    y = codec.encode(frames(17))  # 5 latents
    whole = codec.decode(y)
    window = codec.decode(y[2:], before=y[:2])
    assert window.shape[0] == 12 and np.array_equal(window, whole[5:])
    assert codec.decode(y[2:]).shape[0] == 9  # alone: its first latent one frame


def test_a_broken_vae_config_and_an_unusable_device_are_one_line(tmp_path, vae_dirs):
    from lwm.data.vae import load_vae

    broken = tmp_path / "broken"
    shutil.copytree(vae_dirs["cogvideox"], broken)
    (broken / "config.json").write_text('{"_class_name": "AutoencoderKLCogVideoX",')
    with pytest.raises(DataError, match=r"--vae .*broken: cannot load the AutoencoderKLCogVideoX \(.*config\.json"):
        load_vae("cogvideox", broken)
    with pytest.raises(DataError, match=r"--device gpu: not a device"):
        load_vae("cogvideox", vae_dirs["cogvideox"], device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(DataError, match=r"--device cuda: "):
            load_vae("cogvideox", vae_dirs["cogvideox"], device="cuda")


@pytest.mark.parametrize("name", ["wan", "cogvideox"])
def test_decoding_with_other_weights_of_the_class_is_refused(name, vae_dirs, tmp_path):
    """CogVideoX 2b and 5b are one class with other scaling factors: the file's recorded transform and the loaded
    config's differ, and the video came out wrong, silently."""
    codec = VAECodec.load(name, vae_dirs[name], size=SIZE)
    other = dict(TINY[name], **({"latents_std": [0.3] * 16} if name == "wan" else {"scaling_factor": 1.1526}))
    torch.manual_seed(0)
    getattr(diffusers, CLASSES[name])(**other).save_pretrained(tmp_path / "other")
    with pytest.raises(DataError) as e:
        codec_from_attr(codec.attr, "f.h5", vae=str(tmp_path / "other"))
    values = {"wan": "1.2 (and 15 more) vs the file's 2", "cogvideox": "3.47 (and 15 more) vs the file's 5.714"}
    assert str(e.value) == (f"--vae {tmp_path / 'other'}: not the weights the file was encoded with (its {name} "
                            f"normalisation differs: scale {values[name]} (and 15 more)); decode with the VAE that "
                            f"encoded it")  # the scale 4 / the factor (Wan: 4 x latents_std)
    assert codec_from_attr(codec.attr, "f.h5", vae=str(vae_dirs[name])) is not None  # its own weights: decoded
