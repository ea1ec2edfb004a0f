"""The fused decode step over a quantized KV cache (edge/text/runtime/fused_step.py): its
rotary kernel writes and codes the cache itself, and what it computes is the op-by-op
step's over a cache of the same format. On a machine without a GPU the Triton kernels run
in Triton's interpreter, which makes these the suite's slowest tests: a file of their own,
so the test processes can share them out with the rest of test_quant_cache.py."""

from __future__ import annotations

import pytest
import torch

from edge.text.kv.quant_cache import QuantKVCache
from edge.text.runtime import fused_step
from engines.text.random_llama import random_int4_llama
from tests.test_quant_cache import CONFIG, DEVICE, SMALL_FORMATS, needs_triton


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize(("name", "coders"), [("int8", 8), ("int4-sym", 8), ("int8", 0), ("int4-sym", 0)])
def test_fused_decode_step_over_a_quantized_cache_matches_the_op_by_op_step(
    name: str, coders: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused step's rotary kernel writes and codes the cache itself: in float32 its
    logits are the op-by-op step's over a cache of the same format (same codes, same
    attention), past the point where key blocks are coded, for two rows at different
    positions. A leaving block is coded by 8 more programs a KV head sharing it out
    (triton_kv.BLOCK_CODERS), or with none (a head size that does not split) by the KV
    head's key and value programs."""
    from edge.text.ops.triton import triton_kv

    monkeypatch.setattr(triton_kv, "BLOCK_CODERS", coders)
    assert triton_kv._block_coders(CONFIG.head_dim, SMALL_FORMATS[name].key_block) == coders
    config = CONFIG
    fmt = SMALL_FORMATS[name]
    fused = random_int4_llama(config, DEVICE, "triton", group=32, dtype=torch.float32, seed=5)
    ref = random_int4_llama(config, DEVICE, "dequant", group=32, dtype=torch.float32, seed=5)
    ref.fused_decode = False
    cache = QuantKVCache(config, 2, 64, fmt, torch.float32, DEVICE)
    ref_cache = QuantKVCache(config, 2, 64, fmt, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(1)
    steps = 50  # past fmt.coded: blocks of 32 leave the window of 8 at 41
    ids = torch.randint(0, config.vocab_size, (2, steps), generator=gen).to(DEVICE)
    offsets = [0, 5]
    # Where the two rotaries' last bits differ (on a GPU) a code can land a step apart: an
    # int4 step moves the logits by about 2e-3.
    tolerance = 5e-3 if DEVICE.type == "cuda" and fmt.dtype == "int4" else 1e-4
    for step in range(steps):
        pos = torch.tensor([max(0, step - o) for o in offsets], device=DEVICE)
        tokens = torch.stack([ids[b, int(pos[b])] for b in range(2)]).view(2, 1)
        got = fused_step.fused_decode_step(fused, tokens, cache, pos, 64)
        want = ref.decode_step(tokens, ref_cache, pos, 64)
        for b in range(2):
            err = float((got[b].float().cpu() - want[b].cpu()).norm() / want[b].norm())
            assert err < tolerance, f"row {b} position {int(pos[b])}: relative error {err:.6f}"
    coded = fmt.coded(steps)
    assert coded > 0
    # The same codes, but where the two rotaries' last bits put a key across a rounding
    # edge (on a GPU, fused multiply-adds): a step apart, rarely.
    got_codes = cache.k_codes[:, :, :, :coded].cpu().to(torch.int16)
    want_codes = ref_cache.k_codes[:, :, :, :coded].cpu().to(torch.int16)
    if fmt.dtype == "int4":  # two codes a byte: compare each nibble
        got_codes = torch.stack([got_codes & 15, got_codes >> 4])
        want_codes = torch.stack([want_codes & 15, want_codes >> 4])
    differ = got_codes != want_codes
    assert (got_codes - want_codes).abs().max() <= 1 and differ.float().mean() < 0.01
