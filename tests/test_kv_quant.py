"""The quantized KV formats (edge/text/kv/kv_quant.py): codes within half a step of the
float values, the newest tokens kept exact, and sizes that are the tensors' own."""

from __future__ import annotations

import pytest
import torch

from edge.text.kv.kv_quant import FORMATS, KVFormat, bytes_per_token, dequantize, quantize


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
    group = fmt.group(64)
    vg = v[:, :old].reshape(3, old, 64 // group, group)
    if name == "int8" or fmt.value_symmetric:  # codes around zero: the step is absmax / qmax
        v_step = vg.abs().amax(-1) / (127 if name == "int8" else 7)
    else:
        v_step = (vg.amax(-1) - vg.amin(-1)) / levels
    v_step = v_step.repeat_interleave(group, dim=-1)
    assert ((dv[:, :old] - v[:, :old]).abs() <= v_step * 0.5 + 1e-2 * v_step + 1e-3).all()


def test_sizes_are_the_tensors_own() -> None:
    heads, dim = 3, 64  # SmolLM2-135M
    k, v = _kv(1024 + 64 + 128)
    for name, fmt in FORMATS.items():
        q = quantize(k, v, fmt)
        per_token = bytes_per_token(fmt, 1, heads, dim)
        full = bytes_per_token(FORMATS["float16"], 1, heads, dim)
        sink = min(fmt.sink, q.quantized)  # the first tokens, coded but kept float16 too
        expect = q.quantized * per_token + (k.shape[1] - q.quantized + sink) * full
        assert q.nbytes == pytest.approx(expect), name


def test_bad_shapes_are_refused() -> None:
    k, v = _kv(10, dim=63)
    with pytest.raises(ValueError, match="even"):
        quantize(k, v, FORMATS["int8"])
    k, v = _kv(10, dim=48)
    with pytest.raises(ValueError, match="value group"):
        quantize(k, v, KVFormat("int4", key_block=32, value_group=32))


def test_the_benchs_chunked_read_is_the_whole_windows_read_and_formats_cost_little() -> None:
    """The perplexity bench/kv.py measures: read in chunks over a float16 cache it is the
    whole window read at once (float16 rounding apart); over int8 and int4 caches it
    moves, by little: the coded tokens are read as coded."""
    import math

    from bench.common import perplexity
    from bench.kv import CHUNK, CONTEXT
    from edge.text.architecture import LlamaConfig
    from edge.text.model.llama import LlamaModel

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=300, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=256)  # fmt: skip
    model = LlamaModel(config).eval()
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.new_cache(1, 400)
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]]), cache, 0, last_only=False)[0]
    whole = math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))))
    chunked = perplexity(model, ids, CONTEXT, CHUNK, FORMATS["float16"])
    assert chunked == pytest.approx(whole, rel=1e-4)
    int8 = perplexity(model, ids, CONTEXT, CHUNK, FORMATS["int8"])
    int4 = perplexity(model, ids, CONTEXT, CHUNK, FORMATS["int4"])
    assert int8 != chunked and int4 != chunked  # the coded tokens were read as coded
    assert abs(int8 / chunked - 1) < 0.01 and abs(int4 / chunked - 1) < 0.05


def test_capacity_is_counted_from_the_served_caches() -> None:
    """The tokens a pool holds come from the caches as allocated: float16 rows fill the
    pool exactly; a quantized format's rows are the longest whose cache fits, one token
    more does not; and int4 with its float ring holds over 3.5x float16's tokens in the
    shipped jetson-orin profile's pool (2 rows of 2048)."""
    from edge.text.architecture import LlamaConfig
    from edge.text.kv.kv_capacity import cache_bytes, longest_rows

    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                          intermediate_size=1536)  # fmt: skip
    pool = cache_bytes(smollm2, FORMATS["float16"], 2, 2048, torch.float16)
    assert pool == 2 * 2048 * 30 * 3 * 64 * 2 * 2
    assert longest_rows(smollm2, FORMATS["float16"], 2, pool, torch.float16) == 2048
    for name in ("int8", "int4"):
        fmt = FORMATS[name]
        longest = longest_rows(smollm2, fmt, 2, pool, torch.float16)
        assert cache_bytes(smollm2, fmt, 2, longest, torch.float16) <= pool
        assert cache_bytes(smollm2, fmt, 2, longest + 1, torch.float16) > pool
    assert longest_rows(smollm2, FORMATS["int8"], 2, pool, torch.float16) / 2048 > 1.9
    assert longest_rows(smollm2, FORMATS["int4"], 2, pool, torch.float16) / 2048 >= 3.5
