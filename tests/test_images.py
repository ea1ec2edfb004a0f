from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from edge.protocol.errors import ErrorCode, JobError
from edge.protocol.images import ImageLimits, decode_base64, decode_image, read_media_file, resolve_media_path

LIMITS = ImageLimits(max_bytes=200_000, max_pixels=4_000_000)


def png(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_decodes_png_and_jpeg_to_bgr() -> None:
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    for fmt in ("PNG", "JPEG"):
        arr = decode_image(png(img, fmt), LIMITS, "image.data")
        assert arr.shape == (20, 40, 3) and arr.dtype == np.uint8
        assert arr[5, 5, 2] > 200 and arr[5, 5, 0] < 50  # red lands in the last (R of BGR) channel


def test_rgba_and_greyscale_become_three_channels() -> None:
    for mode in ("RGBA", "L", "1", "P"):
        arr = decode_image(png(Image.new(mode, (8, 8))), LIMITS, "f")
        assert arr.shape == (8, 8, 3)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"not an image at all", ErrorCode.IMAGE_INVALID),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, ErrorCode.IMAGE_INVALID),
    ],
)
def test_garbage_is_invalid(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(JobError) as err:
        decode_image(raw, LIMITS, "image.data")
    assert err.value.code == code and err.value.field == "image.data"


def test_other_formats_are_refused() -> None:
    with pytest.raises(JobError) as err:
        decode_image(png(Image.new("RGB", (8, 8)), "GIF"), LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_INVALID and "GIF" in err.value.message


def test_truncated_png_is_invalid() -> None:
    raw = png(Image.effect_noise((64, 64), 50).convert("RGB"))
    with pytest.raises(JobError) as err:
        decode_image(raw[: len(raw) // 2], LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_INVALID


def test_decompression_bomb_refused_before_decoding() -> None:
    # 20000x20000 one-bit pixels compress to a few kB but would be 1.2 GB as RGB.
    bomb = png(Image.new("1", (20_000, 20_000)))
    assert len(bomb) < LIMITS.max_bytes
    with pytest.raises(JobError) as err:
        decode_image(bomb, LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_TOO_LARGE and "pixels" in err.value.message
    # Below PIL's own bomb threshold, our stricter limit still refuses before decoding.
    medium = png(Image.new("1", (3000, 3000)))
    with pytest.raises(JobError) as err:
        decode_image(medium, LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_TOO_LARGE and "3000x3000" in err.value.message


def test_base64_checks() -> None:
    raw = png(Image.new("RGB", (4, 4)))
    assert decode_base64(base64.b64encode(raw).decode(), LIMITS, "image.data") == raw
    with pytest.raises(JobError) as err:
        decode_base64("@@@not base64@@@", LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_INVALID
    with pytest.raises(JobError) as err:
        decode_base64("A" * 400_000, LIMITS, "image.data")
    assert err.value.code == ErrorCode.IMAGE_TOO_LARGE


def test_media_paths_confined(tmp_path: Path) -> None:
    media = tmp_path / "media"
    (media / "cam1").mkdir(parents=True)
    inside = media / "cam1" / "a.png"
    inside.write_bytes(png(Image.new("RGB", (4, 4))))
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"x")
    os.symlink(secret, media / "escape.png")
    os.symlink(inside, media / "alias.png")

    assert resolve_media_path(media, "cam1/a.png", "image.path") == inside.resolve()
    assert resolve_media_path(media, "alias.png", "image.path") == inside.resolve()
    assert resolve_media_path(media, str(inside), "image.path") == inside.resolve()
    for bad in ("../secret.png", str(secret), "escape.png", "cam1/../../secret.png", "nope.png", "cam1", "a\x00b", ""):
        with pytest.raises(JobError) as err:
            resolve_media_path(media, bad, "image.path")
        assert err.value.code == ErrorCode.PATH_FORBIDDEN and err.value.field == "image.path"
    with pytest.raises(JobError) as err:
        resolve_media_path(None, "cam1/a.png", "image.path")
    assert err.value.code == ErrorCode.PATH_FORBIDDEN


def test_media_file_size_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    big.write_bytes(b"\0" * (LIMITS.max_bytes + 1))
    with pytest.raises(JobError) as err:
        read_media_file(big, LIMITS, "image.path")
    assert err.value.code == ErrorCode.IMAGE_TOO_LARGE


def test_a_large_jpeg_decodes_at_the_scale_the_model_needs() -> None:
    from edge.protocol.images import decode_at_least

    rng = np.random.default_rng(0)
    frame = cv2.resize(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8), (2448, 2048))
    jpeg = cv2.imencode(".jpg", frame)[1].tobytes()
    limits = ImageLimits(max_bytes=10_000_000, max_pixels=6_000_000)
    full, reduced = decode_at_least(jpeg, limits, "f", None), decode_at_least(jpeg, limits, "f", 224)
    # 2048 / 4 = 512 keeps twice 224 on the short side; 2048 / 8 = 256 would not.
    assert full.pixels.shape == (2048, 2448, 3) and full.scale == 1
    assert reduced.pixels.shape == (512, 612, 3) and reduced.scale == 4
    assert (reduced.width, reduced.height) == (full.width, full.height) == (2448, 2048)
    assert decode_at_least(jpeg, limits, "f", 1024).scale == 1  # 2048 / 2 < 2 x 1024
    png = cv2.imencode(".png", frame)[1].tobytes()
    assert decode_at_least(png, limits, "f", 224).scale == 1  # PNG has no reduced decode
