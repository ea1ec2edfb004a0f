"""What the benchmark and evaluation scripts share, and the Mosquitto broker that they,
the tests (tests/conftest.py) and the demo (scripts/demo.py) start.

Only the standard library at import: the tests, the demo and the arm64 probe of
bench/check_aarch64.py import it too; torch is imported where a function needs it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge.text.kv.kv_quant import KVFormat
    from edge.text.model.llama import LlamaModel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"  # what the scripts write, and the documentation is rendered from
SHIPPED_BROKER_CONF = REPO / "docs" / "mosquitto-edge.conf"  # the broker settings we ship
# What the served CUDA text engine is held to, batch 1 on the 8B shape, against llama.cpp
# in the same run: its decode rate over llama.cpp's, the share of the copy-bandwidth
# roofline, the time to first token of the 512-token prompt, and its peak memory over
# llama.cpp's. bench/render.py says beside the table which are met.
CUDA_TEXT_TARGETS = {"decode_vs_llamacpp": 1.25, "roofline_fraction": 0.60, "ttft_ms": 20.0, "peak_vs_llamacpp": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


def wait_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if listening(host, port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


class Broker:
    """A real mosquitto process on 127.0.0.1; stop() and start() keep the same port.

    `port`: that one (the demo's, from its profile), else a free one. `settings`: the
    configuration after the listener line; by default anonymous clients and the settings
    we ship (docs/mosquitto-edge.conf), with `persistence` its sessions and queued messages
    saved in `workdir` when it stops and read back when it starts (what production
    brokers do). `root`: a directory Debian's packages were unpacked into (dpkg -x), for
    machines without apt. `log`: where its output goes (appended), else nowhere.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        persistence: bool = False,
        settings: str | None = None,
        root: Path | None = None,
        log: Path | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        if settings is None:
            # Started as root, mosquitto switches to its own user, which cannot write the
            # work directory; `user root` keeps it as is (for any other user it does nothing).
            keep = "persistence false\n"
            if persistence:
                keep = f"persistence true\npersistence_location {workdir}/\nuser root\n"
            shipped = SHIPPED_BROKER_CONF.read_text(encoding="utf-8")
            settings = f"allow_anonymous true\n{keep}{shipped}"
        self.conf = workdir / "mosquitto.conf"
        self.conf.write_text(f"listener {self.port} 127.0.0.1\n{settings}", encoding="utf-8")
        self.root, self.log = root, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 15.0) -> None:
        env = dict(os.environ)
        if self.root is not None:
            binary = str(self.root / "usr/sbin/mosquitto")
            libs = [str(self.root / "usr/lib/x86_64-linux-gnu"), str(self.root / "lib/x86_64-linux-gnu")]
            env["LD_LIBRARY_PATH"] = ":".join([*libs, env.get("LD_LIBRARY_PATH", "")])
        else:
            binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        out = self.log.open("ab") if self.log is not None else None
        try:
            self.proc = subprocess.Popen(
                [binary, "-c", str(self.conf)],
                stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT if out else subprocess.DEVNULL,
                env=env,
            )
        finally:
            if out is not None:
                out.close()  # the process holds its own copy
        try:
            wait_port(self.port, timeout)
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"mosquitto did not start on port {self.port}") from None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0 to 1) of `values`, the nearest of them; NaN where there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_json(path: Path, doc: Any, indent: int = 2) -> None:
    """A results file: `doc` as indented JSON ending in a newline, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n", encoding="utf-8")


def perplexity(
    model: LlamaModel, ids: list[int], window: int, chunk: int | None = None, kv_format: KVFormat | None = None
) -> float:
    """Of `ids` read in windows of `window` tokens, each into a fresh cache in `kv_format`
    (None: float, the activations' type). `chunk`: tokens per step, a chunk after cached
    tokens reading them as the cache stores them (None: each window in one step)."""
    import torch

    step = chunk or window
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        part = ids[start : start + window + 1]
        if len(part) < 2:
            break
        cache = model.new_cache(1, window + 1, kv_format)
        for c in range(0, len(part) - 1, step):
            tokens = torch.tensor([part[c : min(c + step, len(part) - 1)]])
            targets = torch.tensor(part[c + 1 : c + 1 + tokens.shape[1]])
            with torch.inference_mode():
                logits = model(tokens, cache, c, last_only=False)[0]
            nll += float(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum"))
            count += tokens.shape[1]
    return math.exp(nll / count)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """How far greedy continuations `got` follow the reference ones, prompt by prompt."""
    same = total = exact = prefix = 0
    for a, b in zip(ref, got, strict=True):
        n = min(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n], strict=True))
        total += len(a)
        exact += a == b
        p = 0
        while p < n and a[p] == b[p]:
            p += 1
        prefix += p
    return {
        "token_agreement": same / total,
        "exact_match": exact / len(ref),
        "mean_common_prefix": prefix / len(ref),
    }
