"""Per-step metadata: built once by ``PagedLatentCache.prepare`` and read by every layer.

Sequences keep the caller's order; token rows of ``hidden_states`` follow it. Sequence b
brings ``num_new[b]`` tokens on top of ``num_cached[b]`` already stored; its new tokens
take positions num_cached[b] .. num_cached[b] + num_new[b] - 1.

A *static* batch (``static=True``) is a ``mla.StepGraph``'s bucket: its tensors are the graph's
preallocated buffers, refilled before every replay from a batch ``prepare`` made, so its host
fields describe the bucket, not a step: ``seq_ids`` are placeholders (None), ``num_new`` is
s_q for every row (padding rows included) and ``num_cached`` is unknown (zeros; read
``cache_seqlens``). The strategy plan of a static batch is the pure decode plan
(``plan.decode_plan``), which reads none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

__all__ = ["Batch"]


@dataclass(eq=False)
class Batch:
    seq_ids: tuple[Hashable, ...]
    num_cached: tuple[int, ...]          # c: tokens in the cache before this step
    num_new: tuple[int, ...]             # n: tokens this step brings
    positions: torch.Tensor              # [T] int64, position of every new token
    slot_mapping: torch.Tensor           # [T] int64, flat cache slot (block * block_size + offset);
                                         # -1 where another CP rank stores the token
    block_table: torch.Tensor            # [B, max_blocks] int32 of this rank's blocks, padded with 0
    cache_seqlens: torch.Tensor          # [B] int32, c + n (tokens this CP rank stores, under CP)
    cu_seqlens_q: torch.Tensor           # [B + 1] int32, offsets of the new tokens
    cu_seqlens_k: torch.Tensor           # [B + 1] int32, offsets of all tokens (c + n)
    block_size: int
    cache: Any = field(repr=False)       # the PagedLatentCache the step writes to
    versions: tuple[int, ...] = field(default=(), repr=False)   # each sequence's version at prepare
    static: bool = False                 # a StepGraph's bucket (module docstring)
    _checked: int = field(default=-1, repr=False)   # the cache's change count it was last checked at
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def token_offsets(self) -> list[int]:
        """Host copy of cu_seqlens_q."""
        out = [0]
        for n in self.num_new:
            out.append(out[-1] + n)
        return out

    def memo(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Plan once, run many: derived per-step data (RoPE angles, the strategy plan) is
        built by the first layer that asks and reused by the others."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def clear_memo(self) -> None:
        """Drop the derived per-step data: a static batch's buffers hold another step's values
        at every replay, so what was derived from them must be derived again."""
        self._memo.clear()

    def remember(self, key: Hashable, value: Any) -> None:
        """Store per-step data a later layer reads (a sparse layer's top-k for GLM-5's shared
        layers), replacing what the key held."""
        self._memo[key] = value

    def recall(self, key: Hashable) -> Any:
        """What ``remember`` stored under key, or None."""
        return self._memo.get(key)
