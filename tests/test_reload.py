"""What a reloaded profile changes (edge/reload.py), without a daemon: run-time fields
taken at once, the others listed for a restart and kept at their running values."""

from __future__ import annotations

from pathlib import Path

from edge.config.profile import Profile
from edge.reload import RUNTIME_FIELDS, plan


def _profile(tmp_path: Path, **fields: object) -> Profile:
    paths = {"state_dir": tmp_path, "runtime_dir": tmp_path, "engine_dir": tmp_path}
    return Profile.model_validate({"device_id": "r1", "paths": paths, **fields})


def test_runtime_fields_apply_and_the_rest_wait_for_a_restart(tmp_path: Path) -> None:
    running = _profile(tmp_path)
    new = _profile(
        tmp_path,
        log_level="debug",
        queue={"max_size": 8, "memory_wait_ms": 50},
        models={"ocr": {"keep_alive_s": 30}, "qa": {"max_new_tokens": 64}},
        broker={"port": 1884},
        metrics={"listen": "127.0.0.1:9999"},
    )
    change = plan(running, new)
    assert change.applied == [
        "log_level", "metrics.listen", "models.ocr.keep_alive_s", "queue.max_size", "queue.memory_wait_ms"
    ]  # fmt: skip
    assert change.restart == ["broker.port", "models.qa.max_new_tokens"]
    merged = change.profile
    assert merged.log_level == "debug" and merged.queue.max_size == 8 and merged.queue.memory_wait_ms == 50
    assert merged.models.ocr.keep_alive_s == 30 and merged.metrics.listen == "127.0.0.1:9999"
    # Restart fields keep the running value until the restart.
    assert merged.broker.port == running.broker.port
    assert merged.models.qa.max_new_tokens == running.models.qa.max_new_tokens != 64


def test_an_unchanged_profile_changes_nothing(tmp_path: Path) -> None:
    change = plan(_profile(tmp_path), _profile(tmp_path))
    assert change.applied == [] and change.restart == []


def test_every_runtime_field_is_a_profile_field(tmp_path: Path) -> None:
    doc = _profile(tmp_path).model_dump()
    for dotted in RUNTIME_FIELDS:
        node = doc
        for key in dotted.split("."):
            assert key in node, dotted
            node = node[key]
