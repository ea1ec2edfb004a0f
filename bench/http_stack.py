"""The HTTP server library for the API, chosen by measurement: each candidate's import
time and the resident memory of a minimal server answering a JSON request and a
server-sent event stream, each in a fresh interpreter.

    python -m bench.http_stack

Candidates: aiohttp (server and client in one package) and starlette served by uvicorn
(with sse-starlette's event stream where it is installed, else starlette's own streaming
response). Each server runs on a loopback port; RSS is read from /proc after a few
requests, so it counts what serving took, not only what the import did. Writes
bench/results/http_stack.json.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from typing import Any

from bench.common import RESULTS, free_port, wait_port, write_json

IMPORT = {
    "aiohttp": "import aiohttp.web",
    "starlette+uvicorn": "import starlette.applications, starlette.responses, uvicorn",
}

SERVERS = {
    "aiohttp": """
import sys
from aiohttp import web

async def chat(request):
    return web.json_response({"ok": True})

async def stream(request):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(b"data: %d\\n\\n" % i)
    await resp.write_eof()
    return resp

app = web.Application()
app.router.add_post("/chat", chat)
app.router.add_get("/stream", stream)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
""",
    "starlette+uvicorn": """
import sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def chat(request):
    return JSONResponse({"ok": True})

async def events():
    for i in range(3):
        yield b"data: %d\\n\\n" % i

async def stream(request):
    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/chat", chat, methods=["POST"]), Route("/stream", stream)])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
""",
}

PACKAGES = {"aiohttp": ["aiohttp"], "starlette+uvicorn": ["starlette", "uvicorn"]}


def import_ms(stmt: str, runs: int = 5) -> float:
    """Median wall time of the import in a fresh interpreter, less the bare interpreter's."""

    def once(code: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - t0

    bare = statistics.median(once("pass") for _ in range(runs))
    return (statistics.median(once(stmt) for _ in range(runs)) - bare) * 1000.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def serve_rss(code: str) -> tuple[int, float]:
    """(RSS after serving, seconds from launch to the port answering)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, str(port)])
    try:
        wait_port(port, timeout=30)
        started = time.perf_counter() - t0
        for _ in range(20):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/chat", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/stream", timeout=10) as resp:
                if b"data: 2" not in resp.read():
                    raise RuntimeError("the stream did not arrive whole")
        return rss_bytes(proc.pid), started
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    result: dict[str, Any] = {"machine": platform.machine(), "python": platform.python_version(), "stacks": {}}
    for name, stmt in IMPORT.items():
        rss, started = serve_rss(SERVERS[name])
        result["stacks"][name] = {
            "versions": {p: metadata.version(p) for p in PACKAGES[name]},
            "import_ms": round(import_ms(stmt), 1),
            "serving_rss_mib": round(rss / 2**20, 1),
            "start_to_listening_ms": round(started * 1000.0, 1),
        }
    write_json(RESULTS / "http_stack.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
