"""The quantized KV formats (edge/text/kv_quant.py): codes within half a step of the
float values, the newest tokens kept exact, and sizes that are the tensors' own."""

from __future__ import annotations

import pytest
import torch

from edge.text.kv_quant import FORMATS, KVFormat, bytes_per_token, capacity_tokens, dequantize, quantize


def _kv(tokens: int, dim: int = 64, heads: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(heads, tokens, dim, generator=gen)
    k[..., 5] *= 20.0  # an outlier channel, as real keys have
    v = torch.randn(heads, tokens, dim, generator=gen)
    return k, v


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_codes_are_within_half_a_step_and_the_newest_tokens_exact(name: str) -> None:
    fmt = FORMATS[name]  # type: ignore[index]
    k, v = _kv(300)
    q = quantize(k, v, fmt)
    assert q.quantized == 300 - fmt.float_tokens(300) and q.quantized % fmt.key_block == 0
    assert fmt.float_tokens(300) >= fmt.window
    dk, dv = dequantize(q)
    old = q.quantized
    # The newest tokens: float16, nothing else.
    assert torch.equal(dk[:, old:], k[:, old:].half().float()) and torch.equal(dv[:, old:], v[:, old:].half().float())
    levels = 127 if name == "int8" else 15
    blocks = k[:, :old].reshape(3, old // fmt.key_block, fmt.key_block, 64)
    span = blocks.abs().amax(-2) if name == "int8" else blocks.amax(-2) - blocks.amin(-2)
    k_step = (span / levels).repeat_interleave(fmt.key_block, dim=1)  # per channel of each block
    err = (dk[:, :old] - k[:, :old]).abs()
    assert (err <= k_step * 0.5 + 1e-2 * k_step + 1e-3).all()
    # The outlier channel's scale is its own: the other channels keep their precision.
    assert err[..., 6].mean() < err[..., 5].mean() / 5
    group = fmt.value_group or 64
    vg = v[:, :old].reshape(3, old, 64 // group, group)
    vspan = vg.abs().amax(-1) if name == "int8" else vg.amax(-1) - vg.amin(-1)
    v_step = (vspan / levels).repeat_interleave(group, dim=-1)
    assert ((dv[:, :old] - v[:, :old]).abs() <= v_step * 0.5 + 1e-2 * v_step + 1e-3).all()


def test_sizes_are_the_tensors_own_and_capacity_follows() -> None:
    layers, heads, dim = 30, 3, 64  # SmolLM2-135M
    k, v = _kv(1024 + 64 + 128)
    for name, fmt in FORMATS.items():
        q = quantize(k, v, fmt)
        per_token = bytes_per_token(fmt, 1, heads, dim)
        full = bytes_per_token(FORMATS["float16"], 1, heads, dim)
        expect = q.quantized * per_token + (k.shape[1] - q.quantized) * full
        assert q.nbytes == pytest.approx(expect), name
    pool = 4 * 1024 * int(bytes_per_token(FORMATS["float16"], layers, heads, dim))
    assert capacity_tokens(FORMATS["float16"], pool, 4, layers, heads, dim) == 4096
    # int8 per head and token: 128 bytes of key and value codes, a 2-byte key scale per
    # channel per 64 tokens (2), one 2-byte value scale: 132 bytes against float16's 256;
    # a row keeps one key block (64 tokens) float.
    assert capacity_tokens(FORMATS["int8"], pool, 4, layers, heads, dim) == 4 * int(64 + 960 * 256 / 132)
    # int4: 64 bytes of codes, a 4-byte key scale and zero per channel per 32 tokens (8),
    # 4 bytes per 32-channel value group (8): 80 bytes; the window and a block float.
    assert capacity_tokens(FORMATS["int4"], pool, 4, layers, heads, dim) == 4 * int(160 + 864 * 256 / 80)
    # A row too small for its float tokens holds float16 only.
    assert capacity_tokens(FORMATS["int4"], 4 * 100 * 256 * 90, 4, layers, heads, dim) == 400


def test_bad_shapes_are_refused() -> None:
    k, v = _kv(10, dim=63)
    with pytest.raises(ValueError, match="even"):
        quantize(k, v, FORMATS["int8"])
    k, v = _kv(10, dim=48)
    with pytest.raises(ValueError, match="value group"):
        quantize(k, v, KVFormat("int4", key_block=32, value_group=32))


def test_the_benchs_chunked_read_is_the_whole_windows_read_and_formats_cost_little() -> None:
    """scripts/bench_kv.py's perplexity: read in chunks over a float16 cache it is the
    whole window read at once (float16 rounding apart); over int8 and int4 caches it
    moves, by little: the coded tokens are read as coded."""
    import math
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    import bench_kv

    from edge.text.llama import LlamaConfig, LlamaModel

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=300, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=256)  # fmt: skip
    model = LlamaModel(config).eval()
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.new_cache(1, 400)
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]]), cache, 0, last_only=False)[0]
    whole = math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))
    chunked = bench_kv.perplexity(model, ids, FORMATS["float16"])
    assert chunked == pytest.approx(whole, rel=1e-4)
    int8 = bench_kv.perplexity(model, ids, FORMATS["int8"])
    int4 = bench_kv.perplexity(model, ids, FORMATS["int4"])
    assert int8 != chunked and int4 != chunked  # the coded tokens were read as coded
    assert abs(int8 / chunked - 1) < 0.01 and abs(int4 / chunked - 1) < 0.05
