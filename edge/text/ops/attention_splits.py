"""How decode attention splits a sequence's cache into chunks (flash-decoding): the rule
the Triton and the CUDA attention kernels share."""

from __future__ import annotations

ATTN_BLOCK_T = 32  # cache positions per attention tile (Triton's); a chunk is a multiple
ATTN_GROUP_ROWS = 16  # query rows per KV head the fused attention takes at most
MAX_ATTN_SPLITS = 64


def attn_splits(kv_len: int, n_kv: int, sms: int, max_splits: int = MAX_ATTN_SPLITS) -> tuple[int, int]:
    """(splits, chunk): enough chunks of the cache to give every SM work, each at least
    one tile long; a power of two so the merge kernel can reduce over them. Chosen as
    for one sequence whatever the batch, so that a sequence's attention is summed in the
    same order alone or batched (batch invariance)."""
    want = max(1, (2 * sms) // max(1, n_kv))
    splits = 1
    while splits < min(want, max_splits) and kv_len // (splits * 2) >= ATTN_BLOCK_T:
        splits *= 2
    per_split = -(-kv_len // splits)
    chunk = -(-per_split // ATTN_BLOCK_T) * ATTN_BLOCK_T
    return splits, chunk
