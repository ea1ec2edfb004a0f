"""A job's image, from its payload or from the media directory, decoded within limits."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge.protocol.images import (
    Decoded,
    ImageLimits,
    decode_at_least,
    decode_base64,
    read_media_file,
    resolve_media_path,
)
from edge.protocol.jobs import ImageRef

logger = logging.getLogger(__name__)


class MediaLoader:
    def __init__(self, limits: ImageLimits, media_dir: Path | None) -> None:
        self.limits = limits
        self._media_dir = media_dir

    @property
    def max_decoded_bytes(self) -> int:
        """The most a decoded image can take (the decoder refuses more pixels), BGR uint8."""
        return self.limits.max_pixels * 3

    @property
    def decode_extra_bytes(self) -> int:
        """What decoding takes beyond the decoded image while it runs: OpenCV's imdecode
        holds a second buffer of the image's size (measured: 143 MiB at the peak for a
        71.5 MiB image, PNG and JPEG alike), freed when it returns."""
        return self.max_decoded_bytes

    def load(self, ref: ImageRef) -> np.ndarray:
        """BGR uint8; JobError naming the field for anything unusable."""
        return self.load_for(ref, None).pixels

    def load_for(self, ref: ImageRef, side: int | None) -> Decoded:
        """As load, for a model that sees `side` pixels: a large JPEG is decoded at a
        reduced scale (see decode_at_least); the stored size comes with it."""
        raw, field = self.read(ref)
        return decode_at_least(raw, self.limits, field, side)

    def read(self, ref: ImageRef) -> tuple[bytes, str]:
        """The image's encoded bytes, within the byte limit, and the field they came from
        (what an error about them names)."""
        if ref.data is not None:
            return decode_base64(ref.data, self.limits, "image.data"), "image.data"
        assert ref.path is not None
        path = resolve_media_path(self._media_dir, ref.path, "image.path")
        return read_media_file(path, self.limits, "image.path", ref.path), "image.path"
