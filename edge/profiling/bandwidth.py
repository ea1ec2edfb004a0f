"""The box's copy bandwidth, the yardstick a kernel's bytes per second is held to: one
buffer copied into another on the device (device to device on a GPU, memory to memory
on the CPU), bytes read plus written per second, the median of timed copies after
warm-up ones. bench/text.py's roofline uses the same measure, with a larger buffer.

The buffer should be well past the last-level cache (50 MB on an H100, 4 MB on an Orin)
and small beside what the box serves with: 256 MiB by default, two halves.
"""

from __future__ import annotations

import statistics
import time

import torch

MIB = 1 << 20
DEFAULT_BYTES = 256 * MIB


def copy_bandwidth(nbytes: int = DEFAULT_BYTES, device: str = "cuda", repeat: int = 20, warm: int = 5) -> float:
    """Bytes read plus written per second by `dst.copy_(src)` of nbytes / 2 each, on
    `device` ("cuda", "cuda:N" or "cpu"); timed by CUDA events on a GPU, the monotonic
    clock on the CPU."""
    on_cuda = torch.device(device).type == "cuda"
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    try:
        for i in range(warm + repeat):
            if on_cuda:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                dst.copy_(src)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1000.0
            else:
                t0 = time.perf_counter()
                dst.copy_(src)
                seconds = time.perf_counter() - t0
            if i >= warm:
                times.append(seconds)
    finally:
        del src, dst
        if on_cuda:
            torch.cuda.empty_cache()
    return float(nbytes // 2 * 2 / statistics.median(times))
