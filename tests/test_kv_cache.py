"""The KV cache manager: the one owner of the text branch's KV rows."""

from __future__ import annotations

import pytest

from edge.text.kv.kv_cache import KVCacheManager


def test_rows_are_granted_lowest_first_and_none_when_full() -> None:
    kv = KVCacheManager(rows=3, row_tokens=100, bytes_per_token=10)
    a, b, c = (kv.allocate_slots(name, 40) for name in "abc")
    assert a is not None and b is not None and c is not None
    assert [a.row, b.row, c.row] == [0, 1, 2]
    assert kv.allocate_slots("d", 1) is None and kv.refusals == 1  # no row free
    kv.free(b)
    d = kv.allocate_slots("d", 100)
    assert d is not None and d.row == 1  # the freed row, lowest first
    snap = kv.snapshot()
    assert snap["rows_free"] == 0 and snap["reserved_tokens"] == 180 and snap["reserved_bytes"] == 1800
    assert snap["peak_rows"] == 3 and snap["capacity_bytes"] == 3000


def test_a_sequence_longer_than_a_row_is_refused_and_nothing_changes() -> None:
    kv = KVCacheManager(rows=2, row_tokens=64, bytes_per_token=1)
    assert kv.allocate_slots("long", 65) is None
    assert kv.rows_free == 2 and kv.reserved_tokens() == 0
    assert not kv.fits_ever(65) and kv.fits_ever(64)


def test_freeing_twice_is_an_error() -> None:
    kv = KVCacheManager(rows=1, row_tokens=8, bytes_per_token=1)
    slot = kv.allocate_slots("a", 4)
    assert slot is not None
    kv.free(slot)
    with pytest.raises(KeyError):
        kv.free(slot)
