"""The continuous batcher on CUDA graphs (edge/text/runtime/continuous.py, cuda_graphs.StepGraphs):
each step is launched on the tokens chosen on the GPU before the host has read them, and
a sequence those tokens end drops its row of that step. Sequences decoded together, some
ending on EOS mid-batch while others go on, give the same tokens as each one alone."""

from __future__ import annotations

import pytest
import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.kv_quant import FORMATS, KVFormat
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

CONFIG = LlamaConfig(
    vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=1536
)


def _batcher(eos: frozenset[int], kv_format: KVFormat | None = None) -> ContinuousBatcher:
    from engines.text.random_llama import random_int4_llama

    model = random_int4_llama(CONFIG, "cuda", "cuda-mma", group=64, seed=5)
    batcher = ContinuousBatcher(model, None, eos, slots=4, slot_len=128, kv_format=kv_format)
    batcher.warm_up(prefill_lengths=(9,))
    # Decode: batch buckets 1, 2, 4 and one KV bucket of 128; prefill: prompts up to 16,
    # 32, 64, 128 (a quantized cache's prompts are prefilled op by op).
    assert batcher.capture_graphs() == (3 + 4 if kv_format is None else 3)
    return batcher


def _params(i: int, new: int) -> SamplingParams:
    # Seeded draws (a random model's greedy output soon repeats one token): each
    # sequence's generator lives on the GPU and draws only for its own row, so its tokens
    # are the same alone and batched, and they vary, so a row fed another's token shows.
    return SamplingParams(max_new_tokens=new, temperature=0.9, top_p=0.95 if i % 2 else 1.0, seed=100 + i)


def test_steps_launched_ahead_give_each_sequence_its_tokens_alone() -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 5, 20)]
    news = [40, 25, 40, 33]  # sequences 1 and 3 end on their length while others go on
    probe = _batcher(frozenset()).single(Sequence("probe", prompts[0], _params(0, news[0])))
    assert len(set(probe.tokens)) > 10
    # Sequence 0 ends on EOS mid-batch: a token it draws first at step 8 or later.
    eos_token = next(t for i, t in enumerate(probe.tokens) if i >= 8 and t not in probe.tokens[:i])
    batcher = _batcher(frozenset({eos_token}))
    alone = [batcher.single(Sequence(i, p, _params(i, m))) for i, (p, m) in enumerate(zip(prompts, news, strict=True))]
    assert alone[0].finish == "eos" and 8 <= len(alone[0].tokens) < news[0]
    together = batcher.run_all(
        [Sequence(i, p, _params(i, m)) for i, (p, m) in enumerate(zip(prompts, news, strict=True))]
    )
    for a, t in zip(alone, together, strict=True):
        assert len(set(a.tokens)) > 3
        assert t.tokens == a.tokens and t.finish == a.finish, f"sequence {a.owner}"
    assert max(batcher.batch_sizes) == 4 and batcher.kv.rows_free == 4
    # A greedy row beside them: its tokens alone and batched are the same too.
    greedy = SamplingParams(max_new_tokens=20)
    one = batcher.single(Sequence("g", prompts[2], greedy))
    mixed = batcher.run_all([Sequence("g", prompts[2], greedy), Sequence(1, prompts[1], _params(1, news[1]))])
    assert mixed[0].tokens == one.tokens and mixed[1].tokens == alone[1].tokens


def test_prefill_and_decode_are_timed_on_the_gpus_clock() -> None:
    """Each prefill and each decode step a sequence was in is bracketed by CUDA events:
    the result's stages are the GPU's time, not the host's clock around the launches."""
    import time

    from edge.tasks.qa import stages as seq_stages

    batcher = _batcher(frozenset())
    prompts = [list(range(3 + i, 12 + i)) for i in range(3)]
    t0 = time.perf_counter()
    seqs = batcher.run_all([Sequence(i, p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(prompts)])
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1000.0
    for seq in seqs:
        # One pair per prefill, one per step it was in (a step chooses one token each).
        assert len(seq.tokens) == 24 and len(seq.prefill_events) == 1 and len(seq.decode_events) == 24
        gpu_prefill, gpu_decode = seq.prefill_gpu_ms(), seq.decode_gpu_ms()
        assert gpu_prefill is not None and gpu_decode is not None
        # The GPU's own time: positive, and its stages together within the wall time.
        assert gpu_prefill > 0.0 and gpu_decode > 0.0 and gpu_prefill + gpu_decode <= wall_ms
        stages = seq_stages(seq)
        assert stages["prefill"] == gpu_prefill and stages["decode"] == gpu_decode


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_cache_serves_on_cuda_graphs_as_alone(dtype: str) -> None:
    """int8 and int4 KV through the fused step's own write and attention kernels, in
    captured graphs: sequences decoded together past several coded key blocks give what
    each gives alone, and the pool is the format's size."""
    fmt = FORMATS[dtype]  # type: ignore[index]
    batcher = _batcher(frozenset(), fmt)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (9, 30, 17)]
    news = [90, 70, 96]
    assert fmt.coded(9 + 90) >= fmt.key_block
    alone = [batcher.single(Sequence(i, p, _params(i, m))) for i, (p, m) in enumerate(zip(prompts, news, strict=True))]
    together = batcher.run_all(
        [Sequence(i, p, _params(i, m)) for i, (p, m) in enumerate(zip(prompts, news, strict=True))]
    )
    for a, t in zip(alone, together, strict=True):
        assert len(set(a.tokens)) > 3 and len(a.tokens) == news[int(a.owner)]
        assert t.tokens == a.tokens, f"sequence {a.owner}"
    assert batcher.kv.snapshot()["kv_dtype"] == dtype
    # The pool is the quantized cache as allocated, and what the KV manager counts.
    assert batcher.cache.nbytes < batcher.model.new_cache(4, 128).nbytes
    assert batcher.kv.bytes_per_token == -(-batcher.cache.nbytes // (4 * 128))
