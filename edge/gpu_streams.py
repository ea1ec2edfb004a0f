"""The side stream on which CUDA graphs are warmed up and captured.

cuBLAS keeps a workspace for every (handle, stream) pair it has run on, allocated from
PyTorch's caching allocator and held for the life of the process: 32 MiB on Hopper, per
stream. A fresh stream for each capture therefore leaves one workspace behind per
captured graph. Six prefill buckets and the decode step left 0.22 GiB that way on the
8B model, more than its whole prefill needs. One side stream per thread and device
holds one workspace, however many graphs are captured on it.
"""

from __future__ import annotations

import threading
from typing import Any

_streams: dict[tuple[int, int], Any] = {}
_lock = threading.Lock()


def side_stream(device: Any = None) -> Any:
    """This thread's capture stream on `device` (the current device where None), made on
    first use. Per thread: two branches capturing at once must not share a stream."""
    import torch

    index = None if device is None else torch.device(device).index
    if index is None:  # None, "cuda": the current device
        index = torch.cuda.current_device()
    key = (index, threading.get_ident())
    with _lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = torch.cuda.Stream(torch.device("cuda", index))  # type: ignore[no-untyped-call]
    return stream
