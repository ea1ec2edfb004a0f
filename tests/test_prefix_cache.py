"""The prefix cache (edge/text/kv/prefix_cache.py): prompts sharing the system turn and
context documents prefill them once; a hit answers exactly what the miss answered, in
the float and the quantized caches; entries are evicted least recently used first, within
the byte bound and what the ledger grants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.config.text import QAModelConfig
from edge.text.engine import TextEngine
from edge.text.kv.kv_quant import FORMATS
from edge.text.kv.prefix_cache import PrefixCache
from edge.text.model.checkpoint import TextCheckpoint, load_checkpoint
from edge.text.ops.cpu import cpu_kv
from edge.text.runtime.continuous import ContinuousBatcher, Sequence
from edge.text.runtime.generate import SamplingParams
from engines.text.import_gguf import import_smollm2
from tests.spies import prefills_run

LEAFLET = (
    "Oral rehydration solution: dissolve one sachet in 200 ml of drinking water. Give small sips "
    "often. For adults, 200 to 400 ml after each loose stool. Seek care if there is blood in the "
    "stool, a high fever, or no urine for eight hours. Do not add sugar or salt to the solution. "
) * 3


def _saved(nbytes: int) -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(nbytes, dtype=torch.uint8)}


def test_entries_go_least_recently_used_first_within_bytes_and_the_ledger() -> None:
    cache = PrefixCache(capacity_bytes=300)
    granted: list[int] = []
    budget = {"left": 10_000}

    def reserve(nbytes: int) -> int | None:
        if nbytes > budget["left"]:
            return None
        budget["left"] -= nbytes
        granted.append(nbytes)
        return nbytes

    def release(grant: int) -> None:
        budget["left"] += grant

    cache.reserve, cache.release = reserve, release
    assert cache.put([1, 2], _saved(100)) and cache.put([3, 4], _saved(100)) and cache.put([5, 6], _saved(100))
    assert cache.get([1, 2]) is not None  # now the most recently used
    assert cache.put([7, 8], _saved(100))  # over 300 bytes: [3, 4], the oldest unused, goes
    assert cache.get([3, 4]) is None and cache.get([1, 2]) is not None and cache.get([5, 6]) is not None
    assert not cache.put([9], _saved(301))  # larger than the whole cache
    # The ledger has room for 100 more bytes only: entries go until it grants.
    budget["left"] = 100
    assert cache.put([10], _saved(250))
    snap = cache.snapshot()
    assert snap["entries"] == 1 and snap["bytes"] == 250 and budget["left"] == 100 + 300 - 250
    assert snap["evictions"] == 4 and snap["refused"] == 1
    # Room in the cache, none in the ledger: the older entry goes so that the ledger grants.
    budget["left"] = 0
    assert cache.put([11], _saved(50)) and cache.get([10]) is None and budget["left"] == 250 - 50
    budget["left"] = 0
    assert cache.put([12], _saved(50)) and cache.get([11]) is None  # the same once more
    budget["left"] = -1_000  # nothing to evict that would make room: refused
    cache.clear()
    assert not cache.put([13], _saved(50)) and cache.snapshot()["refused"] == 2
    assert cache.snapshot()["bytes"] == 0 and budget["left"] == -1_000 + 50


@pytest.fixture(scope="module")
def ckpt(engine_dir: Path) -> TextCheckpoint:
    return load_checkpoint(import_smollm2(engine_dir, progress=False))


def test_prompts_split_after_the_documents(ckpt: TextCheckpoint) -> None:
    engine = TextEngine(
        ckpt, QAModelConfig(max_context_tokens=1024, max_sequences=1, kv_offload="off", prefix_cache_mib=0)
    )
    a, pa = engine.prompter.parts("How much water per sachet?", LEAFLET)
    b, pb = engine.prompter.parts("When should I seek care?", LEAFLET)
    c, pc = engine.prompter.parts("How much water per sachet?", LEAFLET.replace("200 ml", "250 ml"))
    leaflet_tokens = len(ckpt.tokenizer.encode(LEAFLET, add_special_tokens=False).ids)
    assert pa == pb and pa > leaflet_tokens and a[:pa] == b[:pb]
    assert pa < len(a) and a[pa:] != b[pb:]
    assert c[:pc] != a[:pa]  # other documents: another key
    bare, pbare = engine.prompter.parts("What is a normal body temperature?", None)
    assert 0 < pbare < len(bare)  # the system turn alone


def _run(batcher: ContinuousBatcher, seq: Sequence) -> Sequence:
    return batcher.single(seq)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_hit_answers_as_the_miss_did_and_prefills_only_the_question(ckpt: TextCheckpoint, dtype: str) -> None:
    if dtype != "float16" and not cpu_kv.available():
        pytest.skip("no C compiler for the quantized-KV kernel")
    settings = QAModelConfig.model_validate(
        {"max_context_tokens": 512, "max_sequences": 2, "kv_dtype": dtype, "prefix_cache_mib": 16, "kv_offload": "off"}
    )
    engine = TextEngine(ckpt, settings)
    batcher = engine.batcher
    assert batcher.prefix_cache is not None
    questions = ["How much water per sachet?", "When should I seek care?"]
    seqs = []
    with prefills_run(batcher.model) as prefilled:
        for q in questions + questions[:1]:
            ids, prefix = engine.prompter.parts(q, LEAFLET)
            seq = Sequence(q, ids, SamplingParams(max_new_tokens=24))
            seq.prefix = prefix
            seqs.append(_run(batcher, seq))
    prefix = seqs[0].prefix
    snap = batcher.prefix_cache.snapshot()
    assert snap["misses"] == 1 and snap["hits"] == 2 and snap["entries"] == 1
    # The miss: the prefix from 0, then its question after it; the hits: the question only.
    prompts = [(s, n) for s, n in prefilled if n > 1]
    assert prompts[0] == (0, prefix) and prompts[1] == (prefix, len(seqs[0].prompt) - prefix)
    assert prompts[2] == (prefix, len(seqs[1].prompt) - prefix)
    assert prompts[3] == (prefix, len(seqs[2].prompt) - prefix)
    assert seqs[2].tokens == seqs[0].tokens  # a hit answers what the miss answered
    kept = snap["bytes"]
    assert isinstance(kept, int) and batcher.kv.snapshot()["prefix_cache"]["bytes"] == kept > 0
    fmt = None if dtype == "float16" else FORMATS[dtype]  # type: ignore[index]
    expect = ckpt.model.new_cache(1, prefix + 1, fmt)
    assert kept <= expect.nbytes


def test_prompts_are_not_split_where_the_measured_costs_say_a_hit_does_not_pay() -> None:
    """As on a GPU that prefills whole prompts in captured graphs and chunks op by op: a
    hit (the question after the kept document) measured to cost about what the whole
    prompt costs is not worth splitting for; where it costs a small share, it is."""
    cache = PrefixCache(1 << 20)
    assert cache.worth(2000, 24)  # nothing measured yet
    cache.note_prefill(0, 2000, 50.0, whole=True)  # 0.025 ms a token from position 0
    cache.note_prefill(2000, 24, 48.0, whole=False)  # one size of chunk: its cost is fixed + 0.025 a token
    assert not cache.worth(2000, 24)
    assert cache.snapshot()["hit_fixed_ms"] == pytest.approx(48.0 - 24 * 0.025)
    cache.note_prefill(2000, 200, 400.0, whole=False)  # two sizes: 2 ms a token after cached ones
    snap = cache.snapshot()
    assert snap["hit_ms_per_token"] == pytest.approx(2.0) and snap["hit_fixed_ms"] == pytest.approx(0.0, abs=1e-9)
    cache.note_prefill(0, 10, 0.0, whole=True)  # nothing learnt from an unmeasured prefill
    assert cache.snapshot()["whole_ms_per_token"] == pytest.approx(0.025)
    cpu = PrefixCache(1 << 20)  # as on the CPU: every token costs about the same
    cpu.note_prefill(0, 1500, 1800.0, whole=True)
    cpu.note_prefill(1500, 24, 31.0, whole=False)
    assert cpu.worth(1500, 24) and not cpu.worth(1500, 1500)


def test_a_short_chunks_fixed_cost_does_not_stop_prompts_splitting() -> None:
    """A model's warm-up prefills a few tokens after its system turn: that chunk's cost
    is nearly all per call. Spread over its 3 tokens as a rate, it would price a
    40-token question at 530 ms against 384 for half of the whole 640-token prompt, and no
    prompt would be split; as a fixed part plus the per-token cost it is 84 ms."""
    cache = PrefixCache(1 << 20)
    cache.note_prefill(0, 1500, 1800.0, whole=True)  # 1.2 ms a token
    cache.note_prefill(600, 3, 40.0, whole=False)
    (_, whole_rate), (fixed, rate) = cache.estimates() or ((0.0, 0.0), (0.0, 0.0))
    assert whole_rate == pytest.approx(1.2) and rate == pytest.approx(1.2) and fixed == pytest.approx(36.4)
    assert cache.worth(600, 40)
    assert not cache.worth(600, 600)  # half the prompt after the prefix: a hit saves too little


def test_a_declined_split_is_made_now_and_then_so_a_hit_is_measured_again() -> None:
    """After 16 declines, then 32, 64, ... (at most 1024) while a hit stays dear; back to
    16 once the costs choose to split."""
    cache = PrefixCache(1 << 20)
    cache.note_prefill(0, 2000, 50.0, whole=True)
    cache.note_prefill(2000, 24, 48.0, whole=False)  # a hit as dear as the whole prompt
    assert (cache.recheck.every, cache.recheck.most) == (16, 1024)
    decisions = [cache.should_split(2000, 24) for _ in range(16 + 32 + 64)]
    assert [i + 1 for i, split in enumerate(decisions) if split] == [16, 16 + 32, 16 + 32 + 64]
    snap = cache.snapshot()
    assert snap["declined"] == 16 + 32 + 64 and snap["rechecked"] == 3
    for _ in range(1024 // 128):  # the wait doubles up to its bound, and stays there
        assert sum(cache.should_split(2000, 24) for _ in range(cache.recheck.wait)) == 1
    assert cache.recheck.wait == 1024
    for _ in range(3):  # hits measured cheap: the costs now choose to split
        cache.note_prefill(2000, 24, 1.0, whole=False)
    assert cache.should_split(2000, 24) and cache.recheck.wait == 16
    cheap = PrefixCache(1 << 20)  # where a hit pays, every prompt splits and none is declined
    cheap.note_prefill(0, 2000, 50.0, whole=True)
    cheap.note_prefill(2000, 24, 1.0, whole=False)
    assert all(cheap.should_split(2000, 24) for _ in range(40)) and cheap.snapshot()["declined"] == 0


@pytest.mark.slow
def test_prompts_split_again_once_a_slow_first_hit_is_measured_again(ckpt: TextCheckpoint) -> None:
    """A first hit measured slow (as a run that loaded its kernels is) turns splitting off;
    the declined splits made now and then measure hits again, and once those say a hit
    pays, prompts are split, and hit, every time."""
    from edge.text.kv.recheck import Recheck

    engine = TextEngine(
        ckpt, QAModelConfig(max_context_tokens=512, max_sequences=1, prefix_cache_mib=16, kv_offload="off")
    )
    batcher = engine.batcher
    cache = batcher.prefix_cache
    assert cache is not None
    cache.recheck = Recheck(every=2)
    doc = engine.prompter.parts("How much water per sachet?", LEAFLET)[1]
    cache.note_prefill(0, doc + 8, 100.0, whole=True)
    cache.note_prefill(doc, 8, 10_000.0, whole=False)  # a hit measured at 100 whole prompts
    splits = []
    for i in range(9):
        ids, prefix = engine.prompter.parts(f"Question {i}: how much water per sachet?", LEAFLET)
        seq = Sequence(i, ids, SamplingParams(max_new_tokens=1))
        seq.prefix = prefix
        batcher.single(seq)
        splits.append(seq.split is not None)
    snap = cache.snapshot()
    # Declined once, rechecked (the miss that keeps the document), declined 3 times (the
    # wait doubled to 4), rechecked (a hit): the median of the hits measured is now their
    # real cost, and every prompt splits.
    assert splits == [False, True, False, False, False, True, True, True, True]
    assert snap["rechecked"] == 2 and snap["hits"] == 4 and snap["misses"] == 1


def test_edgectl_status_says_how_many_prompts_were_left_whole() -> None:
    from edge.health.status import render_table

    cache = PrefixCache(1 << 20)
    kv = {"rows": 2, "rows_free": 2, "reserved_tokens": 0, "capacity_tokens": 512, "capacity_bytes": 1 << 20}

    def prefix_line() -> str:
        table = render_table({"memory": {"kv": {**kv, "prefix_cache": cache.snapshot()}}}, 0, [])
        return next(line for line in table.splitlines() if "prefix cache" in line)

    assert prefix_line().endswith("0 hits, 0 misses")
    cache.note_prefill(0, 2000, 50.0, whole=True)
    cache.note_prefill(2000, 24, 48.0, whole=False)
    for _ in range(3):
        cache.should_split(2000, 24)
    assert prefix_line().endswith("0 hits, 0 misses, 3 not split")
