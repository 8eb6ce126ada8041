"""The built-in pixel codec: exact round trip, range, shapes, and the h5 attribute."""

from __future__ import annotations

import numpy as np
import pytest

from lwm.data.codecs import PixelCodec, codec_from_attr
from lwm.utils.errors import DataError


def test_round_trip_is_exact_and_latents_are_in_range():
    frames = np.random.default_rng(0).integers(0, 256, (5, 128, 128, 3), dtype=np.uint8)
    codec = PixelCodec()
    latents = codec.encode(frames)
    assert latents.shape == (5, 16, 64, 64) and latents.dtype == np.float32
    assert latents.min() >= -1.0 and latents.max() <= 1.0
    assert np.array_equal(codec.decode(latents), frames)
    assert np.array_equal(codec.decode(latents.astype(np.float16)), frames)  # half-precision files too


def test_known_values():
    frames = np.zeros((1, 128, 128, 3), dtype=np.uint8)
    frames[0, 0, 1] = (255, 0, 0)  # pixel (row 0, col 1) pure red
    latents = PixelCodec().encode(frames)
    # colour channel (c=0, a=0, b=1) = 1 at latent (0, 0): 255/127.5 - 1
    assert latents[0, 1, 0, 0] == pytest.approx(1.0) and latents[0, 0, 0, 0] == pytest.approx(-1.0)
    assert latents[0, 12 + 1, 0, 0] == pytest.approx(0.299 * 255 / 127.5 - 1)  # its luma


def test_attribute_round_trip_and_bad_input():
    codec = PixelCodec()
    assert codec_from_attr(codec.attr) == codec
    assert codec_from_attr(None) is None and codec_from_attr('{"name": "wan"}') is None
    for bad in ("{oops", "[1]", '{"size": 1}'):
        with pytest.raises(DataError, match=r"f\.h5: attribute 'codec'"):
            codec_from_attr(bad, "f.h5")


def test_a_pixel_codec_attribute_keeps_its_size():
    codec = codec_from_attr(PixelCodec(size=64).attr)
    frames = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    assert codec.size == 64 and np.array_equal(codec.decode(PixelCodec(size=64).encode(frames)), frames)
