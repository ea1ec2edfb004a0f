"""The float KV cache: keys and values in the activations' type, allocated once."""

from __future__ import annotations

import torch

from edge.text.architecture import LlamaConfig


class KVCache:
    """Keys and values for `batch` sequences of up to `max_len` tokens, allocated once."""

    def __init__(self, config: LlamaConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def save_row(self, row: int, length: int) -> dict[str, torch.Tensor]:
        """Copies of a row's keys and values for its first `length` tokens."""
        return {"k": self.k[:, row, :, :length].clone(), "v": self.v[:, row, :, :length].clone()}

    def load_row(self, row: int, length: int, saved: dict[str, torch.Tensor]) -> None:
        """Put a row saved at `length` tokens into row `row`."""
        self.k[:, row, :, :length] = saved["k"].to(self.k.device, non_blocking=True)
        self.v[:, row, :, :length] = saved["v"].to(self.v.device, non_blocking=True)

    def rows(self, first: int, count: int) -> KVCache:
        """A cache over sequences first..first+count-1 that shares this one's memory."""
        view = KVCache.__new__(KVCache)
        view.k = self.k[:, first : first + count]
        view.v = self.v[:, first : first + count]
        view.max_len = self.max_len
        return view
