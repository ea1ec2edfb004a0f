"""The KV cache settings through the daemon: a profile with int4 KV, offload to the state
directory and the prefix cache serves `qa` jobs over a real broker; two questions over
the same document prefill it once; `edgectl status` says what the cache holds."""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from pathlib import Path

import pytest

from tests.conftest import Broker, Requester, start_daemon, write_profile

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LEAFLET = (
    "Oral rehydration solution: dissolve one sachet in 200 ml of drinking water. Give small sips "
    "often. For adults, 200 to 400 ml after each loose stool. Seek care if there is blood in the "
    "stool, a high fever, or no urine for eight hours. Do not add sugar or salt to the solution. "
) * 3


def test_int4_kv_with_offload_and_prefix_cache_serves_through_the_daemon(
    tmp_path: Path, broker: Broker, engine_dir: Path, requester: Requester
) -> None:
    qa = {"kv_dtype": "int4", "kv_offload": "disk", "prefix_cache_mib": 16, "max_new_tokens": 16}
    profile = write_profile(
        tmp_path, broker.port, engine_dir, device_id="kq",
        models={"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa},
    )  # fmt: skip
    stale = tmp_path / "state" / "kv-offload" / "left-by-an-earlier-run.kv"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    daemon = start_daemon(profile)
    try:
        daemon.wait_ready()
        assert not stale.exists()  # offloaded rows do not outlive the daemon that wrote them
        answers = []
        for i, question in enumerate(["How much water per sachet?", "When should I seek care?"]):
            job = {"id": f"kq{i}", "question": question, "context": LEAFLET, "max_new_tokens": 16}
            answers.append(requester.request("edge/kq/jobs/qa", job, timeout=120))
        status = json.loads(daemon.status().stdout)
    finally:
        daemon.stop()
    for result in answers:
        assert result["status"] == "ok", result
        assert result["output"]["answer"].strip() and result["output"]["completion_tokens"] > 0
    kv = status["memory"]["kv"]
    assert kv["kv_dtype"] == "int4" and kv["offload"]["where"] == "disk"
    prefixes = kv["prefix_cache"]
    # Misses: the load's warm-up question (its entry dropped when the ledger took over the
    # cache's bounds) and the first job; the second job's document was kept.
    assert prefixes["misses"] == 2 and prefixes["hits"] == 1
    assert prefixes["entries"] == 1 and 0 < prefixes["bytes"] <= prefixes["capacity_bytes"]


COUNT = "Count from 1 to 200, separated by commas."


def _damage(path: Path, how: str) -> None:
    """What the outside battery did to a paused job's offload file. "nan": every value of
    every part NaN (float16 0x7e00; the float16 cache and its float32 logits), written as
    a well-formed file of its format, its checksums (where it has them) redone to match."""
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        magic = data[:8]
        checked = magic == b"EDGEKV2\n"  # the header's CRC-32 beside its length
        size = int.from_bytes(data[8:12], "little")
        start = 8 + (8 if checked else 4)
        header = json.loads(data[start : start + size])
        blobs = []
        for part in header["parts"]:
            count = math.prod(part["shape"])
            nan = {"float16": b"\x00\x7e", "float32": b"\x00\x00\xc0\x7f"}[part["dtype"]] * count
            part.update(codec="none", bytes=len(nan))
            if checked:
                part["crc32"] = zlib.crc32(nan)
            blobs.append(nan)
        meta = json.dumps(header).encode()
        prefix = struct.pack("<II", len(meta), zlib.crc32(meta)) if checked else struct.pack("<I", len(meta))
        path.write_bytes(magic + prefix + meta + b"".join(blobs))


def test_a_paused_jobs_damaged_offload_file_costs_a_prefill_not_the_job(
    tmp_path: Path, broker: Broker, engine_dir: Path, requester: Requester
) -> None:
    """One row, offload to disk: a long job is paused for two urgent ones, its file is
    deleted, cut short or filled with NaN while it waits; it is prefilled again and
    answers what it answers uninterrupted, the urgent ones too, and no file or byte of
    it is left behind."""
    qa = {"kv_offload": "disk", "max_sequences": 1, "max_new_tokens": 64}
    profile = write_profile(
        tmp_path, broker.port, engine_dir, device_id="kd",
        models={"ocr": {"enabled": False}, "inspect": {"enabled": False}, "qa": qa},
        queue={"memory_wait_ms": 0},
    )  # fmt: skip
    offload_dir = tmp_path / "state" / "kv-offload"
    topic = "edge/kd/jobs/qa"
    daemon = start_daemon(profile)
    try:
        daemon.wait_ready(timeout=300)
        alone = requester.request(topic, {"id": "alone", "question": COUNT, "max_new_tokens": 64}, timeout=120)
        assert alone["status"] == "ok", alone
        for how in ("deleted", "truncated", "nan"):
            low = {"id": f"low-{how}", "question": COUNT, "max_new_tokens": 64, "priority": 9, "stream": True}
            corr = requester.send(topic, low)
            requester.wait_partial(corr, timeout=120)  # it is decoding
            urgent = [
                requester.send(
                    topic, {"id": f"urgent-{how}-{i}", "question": COUNT, "max_new_tokens": 40, "priority": 0}
                )
                for i in range(2)
            ]
            deadline = time.monotonic() + 60
            while not (files := list(offload_dir.glob("*.kv"))):
                assert time.monotonic() < deadline, "the low-priority job was never paused to a file"
                time.sleep(0.005)
            _damage(files[0], how)
            result = requester.wait(corr, timeout=180)
            assert result["status"] == "ok", (how, result)
            assert result["output"]["answer"] == alone["output"]["answer"], how
            for c in urgent:
                assert requester.wait(c, timeout=180)["status"] == "ok"
        status = json.loads(daemon.status().stdout)
    finally:
        daemon.stop()
    offload = status["memory"]["kv"]["offload"]
    assert offload["saved"] == 3 and offload["restore_failed"] == 3 and offload["restored"] == 0, offload
    assert offload["disk_bytes"] == 0 and offload["memory_bytes"] == 0
    assert not list(offload_dir.glob("*"))  # nothing kept for good
