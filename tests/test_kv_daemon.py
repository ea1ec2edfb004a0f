"""The KV cache settings through the daemon: a profile with int4 KV, offload to the state
directory and the prefix cache serves `qa` jobs over a real broker; two questions over
the same document prefill it once; `edgectl status` says what the cache holds."""

from __future__ import annotations

import json
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
