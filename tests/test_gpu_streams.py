"""CUDA graphs are warmed up and captured on one side stream per thread (edge/gpu_streams.py):
cuBLAS keeps a workspace for every stream it has run on, so a fresh stream per capture
would leave one workspace behind per graph."""

from __future__ import annotations

import threading

import pytest
import torch

from edge.gpu_streams import side_stream

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def test_one_stream_per_thread() -> None:
    mine = side_stream()
    assert side_stream() is mine and side_stream("cuda") is mine and side_stream(0) is mine
    theirs: list[object] = []
    thread = threading.Thread(target=lambda: theirs.append(side_stream()))
    thread.start()
    thread.join()
    assert theirs[0] is not mine


def test_captures_leave_no_workspace_per_graph() -> None:
    from edge.text.runtime.cuda_graphs import capture

    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    pool = torch.cuda.graph_pool_handle()
    graphs = [capture(lambda: a @ a, pool)]  # the first brings the side stream's workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs += [capture(lambda: a @ a + 1, pool) for _ in range(6)]
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    # Six more graphs hold their outputs (128 KiB each, rounded up to the allocator's
    # 2 MiB segments at most); six more cuBLAS workspaces would be 6 x 32 MiB on Hopper
    # (at least 6 x 4 MiB elsewhere).
    assert grown < 16 << 20, grown
    for graph, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphs[-1][1], a @ a + 1)
