"""The fused decode step (edge/text/runtime/fused_step.py) serving the families' options:
its kernels' new arguments (a sliding window in the float cache's attention; a query
scale, a partial rotary and a cache slot apart from the rotary's position in the rotary
kernel; heads whose width is not a power of two) against plain torch, and whole steps of
family-shaped INT4 models against the per-op step, over sliding buffers that move and
over an int8 cache. Without a GPU, Triton's kernels run in its interpreter (conftest): the
same kernel code on the CPU, in float32. Our CUDA C kernels and the families' own test
models on a GPU: tests/test_families.py (the `gpu` marker). A file of its own: the
interpreter makes these slow."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.float_cache import KVCache
from edge.text.kv.kv_quant import KVFormat
from edge.text.kv.quant_cache import QuantKVCache
from edge.text.model.llama import Attention, LlamaModel, RMSNorm, apply_rope, rope_tables
from edge.text.ops.cpu import cpu_kv
from edge.text.ops.triton import decode_ops
from edge.text.runtime import fused_prefill, fused_step
from engines.text.random_llama import random_int4_llama

needs_triton = pytest.mark.skipif(not decode_ops.TRITON_SUPPORT, reason="triton is not installed")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WINDOW = 8

_BASE: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, max_position=512
)
# Each family's options on a small shape (random INT4 weights): Qwen3's q/k norms on heads
# of 24 channels (not a power of two); Gemma 3's every option, a full layer between two
# sliding ones; Mistral's window on every layer; Phi-4-mini's partial rotary (three
# quarters of a head) with it.
FAMILIES = {
    "qwen3": LlamaConfig(**{**_BASE, "head_size": 24}, qk_norm=True),
    "gemma3": LlamaConfig(
        **{**_BASE, "num_layers": 3, "num_kv_heads": 1, "head_size": 16},
        qk_norm=True,
        sliding_window=WINDOW,
        layer_types=("sliding", "full", "sliding"),
        rope_theta=1_000_000.0,
        rope_local_theta=10_000.0,
        mlp_activation="gelu_tanh",
        embedding_scale=8.0,
        output_norms=True,
        attention_scale=20**-0.5,
        final_logit_softcap=30.0,
    ),
    "mistral": LlamaConfig(**_BASE, sliding_window=WINDOW, layer_types=("sliding", "sliding")),
    "phi3": LlamaConfig(**_BASE, sliding_window=WINDOW, layer_types=("sliding", "sliding"), rotary_dim=12),
}


def _reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: list[int], window: int
) -> list[torch.Tensor]:
    """Each row's q [NH, HD] against its keys and values [NKV, L, HD] at positions
    0..pos (a window: its last `window` of them), in float32."""
    out = []
    group = q.shape[1] // k.shape[1]
    for b, p in enumerate(pos):
        first = max(0, p + 1 - window) if window else 0
        keys = k[b, :, first : p + 1].float().repeat_interleave(group, 0)
        values = v[b, :, first : p + 1].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), keys)
        out.append(torch.einsum("ht,htd->hd", scores.softmax(-1), values))
    return out


@needs_triton
@pytest.mark.parametrize("hd", [16, 24])
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("sms", [132, 1])
def test_triton_attention_sees_each_rows_last_window_positions(hd: int, window: int, sms: int) -> None:
    """Each row attends to its last `window` positions and to nothing before them (tiles
    wholly before the window skipped, chunks of the split wholly before it empty, a tile
    that straddles its start masked), over many splits or, as on a GPU of one SM, one
    chunk of many tiles; heads of 24 channels padded to Triton's 32 and masked."""
    gen = torch.Generator().manual_seed(hd + window)
    heads, kv_heads, max_len, kv_len = 6, 2, 160, 150
    q = (torch.randn(4, heads, hd, generator=gen) * hd**-0.5).to(DEVICE)
    k = torch.randn(4, kv_heads, max_len, hd, generator=gen).to(DEVICE)
    v = torch.randn(4, kv_heads, max_len, hd, generator=gen).to(DEVICE)
    positions = [149, 0, 37, 64]  # the last, the first, mid-tile, a tile's first
    pos = torch.tensor(positions, device=DEVICE)
    out = decode_ops.decode_attention(q, k, v, pos, kv_len, sms, window).view(4, heads, hd).cpu()
    for b, want in enumerate(_reference_attention(q.cpu(), k.cpu(), v.cpu(), positions, window)):
        torch.testing.assert_close(out[b], want, rtol=1e-4, atol=1e-5)
    if window:  # the window is what the kernel kept
        unwindowed = decode_ops.decode_attention(q, k, v, pos, kv_len, sms).view(4, heads, hd).cpu()
        assert not torch.allclose(unwindowed[0], out[0], atol=1e-3)


@needs_triton
@pytest.mark.parametrize(("hd", "rot"), [(16, 16), (16, 12), (24, 24), (24, 16)])
def test_triton_rotary_takes_a_query_scale_a_partial_rotary_and_slots_apart_from_positions(hd: int, rot: int) -> None:
    """rope_kv_write turns the first `rot` channels of each q and k head (the tables'
    width) at each row's position and passes the rest, scales the queries by the scale
    given, and writes k and v at each row's slot (a sliding layer's buffer: the position
    less the row's offset), nothing elsewhere; without a scale the queries take
    1/sqrt(head_dim), without slots the cache's slots are the positions."""
    nh, nkv = 4, 2
    config = LlamaConfig(**{**_BASE, "head_size": hd}, rotary_dim=rot if rot < hd else 0)
    cos, sin = rope_tables(config, 64, DEVICE)
    assert cos.shape[-1] == rot
    qkv = torch.randn(2, (nh + 2 * nkv) * hd, generator=torch.Generator().manual_seed(hd + rot)).to(DEVICE)
    positions, slots = [41, 9], [5, 9]
    for q_scale, slot in ((0.3, slots), (None, None)):
        k_cache = torch.zeros(2, nkv, 48, hd, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        written = slot or positions
        q = decode_ops.rope_kv_write(
            qkv, cos, sin, torch.tensor(positions, device=DEVICE), k_cache, v_cache, nh, q_scale,
            None if slot is None else torch.tensor(slot, device=DEVICE),
        )  # fmt: skip
        scale = hd**-0.5 if q_scale is None else q_scale
        for b, p in enumerate(positions):
            heads = qkv[b].view(nh + 2 * nkv, hd).cpu()
            c, s = cos[p : p + 1].cpu(), sin[p : p + 1].cpu()
            torch.testing.assert_close(q[b].cpu(), apply_rope(heads[:nh], c, s) * scale, rtol=1e-5, atol=1e-6)
            k_want = apply_rope(heads[nh : nh + nkv], c, s)
            torch.testing.assert_close(k_cache[b, :, written[b]].cpu(), k_want, rtol=1e-5, atol=1e-6)
            assert torch.equal(v_cache[b, :, written[b]].cpu(), heads[nh + nkv :])
            assert torch.equal(k_cache[b, :, written[b], rot:].cpu(), heads[nh : nh + nkv, rot:])  # unturned
            others = [t for t in range(48) if t != written[b]]
            assert not k_cache[b, :, others].any() and not v_cache[b, :, others].any()


def _model(config: LlamaConfig, seed: int = 3) -> LlamaModel:
    """A random INT4 model of `config` on Triton's GEMV (float32), its norms' weights
    drawn about one (so a norm applied with another's weight, or not at all, shows)."""
    model = random_int4_llama(config, DEVICE, "triton", group=32, dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.copy_(1.0 + 0.2 * torch.randn(norm.weight.shape, generator=gen))
    return model


@contextmanager
def _without_windows(model: LlamaModel) -> Iterator[None]:
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    windows = [a.window for a in attentions]
    for a in attentions:
        a.window = 0
    try:
        yield
    finally:
        for a, w in zip(attentions, windows, strict=True):
            a.window = w


def _decode(
    model: LlamaModel, caches: list[KVCache | QuantKVCache], ids: torch.Tensor, fused: bool
) -> list[torch.Tensor]:
    """Logits of two rows decoded one token a step from position 0, the second row held
    at position 0 for 3 steps and then 3 positions behind (room made in a float cache's
    sliding buffers before each step, as the batcher does): the fused step or the
    per-op one, on each cache."""
    out = []
    for cache in caches:
        rows = []
        for step in range(ids.shape[1]):
            positions = [step, max(0, step - 3)]
            if isinstance(cache, KVCache):
                cache.make_room_for_step(positions)
            pos = torch.tensor(positions, device=DEVICE)
            tokens = torch.stack([ids[b, positions[b]] for b in range(2)]).view(2, 1)
            with torch.no_grad():
                step_logits = (
                    fused_step.fused_decode_step(model, tokens, cache, pos, cache.max_len)
                    if fused
                    else model.decode_step(tokens, cache, pos, cache.max_len)
                )
            rows.append(step_logits.float().cpu())
        out.append(torch.stack(rows))
    return out


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_fused_step_serves_each_familys_options_as_the_per_op_step(name: str) -> None:
    """Each family's options (q/k norms, a window, a local rotary table, a partial
    rotary, GeGLU, output norms, a scaled embedding, a query scale, capped logits) in the
    fused step: over 24 positions of two rows at different positions, past the window
    with the sliding layers' buffers (room for 4 new positions) moved several times, its
    logits are the per-op step's to float32 rounding (Triton's kernels in float32), and
    with the windows taken away they are not. The step refuses none of them."""
    config = FAMILIES[name]
    model = _model(config)
    assert fused_step.refusal(model) is None
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def caches() -> list[KVCache | QuantKVCache]:
        return [KVCache(config, 2, 64, torch.float32, DEVICE, room=4)]

    want = _decode(model, caches(), ids, fused=False)[0]
    fused_caches = caches()
    got = _decode(model, fused_caches, ids, fused=True)[0]
    error = _error(got, want)
    assert error < 2e-5 and torch.equal(got.argmax(-1), want.argmax(-1)), error
    if config.window:
        cache = fused_caches[0]
        assert isinstance(cache, KVCache) and cache.local_slots == WINDOW + 4 and int(cache.offsets[0]) >= 16
        with _without_windows(model):
            far = _error(_decode(model, caches(), ids, fused=True)[0], want)
        assert far > 1e-3, (error, far)


@needs_triton
@pytest.mark.skipif(DEVICE.type == "cpu" and not cpu_kv.available(), reason="no C compiler for the CPU kernel")
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_the_fused_step_over_an_int8_cache_keeps_the_familys_options(name: str) -> None:
    """Over an int8 cache (Triton's kernels, the sliding layers' codes in a circle) the
    fused step's logits are the per-op step's (our CPU kernel over the same format) to
    float32 rounding, past the point where key blocks are coded and past the window:
    Gemma 3's q/k norms, local table and query scale through the cache's rotary kernel,
    Phi-4-mini's partial rotary turned in torch and written by the cache's write kernel."""
    config = FAMILIES[name]
    model = _model(config)
    fmt = KVFormat("int8", key_block=32)  # blocks of 32 leave the ring at 41 positions
    ids = torch.randint(0, config.vocab_size, (2, 44), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def caches() -> list[KVCache | QuantKVCache]:
        return [QuantKVCache(config, 2, 64, fmt, torch.float32, DEVICE, True)]

    want = _decode(model, caches(), ids, fused=False)[0]
    got = _decode(model, caches(), ids, fused=True)[0]
    error = _error(got, want)
    assert error < 1e-4 and torch.equal(got.argmax(-1), want.argmax(-1)), error


def test_the_fused_step_refuses_by_name_only_what_it_does_not_implement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family option is implemented: a model setting them all is refused nothing
    (the fused decode step serves it on CUDA where the kernels take its shape); an option
    left out of IMPLEMENTED is refused by name. The fused prefill implements none of them
    and refuses each by name (the per-op prefill serves such a prompt)."""
    every = dataclasses.replace(FAMILIES["gemma3"], rotary_dim=8)
    options = every.family_options()
    assert len(options) == len(fused_step.IMPLEMENTED) == 9
    with torch.device("meta"):
        model = LlamaModel(every)
    assert fused_step.refusal(model) is None
    assert fused_prefill.refusal(model) == f"it does not implement {', '.join(options)}"
    monkeypatch.setattr(fused_step, "IMPLEMENTED", tuple(o for o in fused_step.IMPLEMENTED if o != "output_norms"))
    assert fused_step.refusal(model) == "they do not implement output_norms"
    with torch.device("meta"):
        llama = LlamaModel(LlamaConfig(**_BASE))
    assert fused_step.refusal(llama) is None and fused_prefill.refusal(llama) is None
