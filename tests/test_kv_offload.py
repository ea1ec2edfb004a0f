"""Offload of paused sequences' KV rows (edge/text/kv/kv_offload.py) on the real SmolLM2:
a sequence paused for another and resumed from host memory or from a file answers what
it answers uninterrupted, greedy token for token, in every KV format; the choice between
restoring and recomputing follows the measured rates; files do not outlive their use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.text.kv.kv_offload import KVOffload, OffloadWhere, SavedRow
from edge.text.kv.kv_quant import FORMATS
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.ops.cpu import cpu_kv
from edge.text.prompt import chatml
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from engines.text.import_gguf import import_smollm2

QUESTIONS = ["Name three symptoms of dehydration.", "What is a normal body temperature?"]


@pytest.fixture(scope="module")
def ckpt(engine_dir: Path) -> TextCheckpoint:
    return load_checkpoint(import_smollm2(engine_dir, progress=False))


def _prompt(ckpt: TextCheckpoint, question: str) -> list[int]:
    return list(ckpt.tokenizer.encode(chatml("You are terse.", question), add_special_tokens=False).ids)


def _batcher(ckpt: TextCheckpoint, dtype: str, slots: int) -> ContinuousBatcher:
    fmt = None if dtype == "float16" else FORMATS[dtype]  # type: ignore[index]
    return ContinuousBatcher(ckpt.model, ckpt.tokenizer, frozenset(), slots=slots, slot_len=256, kv_format=fmt)


def _admit(batcher: ContinuousBatcher, seq: Sequence) -> None:
    slot = batcher.kv.allocate_slots(str(seq.owner), len(seq.prompt) + seq.params.max_new_tokens)
    assert slot is not None
    batcher.admit(seq, slot)


def _drain(batcher: ContinuousBatcher) -> None:
    while batcher.running:
        for done in batcher.step():
            assert done.kv is not None
            batcher.kv.free(done.kv)


def _interrupted(
    batcher: ContinuousBatcher, ckpt: TextCheckpoint, steps: int, seen: list[float] | None = None
) -> Sequence:
    """A sequence runs `steps` steps, is paused for an urgent one that takes its only row,
    then resumes; returns it finished. `seen` gets its prefill time when it is paused."""
    low = Sequence("low", _prompt(ckpt, QUESTIONS[0]), SamplingParams(max_new_tokens=60))
    _admit(batcher, low)
    for _ in range(steps):
        batcher.step()
    if seen is not None:
        seen.append(low.prefill_ms)
    slot = batcher.pause(low)
    assert slot is not None
    batcher.kv.free(slot)
    urgent = Sequence("urgent", _prompt(ckpt, QUESTIONS[1]), SamplingParams(max_new_tokens=12))
    _admit(batcher, urgent)  # overwrites the row low held
    _drain(batcher)
    _admit(batcher, low)
    _drain(batcher)
    return low


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "where"), [("float16", "memory"), ("float16", "disk"), ("int8", "disk"), ("int4", "memory")]
)
def test_a_paused_sequence_restored_answers_as_uninterrupted(
    ckpt: TextCheckpoint, tmp_path: Path, dtype: str, where: str
) -> None:
    if dtype != "float16" and not cpu_kv.available():
        pytest.skip("no C compiler for the quantized-KV kernel")
    alone = _batcher(ckpt, dtype, 1).single(Sequence("low", _prompt(ckpt, QUESTIONS[0]), SamplingParams(60)))
    batcher = _batcher(ckpt, dtype, 1)
    batcher.offload = KVOffload(where, batcher.device, tmp_path / "kv", max_memory_bytes=64 << 20)  # type: ignore[arg-type]
    prefill_ms: list[float] = []
    low = _interrupted(batcher, ckpt, steps=40, seen=prefill_ms)  # past key blocks coded during decode
    assert low.tokens == alone.tokens and low.pauses == 1
    counts = batcher.offload.snapshot()
    assert counts["saved"] == 1 and counts["restored"] == 1 and counts["recomputed"] == 0
    # Its prompt was prefilled once: the resume restored the row, it prefilled nothing.
    assert batcher.offload.prefill_tokens_per_s is not None and low.prefill_ms == prefill_ms[0] > 0
    assert counts["memory_bytes"] == 0 and counts["disk_bytes"] == 0
    if where == "disk":
        assert not list((tmp_path / "kv").glob("*"))  # its file went once it was restored
    batcher.offload.close()


@pytest.mark.slow
def test_paused_mid_prefill_restores_its_chunks_and_goes_on(ckpt: TextCheckpoint, tmp_path: Path) -> None:
    first = Sequence("first", _prompt(ckpt, QUESTIONS[1]), SamplingParams(max_new_tokens=10))
    second = Sequence("second", _prompt(ckpt, QUESTIONS[0]), SamplingParams(max_new_tokens=20))
    want = _batcher(ckpt, "float16", 2)
    want.prefill_chunk = 8
    _admit(want, Sequence("first", first.prompt, first.params))
    _admit(want, ref := Sequence("second", second.prompt, second.params))  # chunked beside first
    _drain(want)
    batcher = _batcher(ckpt, "float16", 2)
    batcher.prefill_chunk = 8
    batcher.offload = KVOffload("memory", batcher.device)
    _admit(batcher, first)
    _admit(batcher, second)
    batcher.step()
    assert second.logits is None and second.prefilled == 16
    slot = batcher.pause(second)
    assert slot is not None and second.saved is not None and second.saved.length == 16
    batcher.kv.free(slot)
    _admit(batcher, second)  # restored at 16, its chunks go on from there
    assert second.prefilled == 16 and second.logits is None
    _drain(batcher)
    assert second.tokens == ref.tokens
    assert batcher.offload.snapshot()["restored"] == 1


@pytest.mark.slow
def test_recompute_is_chosen_when_the_measured_rates_say_it_is_faster(ckpt: TextCheckpoint) -> None:
    alone = _batcher(ckpt, "float16", 1).single(Sequence("low", _prompt(ckpt, QUESTIONS[0]), SamplingParams(60)))
    batcher = _batcher(ckpt, "float16", 1)
    offload = KVOffload("memory", batcher.device)
    batcher.offload = offload
    # As if restoring had been measured very slow: the resume prefills again.
    offload.restore_bytes_per_s = 1.0
    low = _interrupted(batcher, ckpt, steps=10)
    assert low.tokens == alone.tokens
    counts = offload.snapshot()
    assert counts["recomputed"] == 1 and counts["restored"] == 0 and counts["memory_bytes"] == 0


def test_the_choice_follows_the_measured_rates() -> None:
    offload = KVOffload("memory", torch.device("cpu"))
    saved = SavedRow(length=1000, nbytes=10_000_000, tensors=None, logits=None)
    assert offload.choose(saved) == "restore"  # nothing measured yet
    offload.note_prefill(4, 0.001)  # too short to say what a prefill costs
    assert offload.prefill_tokens_per_s is None
    offload.note_prefill(1000, 1.0)  # 1000 tokens/s: recomputing takes 1 s
    offload.restore_bytes_per_s = 20e6  # restoring 10 MB takes 0.5 s
    assert offload.choose(saved) == "restore"
    offload.restore_bytes_per_s = 5e6  # 2 s
    assert offload.choose(saved) == "recompute"
    offload.note_prefill(1000, 0.25)  # faster prefills move the running rate up
    assert offload.prefill_tokens_per_s == pytest.approx(0.7 * 1000 + 0.3 * 4000)


def test_files_are_coded_where_it_pays_and_cleared_and_memory_is_bounded(tmp_path: Path) -> None:
    from edge.text.architecture import LlamaConfig
    from edge.text.kv.float_cache import KVCache

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cache = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))
    cache.k.normal_()
    cache.v.normal_()
    stale = tmp_path / "kv" / "old.kv"
    stale.parent.mkdir()
    stale.write_bytes(b"from a run before")
    row_bytes = 2 * 2 * 20 * 32 * 4  # k and v, 2 layers, 20 tokens, 32 channels, float32
    offload = KVOffload("disk", torch.device("cpu"), tmp_path / "kv", max_memory_bytes=row_bytes)
    assert not stale.exists()  # nothing offloaded before a start is anyone's now
    saved = offload.save(cache, 1, 20, torch.arange(64.0))
    assert saved is not None and saved.nbytes == row_bytes
    assert saved.written is not None
    saved.written.result()
    assert saved.path is not None and saved.path.exists() and saved.tensors is None
    assert saved.codec == "none"  # random floats: lz4 does not pay, the bytes are kept raw
    other = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))
    logits = offload.restore(saved, other, 0)
    assert logits is not None and torch.equal(logits, torch.arange(64.0))
    assert torch.equal(other.k[:, 0, :, :20], cache.k[:, 1, :, :20])
    assert torch.equal(other.v[:, 0, :, :20], cache.v[:, 1, :, :20])
    assert not list((tmp_path / "kv").glob("*")) and offload.snapshot()["disk_bytes"] == 0
    zeros = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))  # zeros: lz4 pays
    packed = offload.save(zeros, 0, 20, None)
    assert packed is not None and packed.written is not None
    packed.written.result()
    assert packed.codec == "lz4" and packed.stored_bytes < row_bytes / 10
    offload.release(packed)
    offload.close()
    # In memory, at most max_memory_bytes at once: a row beyond is not offloaded.
    held = KVOffload("memory", torch.device("cpu"), max_memory_bytes=row_bytes)
    first = held.save(cache, 0, 20, None)
    assert first is not None and held.save(cache, 1, 20, None) is None
    assert held.snapshot()["skipped"] == 1 and held.snapshot()["memory_bytes"] == row_bytes
    held.release(first)
    assert held.snapshot()["memory_bytes"] == 0 and held.save(cache, 1, 20, None) is not None


def test_a_row_file_has_its_name_only_once_its_entry_points_at_it(tmp_path: Path) -> None:
    """Whoever sees a row's file under its name (an operator, a damaged disk, a test) sees
    an entry that reads that file: the rename and the entry's update happen together
    under the offload's lock. Renamed before the entry said so, the file could be deleted
    in between: the writer failed, and the copy still in memory was restored as if the
    file had been read."""
    import threading

    from edge.text.kv.kv_offload import write_row_file

    lock = threading.Lock()
    placed: list[tuple[int, list[str]]] = []
    path = tmp_path / "row.kv"
    parts = {"k": torch.randn(2, 20, 32), "__logits__": torch.zeros(64)}
    lock.acquire()
    writer = threading.Thread(target=write_row_file, args=(path, 20, parts, lambda *a: placed.append(a), lock))
    writer.start()
    try:
        writer.join(timeout=0.5)  # it writes the file beside, then waits for the lock to name it
        assert writer.is_alive() and path.with_suffix(".tmp").exists()
        assert not path.exists() and not placed
    finally:
        lock.release()
    writer.join(timeout=10)
    assert path.exists() and not path.with_suffix(".tmp").exists()
    assert placed == [(path.stat().st_size, ["none", "lz4"])]  # random keys kept raw, zero logits packed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "where"), [("float16", "memory"), ("int4", "disk")])
def test_on_cuda_a_row_copied_on_a_side_stream_restores_as_uninterrupted(
    tmp_path: Path, dtype: str, where: str
) -> None:
    """On CUDA the row goes to pinned memory on a side stream while the serving stream
    waits for the copy on the GPU; the urgent sequence then overwrites the row at once.
    Resumed (on CUDA graphs), the paused sequence decodes what it decodes alone."""
    from edge.text.architecture import LlamaConfig
    from engines.text.random_llama import random_int4_llama

    config = LlamaConfig(vocab_size=1024, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
                         intermediate_size=1536)  # fmt: skip
    model = random_int4_llama(config, "cuda", "cuda-mma", group=64, seed=5)
    fmt = None if dtype == "float16" else FORMATS[dtype]  # type: ignore[index]
    batcher = ContinuousBatcher(model, None, frozenset(), slots=1, slot_len=256, kv_format=fmt)
    batcher.warm_up(prefill_lengths=(9,))
    batcher.capture_graphs()
    gen = torch.Generator().manual_seed(4)
    prompt, other = (torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (40, 30))
    params = SamplingParams(max_new_tokens=120, temperature=0.9, seed=11)
    alone = batcher.single(Sequence("low", prompt, params))
    assert len(set(alone.tokens)) > 10
    batcher.offload = KVOffload(where, batcher.device, tmp_path / "kv")  # type: ignore[arg-type]
    low = Sequence("low", prompt, params)
    _admit(batcher, low)
    for _ in range(100):  # past key blocks coded during decode
        batcher.step()
    slot = batcher.pause(low)
    assert slot is not None and low.saved is not None
    batcher.kv.free(slot)
    urgent = Sequence("urgent", other, SamplingParams(max_new_tokens=20, temperature=0.9, seed=3))
    _admit(batcher, urgent)
    _drain(batcher)
    _admit(batcher, low)
    _drain(batcher)
    assert low.tokens == alone.tokens
    assert batcher.offload.snapshot()["restored"] == 1
    # The row's pinned buffer is kept for the next pause, which copies into it again
    # instead of pinning new host memory on the batcher's thread.
    pool = batcher.offload.pinned
    assert pool is not None and len(pool.idle) == 1 and pool.in_use == 0
    kept = pool.idle[0].data_ptr()
    again = Sequence("again", prompt, params)
    _admit(batcher, again)
    for _ in range(100):
        batcher.step()
    slot = batcher.pause(again)
    assert again.saved is not None and again.saved.buffer is not None
    assert again.saved.buffer.data_ptr() == kept and not pool.idle
    if slot is not None:
        batcher.kv.free(slot)
    batcher.offload.release(again.saved)
    assert len(pool.idle) == 1 and batcher.offload.snapshot()["memory_bytes"] == 0


def test_pinned_buffers_are_sized_in_eighths_of_an_octave() -> None:
    """A pooled buffer is at most 1/8 larger than asked for, so that rows of nearby
    lengths share buffers without holding much more host memory than they fill."""
    from edge.text.kv.kv_offload import _size_class

    assert _size_class(1) == 4096 and _size_class(4096) == 4096
    for nbytes in (4097, 100_000, 128 << 20, (128 << 20) + 1, 3_000_001):
        size = _size_class(nbytes)
        assert nbytes <= size <= nbytes * 1.125
    assert _size_class(128 << 20) == 128 << 20


def test_a_restore_is_measured_again_when_the_figures_say_recompute() -> None:
    """One slow restore measured (as a first one can be) would make every resume prefill
    again, and restoring would never be measured again; a declined restore is made all
    the same after `recheck.every` declines, and its measurement moves the rate."""
    from edge.text.architecture import LlamaConfig
    from edge.text.kv.float_cache import KVCache

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cache = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))
    offload = KVOffload("memory", torch.device("cpu"))
    offload.note_prefill(1000, 1.0)  # recomputing 20 tokens: 20 ms
    offload.restore_bytes_per_s = 1000.0  # restoring a 20 KB row: 20 s
    every = offload.recheck.every
    saved = offload.save(cache, 1, 20, None)
    assert saved is not None
    choices = [offload.choose(saved) for _ in range(every)]
    assert choices == ["recompute"] * (every - 1) + ["restore"]
    offload.restore(saved, cache, 0)  # a memory copy: far faster than 1 KB/s
    assert offload.restore_bytes_per_s > 1e5
    again = offload.save(cache, 1, 20, None)
    assert again is not None and offload.choose(again) == "restore"
    assert offload.snapshot()["rechecked"] == 1 and offload.recheck.wait == every


def _damage(path: Path, how: str, length: int) -> None:
    """What the outside battery did to a paused sequence's file (`length`: its tokens)."""
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "bit-flipped":
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x10
        path.write_bytes(bytes(data))
    else:  # NaN in every float, in a file whose checksums are right for what it holds
        from edge.text.kv.kv_offload import read_row_file, write_row_file

        parts = read_row_file(path, length)
        write_row_file(
            path, length, {k: t.fill_(float("nan")) if t.is_floating_point() else t for k, t in parts.items()}
        )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["deleted", "truncated", "bit-flipped", "nan"])
def test_a_row_file_that_cannot_be_restored_is_let_go_and_prefilled_again(
    ckpt: TextCheckpoint, tmp_path: Path, how: str
) -> None:
    alone = _batcher(ckpt, "float16", 1).single(Sequence("low", _prompt(ckpt, QUESTIONS[0]), SamplingParams(40)))
    batcher = _batcher(ckpt, "float16", 1)
    offload = KVOffload("disk", batcher.device, tmp_path / "kv")
    batcher.offload = offload
    low = Sequence("low", _prompt(ckpt, QUESTIONS[0]), SamplingParams(max_new_tokens=40))
    _admit(batcher, low)
    for _ in range(10):
        batcher.step()
    slot = batcher.pause(low)
    assert slot is not None and low.saved is not None and low.saved.written is not None
    batcher.kv.free(slot)
    low.saved.written.result()
    assert low.saved.path is not None and low.saved.stored_bytes > 0
    assert offload.snapshot()["disk_bytes"] == low.saved.stored_bytes
    _damage(low.saved.path, how, low.saved.length)
    _admit(batcher, low)  # the row cannot be restored: prefilled again, nothing else lost
    _drain(batcher)
    assert low.tokens == alone.tokens and low.finish == alone.finish
    counts = offload.snapshot()
    assert counts["restore_failed"] == 1 and counts["restored"] == 0
    assert counts["disk_bytes"] == 0 and counts["memory_bytes"] == 0
    assert not list((tmp_path / "kv").glob("*"))  # the bad file is gone, not kept for good
    offload.close()


@pytest.mark.slow
def test_one_sequence_with_scores_gone_bad_fails_alone_and_the_batch_goes_on(ckpt: TextCheckpoint) -> None:
    sampled = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3)
    alone = _batcher(ckpt, "float16", 2).single(Sequence("ok", _prompt(ckpt, QUESTIONS[1]), sampled))
    batcher = _batcher(ckpt, "float16", 2)
    bad = Sequence("bad", _prompt(ckpt, QUESTIONS[0]), SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))
    good = Sequence("ok", _prompt(ckpt, QUESTIONS[1]), sampled)
    _admit(batcher, bad)
    _admit(batcher, good)
    assert bad.logits is not None
    bad.logits = torch.full_like(bad.logits, float("nan"))  # as a poisoned row would leave them
    _drain(batcher)
    assert bad.finish == "error" and bad.error is not None and "not finite" in bad.error
    assert good.tokens == alone.tokens and good.finish == alone.finish


def test_host_copies_are_charged_to_the_memory_ledger(tmp_path: Path) -> None:
    from edge.scheduler.ledger import MemoryLedger
    from edge.text.architecture import LlamaConfig
    from edge.text.kv.float_cache import KVCache

    config = LlamaConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    cache = KVCache(config, 2, 32, torch.float32, torch.device("cpu"))
    row_bytes = 2 * 2 * 20 * 32 * 4
    ledger = MemoryLedger(budget_bytes=row_bytes + row_bytes // 2)
    wheres: tuple[OffloadWhere, ...] = ("memory", "disk")
    for where in wheres:
        offload = KVOffload(where, torch.device("cpu"), tmp_path / where, max_memory_bytes=4 * row_bytes)
        offload.reserve = lambda nbytes: ledger.reserve("kv-offload", "kv_offload", nbytes)
        offload.release_grant = ledger.release
        first = offload.save(cache, 0, 20, None)
        assert first is not None
        if where == "memory":
            assert ledger.snapshot()["jobs_by_class"] == {"kv_offload": row_bytes}
            # A second row the ledger cannot hold is not offloaded (its sequence recomputes).
            assert offload.save(cache, 1, 20, None) is None and offload.snapshot()["skipped"] == 1
        else:
            assert first.written is not None
            first.written.result()  # on disk now: its host copy and its charge are gone
            assert ledger.used_bytes() == 0 and first.path is not None
        offload.release(first)
        assert ledger.used_bytes() == 0 and offload.snapshot()["memory_bytes"] == 0
        offload.close()
