"""Our CPU INT4 kernel with int8 activations (edge_int4_linear_int8 in
edge/text/ops/cpu/cpu_int4.c, models.qa.cpu_kernel: int8): it computes the quantized
weights against the activations rounded to int8 in blocks of 32 (checked against that
rounding done here in float64), its error against the exact kernel stays within what the
rounding allows, a row's result does not depend on its batch, and every instruction set's
path (AVX-512 VNNI, AVX-VNNI, AVX2, plain C; Arm's dot product under qemu where a cross
compiler is installed) gives the same answers."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.text.model.checkpoint import load_checkpoint
from edge.text.ops.cpu import cpu_int4
from edge.text.ops.int4 import Int4Linear, QuantizedWeight, dequantize, pack

pytestmark = pytest.mark.skipif(not cpu_int4.available(int8=True), reason="no C compiler for the CPU kernels")

SHAPES = [(64, 576, 32), (50, 576, 64), (96, 1536, 128), (33, 512, 256), (4, 32, 32), (1, 64, 32), (7, 96, 32)]


def _weights(n: int, k: int, group: int, seed: int = 0, rows: int = 9) -> tuple[QuantizedWeight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = pack(torch.randn(n, k, generator=gen) * 0.05, group)
    return q, torch.randn(rows, k, generator=gen)


def _rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rounding of activation rows, in float64: int8 values in blocks of 32,
    each block's scale its largest magnitude / 127 (ties to even, as lrintf rounds)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    values = torch.round(blocks * inv)
    scale = top / 127.0
    return values.view_as(x).double(), scale.double().expand_as(blocks).reshape(x.shape)


@pytest.mark.parametrize(("n", "k", "group"), SHAPES)
def test_the_kernel_multiplies_the_weights_by_the_rounded_activations(n: int, k: int, group: int) -> None:
    q, x = _weights(n, k, group)
    w = dequantize(q).double()
    values, scale = _rounded(x)
    expected = (values * scale) @ w.T
    out = cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, group, int8=True)
    assert out.shape == (9, n) and out.dtype == torch.float32
    # Integer sums are exact; only the float32 scaling and sums of K / 8 lanes round.
    bound = 16 * k * torch.finfo(torch.float32).eps * ((values * scale).abs() @ w.abs().T)
    assert bool(((out.double() - expected).abs() <= bound + 1e-30).all()), float((out - expected).abs().max())
    # Against the exact products: never further than the rounding allows (half a step of
    # each block's scale per activation), and not exact either.
    exact = x.double() @ w.T
    allowed = (scale / 2) @ w.abs().T + bound
    err = (out.double() - exact).abs()
    assert bool((err <= allowed).all()) and float(err.max()) > 0


def test_a_rows_result_is_the_same_alone_and_in_any_batch() -> None:
    """Every tile (4 weight rows against 1 to 4 activation rows, one against 5 to 8, more
    in fours and the rest; 70 weight rows, the last ones read from the kernel's padded
    copy): bit for bit."""
    q, x = _weights(70, 576, 32, seed=1, rows=19)
    scales = q.scales.float()
    alone = [cpu_int4.linear(x[i : i + 1], q.qweight, scales, q.zeros, 32, int8=True) for i in range(19)]
    for m in range(1, 20):
        batch = cpu_int4.linear(x[:m], q.qweight, scales, q.zeros, 32, int8=True)
        for i in range(m):
            assert torch.equal(batch[i : i + 1], alone[i]), (m, i)


def test_zero_and_huge_activations_round_without_overflow() -> None:
    """A block of zeros has scale 0 (no division by it); a block with one huge value
    rounds the rest to 0 and keeps that one."""
    q, x = _weights(8, 128, 32, seed=4, rows=3)
    x[0] = 0.0
    x[1, :32] = 0.0
    x[2, 5] = 1e30
    out = cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, 32, int8=True)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out[0], torch.zeros(8))
    values, scale = _rounded(x)
    expected = (values * scale) @ dequantize(q).double().T
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_group_it_does_not_take_falls_back_to_the_exact_kernel() -> None:
    q, x = _weights(16, 576, 96)
    assert not cpu_int4.supports_int8(576, 96) and cpu_int4.supports_int8(576, 64)
    with pytest.raises(ValueError, match="power of two"):
        cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, 96, int8=True)
    assert Int4Linear(q, "cpu-int8").kernel == "cpu-f32"


def test_a_checkpoint_loads_on_the_int8_kernel_with_an_exact_head(tmp_path: Path) -> None:
    """models.qa.cpu_kernel: int8 at the loader: every INT4 layer on it, and the output
    layer's best 16 logits of each row computed again exactly."""
    from edge.text.architecture import LlamaConfig
    from edge.text.ops.int4 import EXACT_TOP
    from engines.text.random_llama import write_random_checkpoint

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
    )
    path = write_random_checkpoint(tmp_path / "ckpt", config, group=32)
    ckpt = load_checkpoint(path, cpu_kernel="int8")
    assert ckpt.int4_kernel == "cpu-int8"
    layers = [m for m in ckpt.model.modules() if isinstance(m, Int4Linear)]
    assert {m.kernel for m in layers} == {"cpu-int8"}
    head = ckpt.model.lm_head
    assert isinstance(head, Int4Linear) and head.exact_top == EXACT_TOP
    weight = dequantize(QuantizedWeight(head.qweight, head.scales, head.zeros, 32)).double()
    for rows in (2, 9):  # our C selection and exact kernel; past REFINE_ROWS, torch's route
        h = torch.randn(rows, 64)
        logits = head(h)
        head.exact_top = 0
        rounded = head(h)  # the int8 kernel's alone
        head.exact_top = EXACT_TOP
        exact = h.double() @ weight.T
        # Each row's best 16 of the rounded logits are exact; the rest stay as rounded.
        top = rounded.topk(EXACT_TOP, dim=-1).indices
        torch.testing.assert_close(logits.gather(-1, top).double(), exact.gather(-1, top), rtol=1e-5, atol=1e-5)
        rest = torch.ones_like(logits, dtype=torch.bool).scatter(-1, top, False)
        assert torch.equal(logits[rest], rounded[rest])
        assert (rounded.double() - exact).abs().max() > 1e-4


def test_top_k_picks_each_rows_largest_in_order() -> None:
    """cpu_int4.top_k (the exact head's selection): torch's topk indices where values are
    distinct; of equal values the lower index first; NaNs never chosen."""
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(5, 49152, generator=gen)
    assert torch.equal(cpu_int4.top_k(y, 16), y.topk(16, dim=-1).indices)
    tied = torch.tensor([[1.0, 3.0, 2.0, 3.0, float("nan"), 3.0]])
    assert cpu_int4.top_k(tied, 4).tolist() == [[1, 3, 5, 2]]
    assert cpu_int4.top_k(torch.tensor([[float("nan"), 1.0, float("nan")]]), 2).tolist() == [[1, -1]]
    with pytest.raises(ValueError):
        cpu_int4.top_k(y, 65)


# --- every instruction set's path -------------------------------------------------------

DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int edge_int4_linear_int8(const float *, int64_t, int64_t, const uint8_t *, const float *, const uint8_t *,
                          int64_t, int64_t, float *, int);
int main(int argc, char **argv) {
    int64_t m = atoll(argv[2]), k = atoll(argv[3]), n = atoll(argv[4]), g = atoll(argv[5]);
    FILE *f = fopen(argv[1], "rb");
    float *x = malloc(4 * m * k), *s = malloc(4 * n * (k / g)), *y = malloc(4 * m * n);
    uint8_t *q = malloc(n * k / 2), *z = malloc(n * (k / g));
    if (fread(x, 4, m * k, f) + fread(q, 1, n * k / 2, f) + fread(s, 4, n * (k / g), f) + fread(z, 1, n * (k / g), f)
        == 0) return 2;
    if (edge_int4_linear_int8(x, m, k, q, s, z, n, g, y, 1) != 0) return 3;
    fwrite(y, 4, m * n, stdout);
    return 0;
}
"""


def _flags_this_cpu_runs() -> dict[str, list[str]]:
    """x86 builds of the kernel beside the native one: each instruction set's path this
    CPU can run."""
    if platform.machine() != "x86_64":
        return {}
    flags = Path("/proc/cpuinfo").read_text().split()
    builds = {"plain C": ["-march=x86-64"]}
    if "avx2" in flags and "fma" in flags:
        builds["AVX2"] = ["-march=x86-64-v3"]
    if "avx_vnni" in flags:
        builds["AVX-VNNI"] = ["-march=x86-64-v3", "-mavxvnni"]
    if "avx512_vnni" in flags:
        builds["AVX-512 VNNI"] = ["-march=x86-64-v4", "-mavx512vnni", "-mprefer-vector-width=512"]
    return builds


def _inputs(tmp_path: Path, m: int, n: int, k: int, group: int) -> tuple[Path, torch.Tensor, QuantizedWeight]:
    q, x = _weights(n, k, group, seed=5, rows=m)
    path = tmp_path / "inputs.bin"
    parts = [x.numpy(), q.qweight.numpy(), q.scales.float().numpy(), q.zeros.numpy()]
    path.write_bytes(b"".join(np.ascontiguousarray(p).tobytes() for p in parts))
    return path, x, q


@pytest.mark.parametrize(("n", "k", "group"), [(13, 576, 32), (9, 1536, 64), (6, 512, 128)])
def test_every_x86_path_gives_the_native_answers(tmp_path: Path, n: int, k: int, group: int) -> None:
    builds = _flags_this_cpu_runs()
    if not builds:
        pytest.skip("x86 instruction-set builds: this is not an x86_64 machine")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    m = 3
    _, x, q = _inputs(tmp_path, m, n, k, group)
    native = cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, group, int8=True)
    for name, flags in builds.items():
        lib = tmp_path / f"{name.replace(' ', '_')}.so"
        command = [cc, "-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", *flags]
        cpu_int4.compile_into(lib, command, cpu_int4.SOURCE, timeout=300)
        fn = ctypes.CDLL(str(lib)).edge_int4_linear_int8
        fn.restype, fn.argtypes = ctypes.c_int, cpu_int4._ARGS
        out = torch.empty(m, n)
        scales = q.scales.float()
        rc = fn(x.data_ptr(), m, k, q.qweight.data_ptr(), scales.data_ptr(), q.zeros.data_ptr(), n, group,
                out.data_ptr(), 1)  # fmt: skip
        assert rc == 0, name
        # The integer sums are exact everywhere; the float32 scaling rounds alike but for
        # fused multiply-adds where the instruction set has them.
        torch.testing.assert_close(out, native, rtol=2e-6, atol=2e-6, msg=name)


def test_the_arm_dot_product_path_gives_the_native_answers(tmp_path: Path) -> None:
    """Orin's path (sdot, -march=armv8.2-a+dotprod) built by a cross compiler and run
    under qemu-user, where both are installed."""
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if cross is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (crossbuild-essential-arm64, qemu-user)")
    m, n, k, group = 3, 13, 576, 32
    inputs, x, q = _inputs(tmp_path, m, n, k, group)
    driver = tmp_path / "driver.c"
    driver.write_text(DRIVER)
    program = tmp_path / "int8-arm"
    build = [cross, "-O3", "-std=gnu11", "-march=armv8.2-a+dotprod", "-static", "-o", str(program),
             str(driver), str(cpu_int4.SOURCE), "-lm"]  # fmt: skip
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    symbols = subprocess.run([cross.replace("-gcc", "-objdump"), "-d", str(program)], capture_output=True, text=True)
    assert "sdot" in symbols.stdout  # the dot-product path, not plain C
    done = subprocess.run([qemu, str(program), str(inputs), str(m), str(k), str(n), str(group)],
                          capture_output=True, timeout=300, check=True)  # fmt: skip
    out = torch.from_numpy(np.frombuffer(done.stdout, dtype=np.float32).copy()).view(m, n)
    native = cpu_int4.linear(x, q.qweight, q.scales.float(), q.zeros, group, int8=True)
    torch.testing.assert_close(out, native, rtol=2e-6, atol=2e-6)
