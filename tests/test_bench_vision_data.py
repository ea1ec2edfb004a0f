"""The data-length benchmark's joining of runs split between GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from bench import vision_data


def _run(lengths: list[int], head_accuracy: float = 0.87) -> dict[str, Any]:
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "batch": 128,
        "test_images": {"test": 500},
        "teacher_heads": {"stored": {"train_images": 600, "test_accuracy": head_accuracy}},
        "rows": [
            {"images": n, "variant": v, "test_accuracy": 0.5 + n / 1e6}
            for n in lengths
            for v in ("plain", "distilled")  # out of the table's order on purpose
        ],
    }


def test_runs_split_between_gpus_join_into_one_table(capsys: pytest.CaptureFixture[str]) -> None:
    joined = vision_data.combine([_run([256_000]), _run([32_000, 128_000])])
    assert [(r["images"], r["variant"]) for r in joined["rows"]] == [
        (n, v) for n in (32_000, 128_000, 256_000) for v in ("distilled", "plain")
    ]
    vision_data.print_table(joined)
    table = capsys.readouterr().out
    assert "256,000" in table and "+0.0" in table  # distilled - plain, both 0.5 + n / 1e6


def test_runs_that_do_not_compare_are_not_joined() -> None:
    with pytest.raises(ValueError, match="teacher_heads"):
        vision_data.combine([_run([256_000]), _run([32_000], head_accuracy=0.9)])
    with pytest.raises(ValueError, match="twice"):
        vision_data.combine([_run([32_000]), _run([32_000])])
