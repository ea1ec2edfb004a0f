"""How many tokens a KV pool holds in each format, counted from the caches as the server
allocates them (codes, scales, zero points and the float ring; edge/text/kv/quant_cache.py),
on torch's meta device, so nothing is allocated to count."""

from __future__ import annotations

import torch

from edge.text.architecture import LlamaConfig
from edge.text.kv.float_cache import KVCache
from edge.text.kv.kv_quant import KVFormat
from edge.text.kv.quant_cache import QuantKVCache

META = torch.device("meta")


def cache_bytes(
    config: LlamaConfig, fmt: KVFormat, rows: int, row_tokens: int, dtype: torch.dtype, window_sized: bool = True
) -> int:
    """Bytes of a served cache of `rows` rows of `row_tokens` tokens in `fmt` (the float
    parts in `dtype`: the activations' type), the sliding layers' parts sized from their
    window unless `window_sized` is off (a quantized cache on our CUDA C kernels, which
    read every position: step_ops.circular_kv)."""
    if fmt.dtype == "float16":
        return KVCache(config, rows, row_tokens, dtype, META, window_sized).nbytes
    return QuantKVCache(config, rows, row_tokens, fmt, dtype, META, window_sized).nbytes


def longest_rows(
    config: LlamaConfig, fmt: KVFormat, rows: int, pool_bytes: int, dtype: torch.dtype, window_sized: bool = True
) -> int:
    """The longest rows (tokens each) of which `rows` fit in `pool_bytes` in `fmt`; 0 if
    not even one token does. window_sized: as cache_bytes'."""
    # Bytes never fall as rows grow (a sliding layer's buffer stops growing at its window
    # and room); rows end at the model's longest context.
    low, high = 0, 1
    while cache_bytes(config, fmt, rows, high, dtype, window_sized) <= pool_bytes:
        if high >= config.max_position:
            return config.max_position
        low, high = high, min(high * 2, config.max_position)
    while high - low > 1:  # low fits, high does not
        mid = (low + high) // 2
        if cache_bytes(config, fmt, rows, mid, dtype, window_sized) <= pool_bytes:
            low = mid
        else:
            high = mid
    return low
