#!/usr/bin/env python3
"""Render factory label images (serial, part and lot numbers) for demos and tests.

Each label is reproducible from its seed: font, rotation, blur and noise are drawn from
it. Writes PNGs and a `labels.json` with the exact text printed on each label, which is
what the demo and the tests compare OCR output against.

    python scripts/make_labels.py --out samples/labels --count 6 --seed 7
"""

from __future__ import annotations

import argparse
import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONT_DIRS = (Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts/dejavu"))
FONT_FILES = ("DejaVuSans-Bold.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSans.ttf")


@dataclass(frozen=True)
class Label:
    name: str
    lines: list[str]
    font: str
    angle: float
    blur: float


def _fonts() -> list[Path]:
    found = [d / f for d in FONT_DIRS for f in FONT_FILES if (d / f).is_file()]
    if not found:
        raise SystemExit("no DejaVu fonts found: apt-get install -y fonts-dejavu-core")
    return found


def label_text(rng: random.Random) -> list[str]:
    letters = string.ascii_uppercase
    serial = f"SN-{rng.randint(1000, 9999)}-{rng.choice(letters)}{rng.choice(letters)}{rng.randint(0, 9)}"
    part = f"PN {rng.randint(1000, 9999)}-{rng.randint(100, 999)}-{rng.choice('ABCDEFGH')}"
    lot = f"LOT {rng.randint(20, 26)}{rng.choice(letters)}{rng.randint(10, 99)}"
    return [serial, part, lot]


def render(lines: list[str], font_path: Path, angle: float, blur: float, rng: random.Random) -> Image.Image:
    font = ImageFont.truetype(str(font_path), 34)
    pad_x, pad_y, gap = 28, 22, 14
    widths = [int(font.getbbox(t)[2]) for t in lines]
    height_line = max(int(font.getbbox(t)[3]) for t in lines)
    w = max(widths) + 2 * pad_x
    h = len(lines) * height_line + (len(lines) - 1) * gap + 2 * pad_y
    paper = rng.randint(225, 250)
    img = Image.new("RGB", (w, h), (paper, paper, paper - rng.randint(0, 12)))
    draw = ImageDraw.Draw(img)
    draw.rectangle([3, 3, w - 4, h - 4], outline=(40, 40, 40), width=2)
    ink = rng.randint(0, 50)
    y = pad_y
    for text in lines:
        draw.text((pad_x, y), text, font=font, fill=(ink, ink, ink))
        y += height_line + gap
    # Mount the label on a grey part surface so rotation does not clip it.
    margin = 40
    canvas = Image.new("RGB", (w + 2 * margin, h + 2 * margin), (120, 124, 128))
    canvas.paste(img, (margin, margin))
    canvas = canvas.rotate(angle, resample=Image.Resampling.BICUBIC, expand=False, fillcolor=(120, 124, 128))
    if blur > 0:
        canvas = canvas.filter(ImageFilter.GaussianBlur(blur))
    return canvas


def make(out: Path, count: int, seed: int) -> list[Label]:
    out.mkdir(parents=True, exist_ok=True)
    fonts = _fonts()
    labels: list[Label] = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        lines = label_text(rng)
        font = fonts[i % len(fonts)]
        angle = round(rng.uniform(-4.0, 4.0), 2)
        blur = round(rng.choice([0.0, 0.6, 1.0]), 2)
        name = f"label_{i:02d}.png"
        render(lines, font, angle, blur, rng).save(out / name, optimize=True)
        labels.append(Label(name=name, lines=lines, font=font.name, angle=angle, blur=blur))
    manifest = [label.__dict__ for label in labels]
    (out / "labels.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("samples/labels"))
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    for label in make(args.out, args.count, args.seed):
        print(f"{label.name}: {' | '.join(label.lines)} (font {label.font}, {label.angle} deg, blur {label.blur})")


if __name__ == "__main__":
    main()
