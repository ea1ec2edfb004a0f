"""What loading a text checkpoint holds at once: the model it keeps and about one
layer's worth more, never the checkpoint's codes beside their tiled copies for the
whole model (which is what made an 8B model's load overrun an 8 GiB budget that its
loaded state fits).

Without a GPU, `LiveBytes` stands in for the CUDA allocator's statistics: it counts the
storages made on a device while it watches and that are still alive. A load on the CPU
with the cuda-mma kernel runs the CUDA load's steps (its repacking is torch's tensor
operations, on any device); there the host and the device are one memory, so what the
loader stages on the host counts too and the bounds say so. The GPU test measures the
real allocator on an 8B-shape model.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from edge.text.architecture import LlamaConfig
from edge.text.model import embedding
from edge.text.model.checkpoint import load_checkpoint
from edge.text.model.embedding import QuantizedEmbedding
from edge.text.model.llama import LlamaModel
from edge.text.ops.cuda import cuda_int4
from edge.text.ops.int4 import Int4Linear, QuantizedWeight, concat_rows, dequantize, pack
from engines.text.random_llama import LLAMA3_8B, word_tokenizer, write_random_checkpoint

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
SMALL = LlamaConfig(
    vocab_size=1000, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4, num_kv_heads=2,
    max_position=256,
)  # fmt: skip
# 3 tiles of 256 channels, 1 of 704: every weight of SMALL is repacked in several slabs.
SLAB = 3 * 16 * 256


class LiveBytes(TorchDispatchMode):
    """Bytes of storages on `device` that torch operations made while this mode was on
    and that are still alive (`now`), and the most there were at once (`peak`)."""

    def __init__(self, device: str, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.device = torch.device(device).type
        self.ignore = {id(t.untyped_storage()) for t in ignore}  # made before: not counted
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            storage = t.untyped_storage()
            key = id(storage)  # one Python object per storage while it lives
            if key in self.live or key in self.ignore:
                continue
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out


def _repack_whole(q: QuantizedWeight, paired: bool = False) -> cuda_int4.TiledInt4:
    """The tiled layout as repack made it before it went a slab at a time: the whole
    weight in one pass (kept here as the bytes a slab-wise repack must reproduce)."""
    qweight, scales, zeros, group_size = q.qweight, q.scales, q.zeros, q.group_size
    n, half = qweight.shape
    k = half * 2
    if paired:
        order = cuda_int4.pair_order(n, qweight.device)
        qweight, scales, zeros = qweight[order], scales[order], zeros[order]
    tiles = -(-n // 16)
    pad = tiles * 16 - n
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(n, k)
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    grid = codes.reshape(tiles, 2, 8, k // 64, 2, 4, 2, 2, 2)
    nib = grid.permute(0, 3, 2, 5, 4, 6, 8, 7, 1).reshape(tiles, k // 64, 32, 4, 4, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).contiguous()
    words = packed.view(torch.int32).reshape(tiles, k // 64, 32, 4)
    groups = k // group_size
    return cuda_int4.TiledInt4(
        codes=words.contiguous(),
        scales=scales.to(torch.float16).reshape(tiles, 16, groups).transpose(1, 2).contiguous(),
        zeros=zeros.to(torch.uint8).reshape(tiles, 16, groups).transpose(1, 2).contiguous(),
        n=n, k=k, group_size=group_size, paired=paired,
    )  # fmt: skip


def _same(a: cuda_int4.TiledInt4, b: cuda_int4.TiledInt4) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.codes, b.codes), (a.scales, b.scales), (a.zeros, b.zeros)))


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    unique = {(t.device, t.data_ptr()): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _model_bytes(model: torch.nn.Module) -> int:
    """What the loaded model keeps: its parameters and buffers, each once."""
    return _nbytes([*model.parameters(), *model.buffers()])


@pytest.mark.parametrize(
    ("n", "k", "group", "paired"),
    [(1000, 256, 64, False), (40, 576, 64, False), (1408, 256, 64, True), (256, 704, 64, False), (64, 128, 32, True)],
)
def test_repacked_a_slab_at_a_time_the_bytes_are_the_whole_weights(
    n: int, k: int, group: int, paired: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slabs of tiles (the last one padded), paired gate/up rows picked per slab: the same
    codes, scales and zeros as repacking the whole weight, and the layout still holds the
    checkpoint's weight."""
    monkeypatch.setattr(cuda_int4, "REPACK_SLAB_VALUES", SLAB, raising=False)
    gen = torch.Generator().manual_seed(n + k)
    q = pack(torch.randn(n, k, generator=gen), group)
    tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, group, paired=paired)
    assert _same(tiled, _repack_whole(q, paired))
    assert torch.equal(cuda_int4.reference_weight(tiled), dequantize(q))


@pytest.mark.parametrize(("n", "k", "paired"), [(1000, 256, False), (1408, 256, True), (256, 704, False)])
def test_repack_holds_its_result_and_one_slab(n: int, k: int, paired: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the tiles it makes, repack holds one slab's working copies (under 3 bytes a
    code), not the whole weight's unpacked codes (a byte each) and their permuted copy:
    an 8B model's output layer made 1.3 GB of those on the GPU at once."""
    monkeypatch.setattr(cuda_int4, "REPACK_SLAB_VALUES", SLAB, raising=False)
    q = pack(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), 64)
    with LiveBytes("cpu", ignore=[q.qweight, q.scales, q.zeros]) as live:
        tiled = cuda_int4.repack(q.qweight, q.scales, q.zeros, 64, paired=paired)
    assert live.now == tiled.nbytes
    assert live.peak - live.now <= 3 * SLAB, (live.peak - live.now, n * k)


def test_a_layer_made_on_a_device_from_host_codes_takes_them_there_a_slab_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loader's way on CUDA, with the meta device standing in for the GPU: the codes
    stay on the host, and the device holds the tiles and one slab's work, never the
    whole source weight."""
    monkeypatch.setattr(cuda_int4, "REPACK_SLAB_VALUES", SLAB)
    q = pack(torch.randn(1408, 256, generator=torch.Generator().manual_seed(2)), 64)
    with LiveBytes("meta") as live:
        layer = Int4Linear(q, "cuda-mma", gated=True, device="meta")
    assert layer.codes.device.type == "meta" and layer.paired
    assert live.now == layer.tiled.nbytes
    assert live.peak - live.now <= 3 * SLAB
    assert 3 * SLAB < q.nbytes  # the bound is below a second copy of the source
    on_host = Int4Linear(q, "cuda-mma", gated=True)
    assert _same(on_host.tiled, _repack_whole(q, paired=True))


def test_a_table_compacted_a_slab_at_a_time_is_the_same_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token table's codes and scales do not depend on how many rows go at once (the
    loader compacts on the device from the host's float table, a slab at a time)."""
    table = torch.randn(1000, 256, generator=torch.Generator().manual_seed(3)).half()
    whole = {fmt: QuantizedEmbedding(table, fmt) for fmt in ("int8", "int4")}
    monkeypatch.setattr(embedding, "SLAB_BYTES", 7 * 256 * 4)
    for fmt, expected in whole.items():
        slabs = QuantizedEmbedding(table, fmt, device="cpu")  # type: ignore[arg-type]
        assert torch.equal(slabs.codes, expected.codes) and torch.equal(slabs.scales, expected.scales)
    with LiveBytes("meta") as live:
        compact = QuantizedEmbedding(table, "int8", device="meta")
    assert compact.codes.device.type == "meta" and compact.dtype == torch.float16
    assert live.peak - live.now <= 3 * embedding.SLAB_BYTES + 64 * 1024
    assert live.peak < table.nbytes  # the float table never went to the device


def _write_float_checkpoint(path: Path, config: LlamaConfig) -> Path:
    torch.manual_seed(0)
    model = LlamaModel(config)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not k.startswith("rope_")}
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(config.to_json() + "\n", encoding="utf-8")
    word_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    (path / "generation.json").write_text(json.dumps({"eos_token_id": config.vocab_size - 1}), encoding="utf-8")
    return path


def _unit_bytes(path: Path) -> dict[str, int]:
    """Checkpoint bytes of each linear as the loader makes it: a layer's q/k/v together,
    its gate/up together, each other linear alone (INT4 codes, scales and zeros, or a
    float weight), and each other tensor."""
    fused = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    units: dict[str, int] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            parts = key.split(".")
            if parts[0] == "layers" and len(parts) == 5:
                name = ".".join([*parts[:3], fused.get(parts[3], parts[3])])
            else:
                name = key.rpartition(".")[0]
            t = f.get_tensor(key)
            units[name] = units.get(name, 0) + t.numel() * t.element_size()
    return units


@pytest.mark.parametrize("kind", ["int4", "float"])
def test_a_load_holds_the_model_and_one_linear_more(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded on the CPU (host and device one memory), with the cuda-mma kernel's
    repacking for an INT4 model: at no moment more than the loaded model, one fused
    linear's codes twice (its parts and their concatenation, both on the host) and one
    repack slab's work; and nothing left behind. Before, the whole checkpoint was read
    first and every o, down and output layer's codes lived beside their tiles to the end
    of the load (a float model's q/k/v and gate/up beside their concatenation): the load
    held the checkpoint twice over."""
    monkeypatch.setattr(cuda_int4, "REPACK_SLAB_VALUES", SLAB, raising=False)
    if kind == "int4":
        path = write_random_checkpoint(tmp_path / "ckpt", SMALL, group=64)
        kwargs: dict[str, Any] = {"int4_kernel": "cuda-mma", "dtype": torch.float16}
    else:
        path = _write_float_checkpoint(tmp_path / "ckpt", SMALL)
        kwargs = {"dtype": torch.float32}
    units = _unit_bytes(path)
    unit = max(size for name, size in units.items() if name != "embed_tokens")
    layer = sum(size for name, size in units.items() if name.startswith("layers.0."))
    assert 2 * unit <= layer  # the bound below is about one layer's weights
    with LiveBytes("cpu") as live:
        ckpt = load_checkpoint(path, device="cpu", **kwargs)
    model = _model_bytes(ckpt.model)
    assert live.now <= model + 64 * 1024, (live.now, model)
    assert live.peak - model <= 2 * unit + 3 * SLAB + 64 * 1024, (live.peak - model, unit, layer)
    if kind == "int4":
        assert {m.kernel for m in ckpt.model.modules() if isinstance(m, Int4Linear)} == {"cuda-mma"}


def test_the_loaded_tiles_are_the_whole_weights_repacked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every INT4 layer the loader makes (q/k/v and gate/up fused and paired, padded
    output rows) holds the bytes the whole-weight repack of the checkpoint's own codes
    gives: loading a slab at a time changed no bit."""
    monkeypatch.setattr(cuda_int4, "REPACK_SLAB_VALUES", SLAB, raising=False)
    path = write_random_checkpoint(tmp_path / "ckpt", dataclasses.replace(SMALL, num_layers=2), group=64)
    model = load_checkpoint(path, dtype=torch.float16, int4_kernel="cuda-mma", embedding="int8").model
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 2 * 4 + 1
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name, layer in layers.items():
            parent, _, proj = name.rpartition(".")  # "layers.0.self_attn", "qkv_proj"
            key = f"{parent.rpartition('.')[2]}.{proj}"
            parts = [f"{parent}.{p}" for p in fused[key]] if key in fused else [name]
            codes = [[f.get_tensor(f"{p}.{t}") for t in ("qweight", "scales", "zeros")] for p in parts]
            q = concat_rows([QuantizedWeight(qweight, scales, zeros, 64) for qweight, scales, zeros in codes])
            assert layer.paired == (key == "mlp.gate_up_proj")
            assert _same(layer.tiled, _repack_whole(q, layer.paired)), name


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_an_8b_shape_model_loads_within_its_loaded_size_and_a_slab(tmp_path: Path) -> None:
    """Llama 3 8B's shapes (a quarter of its layers; its full 128256-token table and
    output layer, the largest tensors), INT4, onto the GPU as the daemon loads it
    (float16, int8 token table): the allocator's peak during the load is the loaded
    model plus at most one slab's work. A repack slab's copies are under 3 bytes a code
    (3 x REPACK_SLAB_VALUES, 48 MiB); a table slab's (float32 rows, quotient, rounded)
    3 x SLAB_BYTES (48 MiB) and its float16 rows; they never overlap. 16 MiB more for
    allocator rounding and small tensors: 64 MiB, under one 8B layer's 109 MiB of
    codes. Before, the load held the checkpoint's codes beside their tiles, the output
    layer's unpacked codes whole and the float16 table beside its int8 form: gigabytes
    over (7.88 GiB against an 8 GiB budget's 7.34 on the whole daemon)."""
    config = dataclasses.replace(LLAMA3_8B, num_layers=8)
    path = write_random_checkpoint(tmp_path / "llama3-8b-int4", config, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ckpt = load_checkpoint(path, dtype=torch.float16, device="cuda", embedding="int8")
    torch.cuda.synchronize()
    steady = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    bound = 3 * max(cuda_int4.REPACK_SLAB_VALUES, embedding.SLAB_BYTES) + (16 << 20)
    layer_bytes = sum(m.weight_bytes for m in ckpt.model.layers[0].modules() if isinstance(m, Int4Linear))
    assert bound < layer_bytes
    assert steady >= _model_bytes(ckpt.model)
    print(f"{ckpt.int4_kernel}: loaded {steady / 2**20:.0f} MiB, load peak {peak / 2**20:.0f} MiB")
    assert peak - steady <= bound, (ckpt.int4_kernel, steady, peak, bound)
