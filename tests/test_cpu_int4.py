"""Our float32 CPU INT4 kernel (edge/text/ops/cpu/cpu_int4.c), built here with the machine's C
compiler: it computes the quantized model exactly (only float32 sums round), a row's
result does not depend on its batch, and without a compiler the checkpoint falls back to
torch's kernel instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.text.model.checkpoint import default_int4_kernel
from edge.text.ops.cpu import cpu_int4
from edge.text.ops.int4 import Int4Linear, QuantizedWeight, cpu_kernel_available, dequantize, pack


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(9, k, generator=gen)
    return w, x


def _exact(q_w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ q_w.double().T).float()


@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(64, 576, 32), (50, 576, 64), (96, 1536, 128), (33, 512, 256), (4, 32, 32)],
)
def test_the_kernel_computes_the_quantized_weights_exactly(n: int, k: int, group: int) -> None:
    w, x = _weights(n, k, group)
    q = pack(w, group)
    exact = _exact(dequantize(q), x)
    out = cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, group)
    assert out.shape == (9, n) and out.dtype == torch.float32
    # float32 sums of K products: a few ulps of the products' magnitude.
    bound = 16 * k * torch.finfo(torch.float32).eps * (x.abs() @ dequantize(q).abs().T)
    assert bool(((out - exact).abs() <= bound).all()), float((out - exact).abs().max())
    # Torch's bfloat16 kernel, for scale, misses by about a thousand times more.
    tiled = Int4Linear(q, "cpu")(x) if n % 16 == 0 else None
    if tiled is not None:
        assert float((tiled - exact).abs().max()) > 50 * float((out - exact).abs().max())


def test_a_rows_result_is_the_same_alone_and_in_any_batch() -> None:
    """Every tile the kernel picks (up to 4 rows, 5 to 8 at once, more in fours and the
    rest; 70 weight rows, two past a multiple of 4) sums each output in the same order."""
    w, _ = _weights(70, 576, 32, seed=1)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(3))
    q = pack(w, 32)
    scales = q.scales.float()
    alone = [cpu_int4.linear(x[i : i + 1], q.qweight, scales, q.zeros, 32) for i in range(19)]
    for m in range(1, 20):
        batch = cpu_int4.linear(x[:m], q.qweight, scales, q.zeros, 32)
        for i in range(m):
            assert torch.equal(batch[i : i + 1], alone[i]), (m, i)


def with_minimums(n: int, k: int, seed: int = 4) -> QuantizedWeight:
    """A GGUF Q4_1-like weight: zero points 0, a float16 minimum a block of 32."""
    w, _ = _weights(n, k, 32, seed=seed)
    q = pack(w, 32)
    minimums = (torch.randn(n, k // 32, generator=torch.Generator().manual_seed(seed)) * 0.05).half()
    return QuantizedWeight(q.qweight, q.scales, torch.zeros_like(q.zeros), 32, minimums)


@pytest.mark.parametrize("kernel", ["cpu-f32", "cpu-int8", "cpu", "dequant"])
def test_block_minimums_are_added_once_by_every_cpu_kernel(kernel: str) -> None:
    """A weight with block minimums (GGUF Q4_1) through each CPU kernel: the product of
    code x scale + minimum, for a decode's few rows and a prefill's many (our float32
    kernel to float32 rounding; int8 activations and torch's bfloat16 to their own
    rounding, measured against the same kernel's miss without minimums); a decode row the
    same alone and in a batch."""
    q = with_minimums(64, 576)
    plain = QuantizedWeight(q.qweight, q.scales, q.zeros, 32)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(5))
    layer, without = Int4Linear(q, kernel), Int4Linear(plain, kernel)
    for rows in (3, 12):
        exact = _exact(dequantize(q), x[:rows])
        miss = float((layer(x[:rows]) - exact).abs().max())
        base = float((without(x[:rows]) - _exact(dequantize(plain), x[:rows])).abs().max())
        assert miss <= (1e-4 if kernel in ("cpu-f32", "dequant") else 2 * base + 1e-4), (rows, miss, base)
    if kernel == "cpu-f32":
        alone = [layer(x[i : i + 1]) for i in range(4)]
        assert all(torch.equal(layer(x[:4])[i : i + 1], alone[i]) for i in range(4))


def test_the_layer_serves_the_kernel_with_its_bias_and_dtype() -> None:
    w, x = _weights(48, 576, 32, seed=2)
    q = pack(w, 32)
    bias = torch.randn(48)
    layer = Int4Linear(q, "cpu-f32", bias)
    assert layer.kernel == "cpu-f32"
    out = layer(x.view(3, 3, 576))
    assert out.shape == (3, 3, 48)
    torch.testing.assert_close(out.view(9, 48), _exact(dequantize(q), x) + bias, rtol=1e-5, atol=1e-5)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_bad_shapes_are_refused_by_name() -> None:
    w, x = _weights(16, 48, 16)
    q = pack(w, 16)
    with pytest.raises(ValueError, match="groups of a multiple of 32"):
        cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, 16)
    # A layer of such a group is served by torch's kernel instead of failing.
    assert Int4Linear(q, "cpu-f32").kernel == "cpu"


def test_the_build_is_cached_per_source_and_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    first = cpu_int4.build()
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_int4.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    monkeypatch.setattr(cpu_int4, "_cpu_identity", lambda: "another CPU")
    other = cpu_int4.build()
    assert other != first and other.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_without_a_compiler_torchs_kernel_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    # A kernel not yet loaded in this process (the module's own one may be).
    fresh = cpu_int4.CKernel(cpu_int4.SOURCE, "edge_int4_linear", cpu_int4._KERNEL.argtypes, "the kernel")
    monkeypatch.setattr(cpu_int4, "_KERNEL", fresh)
    assert not cpu_int4.available()
    assert default_int4_kernel(torch.device("cpu")) in ("cpu", "dequant")
    with pytest.raises(RuntimeError, match="unavailable"):
        w, x = _weights(16, 64, 32)
        q = pack(w, 32)
        cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, 32)


def test_a_compiler_error_is_reported_with_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_KERNEL_CACHE", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_int4, "SOURCE", broken)
    with pytest.raises(RuntimeError, match=r"failed on broken\.c"):
        cpu_int4.build()
    assert not list(tmp_path.glob("*.so"))


def test_a_checkpoint_loads_on_the_kernel_its_setting_names(tmp_path: Path) -> None:
    """models.qa.cpu_kernel's two values at the loader: exact serves ours in every INT4
    layer, bf16 torch's tiled kernel."""
    from edge.text.architecture import LlamaConfig
    from edge.text.model.checkpoint import load_checkpoint
    from engines.text.random_llama import write_random_checkpoint

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    path = write_random_checkpoint(tmp_path / "ckpt", config, group=32)
    exact = load_checkpoint(path)
    bf16 = load_checkpoint(path, cpu_kernel="bf16")
    assert exact.int4_kernel == "cpu-f32"
    assert {m.kernel for m in exact.model.modules() if isinstance(m, Int4Linear)} == {"cpu-f32"}
    expected = "cpu" if cpu_kernel_available() else "dequant"
    assert bf16.int4_kernel == expected
    assert {m.kernel for m in bf16.model.modules() if isinstance(m, Int4Linear)} == {expected}
