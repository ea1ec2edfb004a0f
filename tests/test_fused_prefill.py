"""The fused prefill (edge/text/runtime/fused_prefill.py) against the model's op-by-op forward:
the same next-token logits and the same keys and values in the cache, run eagerly and
replayed from its captured graphs into any row, with the padding of a bucket."""

from __future__ import annotations

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.runtime.fused_prefill import PrefillGraphs, fused_prefill, supported

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

CONFIG = LlamaConfig(
    vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
)


def _model(kernel: str):  # type: ignore[no-untyped-def]
    from engines.text.random_llama import random_int4_llama

    return random_int4_llama(CONFIG, "cuda", kernel, group=64, seed=7)


def _close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rel * scale, f"max error {err:.4g} against a scale of {scale:.4g}"


@pytest.mark.parametrize("kernel", ["cuda-mma", "triton"])
@pytest.mark.parametrize("tokens", [5, 40])
def test_fused_prefill_matches_the_forward(kernel: str, tokens: int) -> None:
    model = _model(kernel)
    assert supported(model)
    if kernel == "cuda-mma":
        assert model.layers[0].mlp.gate_up_proj.paired  # the paired SiLU path is the one tested
    ids = torch.randint(
        0, CONFIG.vocab_size, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    with torch.inference_mode():
        ref_cache = model.new_cache(1, 64)
        ref = model(ids, ref_cache, 0)[0, -1]
        cache = model.new_cache(3, 64)
        row = torch.tensor([2], device="cuda")
        last = torch.tensor([tokens - 1], device="cuda")
        ours = fused_prefill(model, ids, cache, row, last)[0]
    _close(ours, ref, 0.02)
    assert ours.argmax() == ref.argmax()
    for layer in range(CONFIG.num_layers):
        _close(cache.k[layer, 2, :, :tokens], ref_cache.k[layer, 0, :, :tokens], 0.02)
        _close(cache.v[layer, 2, :, :tokens], ref_cache.v[layer, 0, :, :tokens], 0.02)
        assert not cache.k[layer, :2].any() and not cache.v[layer, :2].any()  # other rows untouched


def test_prefill_graphs_pad_to_their_bucket_and_write_the_given_row() -> None:
    model = _model("cuda-mma")
    with torch.inference_mode():
        cache = model.new_cache(2, 128)
        graphs = PrefillGraphs(model, cache, buckets=(16, 64, 256))
        assert graphs.buckets == [16, 64]  # a bucket past the row's length is not captured
        assert graphs.capture_all() == 2
        assert graphs.covers(64) and not graphs.covers(65) and not graphs.covers(0)
        gen = torch.Generator().manual_seed(3)
        for tokens, row in ((3, 0), (16, 1), (17, 1), (50, 0)):
            ids = torch.randint(0, CONFIG.vocab_size, (tokens,), generator=gen).tolist()
            ref_cache = model.new_cache(1, 128)
            ref = model(torch.tensor([ids], device="cuda"), ref_cache, 0)[0, -1]
            ours = graphs.run(ids, row)
            _close(ours, ref, 0.02)
            assert ours.argmax() == ref.argmax()
            for layer in range(CONFIG.num_layers):
                _close(cache.k[layer, row, :, :tokens], ref_cache.k[layer, 0, :, :tokens], 0.02)
                _close(cache.v[layer, row, :, :tokens], ref_cache.v[layer, 0, :, :tokens], 0.02)


def test_a_chunk_after_earlier_tokens_runs_flash_attention_without_a_score_matrix() -> None:
    """The op-by-op prefill of a chunk that follows cached tokens (prompts past the
    largest graph bucket): the lower-right causal bias gives what the boolean mask gave,
    without the math kernel's score matrix, and a prompt prefilled in chunks ends as the
    whole one does."""
    import torch.nn.functional as F

    from edge.text.model.llama import chunk_mask

    gen = torch.Generator("cuda").manual_seed(4)
    seq, end = 512, 4608
    q = torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, 8, end, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, 8, end, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    boolean = torch.ones(seq, end, dtype=torch.bool, device="cuda").tril(diagonal=end - seq)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, enable_gqa=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(seq, end, q.device), enable_gqa=True)
    torch.cuda.synchronize()
    scores = 32 * seq * end * 2
    assert torch.cuda.max_memory_allocated() - before < scores / 8  # the output and a little, no scores
    _close(out, ref, 0.01)
    model = _model("cuda-mma")
    ids = torch.randint(0, CONFIG.vocab_size, (1, 96), device="cuda", generator=gen)
    with torch.inference_mode():
        whole_cache, chunked = model.new_cache(1, 128), model.new_cache(1, 128)
        whole = model(ids, whole_cache, 0)[0, -1]
        model(ids[:, :64], chunked, 0)
        last = model(ids[:, 64:], chunked, 64)[0, -1]
    _close(last, whole, 0.02)
    assert last.argmax() == whole.argmax()
    for layer in range(CONFIG.num_layers):
        _close(chunked.k[layer, 0, :, :96], whole_cache.k[layer, 0, :, :96], 0.02)
