"""Turn a job's image reference (inline base64 or a media path) into pixels, safely.

Everything here runs on untrusted input: sizes are checked before decoding, the pixel
count before the pixels are loaded (decompression bombs), and paths are resolved with
symlinks followed before they are compared with the media directory.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from edge.protocol.errors import ErrorCode, JobError

logger = logging.getLogger(__name__)

ALLOWED_FORMATS = frozenset({"PNG", "JPEG"})


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int


def decode_base64(text: str, limits: ImageLimits, field: str) -> bytes:
    # 4 base64 characters carry 3 bytes: refuse before allocating the decoded copy.
    if len(text) // 4 * 3 > limits.max_bytes + 3:
        raise JobError(
            ErrorCode.IMAGE_TOO_LARGE,
            f"encoded image exceeds {limits.max_bytes} bytes",
            field,
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise JobError(ErrorCode.IMAGE_INVALID, f"not valid base64: {err}", field) from err
    if len(raw) > limits.max_bytes:
        raise JobError(ErrorCode.IMAGE_TOO_LARGE, f"image is {len(raw)} bytes, limit {limits.max_bytes}", field)
    return raw


def resolve_media_path(media_dir: Path | None, name: str, field: str) -> Path:
    if media_dir is None:
        raise JobError(ErrorCode.PATH_FORBIDDEN, "this device accepts no image paths (no media_dir)", field)
    if "\x00" in name or not name:
        raise JobError(ErrorCode.PATH_FORBIDDEN, "empty path or NUL byte in path", field)
    root = media_dir.resolve()
    candidate = Path(name)
    target = candidate if candidate.is_absolute() else root / candidate
    try:
        resolved = target.resolve(strict=True)
    except (OSError, RuntimeError) as err:
        # Not-found and symlink loops both land here; say which without echoing the root.
        raise JobError(ErrorCode.PATH_FORBIDDEN, f"no such media file: {name}", field) from err
    if not resolved.is_relative_to(root) or not resolved.is_file():
        # The same words whether or not something exists out there: an answer must not
        # tell the requester which of the host's files exist.
        raise JobError(ErrorCode.PATH_FORBIDDEN, f"no such media file: {name}", field)
    return resolved


def read_media_file(path: Path, limits: ImageLimits, field: str, name: str = "") -> bytes:
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise JobError(ErrorCode.IMAGE_TOO_LARGE, f"image is {size} bytes, limit {limits.max_bytes}", field)
        return path.read_bytes()
    except OSError as err:  # unreadable (permissions, I/O): said without the host's path
        logger.warning("cannot read media file %s: %s", path, err)
        raise JobError(ErrorCode.PATH_FORBIDDEN, f"cannot read media file: {name or path.name}", field) from err


_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


def _decoder_says(err: BaseException) -> str:
    """A decoder's complaint without the object reprs it puts in (`<_io.BytesIO object
    at 0x...>`): what the requester needs is what is wrong with the bytes."""
    if isinstance(err, UnidentifiedImageError):
        return "not a PNG or JPEG image"
    return _OBJECT_REPR.sub("", str(err)) or type(err).__name__


# Pixels as stored: no EXIF rotation (what the cameras send is what is inspected), any
# PNG or JPEG flavour (grey, palette, alpha, 16-bit) as 8-bit BGR.
_CV2_FLAGS = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION


# JPEG decodes straight to 1/2, 1/4 or 1/8 of its size (libjpeg scales in the DCT): a
# 5 MP frame at 1/4 is decoded in a sixteenth of the memory and a fraction of the time.
_REDUCED = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


@dataclass(frozen=True)
class Decoded:
    pixels: np.ndarray  # HxWx3 uint8 BGR, at `scale` of the stored size
    width: int  # the stored image's own size
    height: int
    scale: int = 1


def decode_image(raw: bytes, limits: ImageLimits, field: str) -> np.ndarray:
    """Decode PNG/JPEG bytes into an HxWx3 uint8 BGR array (the OCR models' order).

    The header is read first (format and pixel count checked before any pixel is
    decoded); the pixels are then decoded by OpenCV, which is faster than PIL and lets
    other threads run meanwhile (it releases the interpreter lock). A file OpenCV cannot
    decode is decoded by PIL, for PIL's precise reason why it is broken."""
    return decode_at_least(raw, limits, field, None).pixels


def decode_at_least(raw: bytes, limits: ImageLimits, field: str, side: int | None) -> Decoded:
    """As decode_image, but a JPEG whose short side is at least twice `side` at a reduced
    scale is decoded at the smallest such scale: for a model that sees `side` pixels,
    the final resize still has at least twice as many to average."""
    width, height, fmt = _header(raw, limits, field)
    scale = 1
    if side is not None and fmt == "JPEG":
        scale = max((f for f in _REDUCED if min(width, height) // f >= 2 * side), default=1)
    flags = _CV2_FLAGS if scale == 1 else _REDUCED[scale] | cv2.IMREAD_IGNORE_ORIENTATION
    img = cv2.imdecode(np.frombuffer(raw, np.uint8), flags)
    if img is not None and img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8:
        return Decoded(img, width, height, scale)
    return Decoded(_decode_with_pil(raw, limits, field), width, height)


def header_checked(raw: bytes, limits: ImageLimits, field: str) -> tuple[int, int]:
    """(width, height) from the header alone, format and pixel limit checked."""
    width, height, _ = _header(raw, limits, field)
    return width, height


def _header(raw: bytes, limits: ImageLimits, field: str) -> tuple[int, int, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(raw))
            if opened.format not in ALLOWED_FORMATS:
                raise JobError(
                    ErrorCode.IMAGE_INVALID,
                    f"image format {opened.format or 'unknown'} not accepted (PNG or JPEG)",
                    field,
                )
            width, height = opened.size
            fmt = str(opened.format)
    except JobError:
        raise
    except Image.DecompressionBombError as err:
        # PIL refuses extreme sizes inside open() itself, before our own check runs.
        raise JobError(ErrorCode.IMAGE_TOO_LARGE, f"image exceeds {limits.max_pixels} pixels ({err})", field) from err
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise JobError(ErrorCode.IMAGE_INVALID, f"cannot decode image: {_decoder_says(err)}", field) from err
    if width <= 0 or height <= 0:
        raise JobError(ErrorCode.IMAGE_INVALID, "image has no pixels", field)
    if width * height > limits.max_pixels:
        raise JobError(ErrorCode.IMAGE_TOO_LARGE, f"image is {width}x{height} pixels, limit {limits.max_pixels}", field)
    return width, height, fmt


def _decode_with_pil(raw: bytes, limits: ImageLimits, field: str) -> np.ndarray:
    """The pixels by PIL, for a file whose header passed `header_checked`."""
    try:
        with warnings.catch_warnings():
            # Our own pixel limit (checked on the header) is stricter; PIL's warning is noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(raw)).convert("RGB")
    except Image.DecompressionBombError as err:
        raise JobError(ErrorCode.IMAGE_TOO_LARGE, f"image exceeds {limits.max_pixels} pixels ({err})", field) from err
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as err:
        raise JobError(ErrorCode.IMAGE_INVALID, f"cannot decode image: {_decoder_says(err)}", field) from err
    rgb = np.asarray(img, dtype=np.uint8)
    return np.ascontiguousarray(rgb[:, :, ::-1])
