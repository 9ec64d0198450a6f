"""PagedLatentCache: one preallocated tensor of latent rows, block bookkeeping in plain Python.

Each token keeps one row [c_kv | rope(k_pe)] of kv_lora_rank + qk_rope_head_dim values
per layer (c_kv alone where qk_rope_head_dim is 0). Storage is
``kv [num_layers, num_blocks, block_size, r + dr]``; a sequence owns an ordered list of blocks.
With a sparse indexer (DeepSeek Sparse Attention) each token also keeps the indexer's row,
``index_kv [num_layers, num_blocks, block_size, cfg.index_row_dim]`` (its key, or the k-pool
indexer's [k | gate]), at the same block and offset as its latent row: the bookkeeping below
(fork, truncate, copy-on-write, release) moves block ids, so it carries both. Blocks carry
reference counts: ``fork`` shares every block of the source, and the first write into a shared,
partly filled block copies it first (copy-on-write), so full shared blocks are never copied.

Every public method checks all of its input before it changes anything: a call that
raises leaves the cache exactly as it was.
"""
from __future__ import annotations

import array
import math
import os
import weakref
from collections import deque
from typing import Hashable, Iterable

import torch

from .batch import Batch
from . import quant
from .config import MLAConfig
from .parallel import Parallel

__all__ = ["PagedLatentCache", "CacheFullError"]

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_SCALINGS = ("tensor", "tile")


class CacheFullError(ValueError):
    """The block pool cannot hold what a call asks for; nothing was changed."""


def _blocks_for(length: int, block_size: int) -> int:
    return -(-length // block_size)


def _owned(num_global_blocks: int, cp_size: int, cp_rank: int) -> int:
    """How many of global blocks 0 .. num_global_blocks - 1 fall on cp_rank (j % cp_size)."""
    return max(0, -(-(num_global_blocks - cp_rank) // cp_size))


class PagedLatentCache:
    def __init__(self, cfg: MLAConfig, num_layers: int = 1, num_blocks: int = 256, block_size: int = 64,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", parallel=None, *,
                 fp8_scaling: str = "tensor", kv_scale: float = 1.0, index_format: str | None = None):
        """dtype float8_e4m3fn stores FP8 rows: ``fp8_scaling="tensor"`` one scale ``kv_scale`` for
        the whole cache (576 bytes a token for DeepSeek-V3), ``"tile"`` FlashMLA's row with a
        float32 scale per 128 latent values and k_pe in bf16 (656 bytes); see mla.quant.
        index_format (a config with a sparse indexer): None keeps the indexer's keys in the cache's
        dtype (bfloat16 beside FP8 rows), as transformers does; "fp8" or "fp8_ue8m0" stores
        DeepSeek's FP8 indexer key (Hadamard-rotated, e4m3 with a float32 or power-of-two scale
        per 128 values: 132 bytes for index_head_dim 128; mla.quant), and the layer's indexer
        rotates and quantizes its queries to match, as DeepSeek's reference does. Its effect on
        the selection (CPU, random keys with 4 outlier channels, 64 heads x 128): 93-96% of the
        top-256 of 4096 keys and 98-99% of the top-2048 are those the bf16 keys select; at a
        boundary tie the attention differs, elsewhere not."""
        if not isinstance(cfg, MLAConfig):
            raise ValueError(f"cfg: expected an MLAConfig, got {type(cfg).__name__}")
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype: expected one of {CACHE_DTYPES}, got {dtype}")
        if fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8_scaling: expected one of {FP8_SCALINGS}, got {fp8_scaling!r}")
        if not (isinstance(kv_scale, (int, float)) and not isinstance(kv_scale, bool) and math.isfinite(kv_scale)
                and kv_scale > 0):
            raise ValueError(f"kv_scale: expected a finite float > 0, got {kv_scale!r}")
        if dtype == torch.float8_e4m3fn and fp8_scaling == "tile" and cfg.kv_lora_rank % quant.TILE:
            raise ValueError(f"fp8_scaling: 'tile' needs kv_lora_rank a multiple of {quant.TILE}, "
                             f"got {cfg.kv_lora_rank}")
        if index_format is not None:
            d = cfg.index_head_dim
            if index_format not in quant.INDEX_FORMATS:
                raise ValueError(f"index_format: expected None or one of {quant.INDEX_FORMATS}, got {index_format!r}")
            if not cfg.has_indexer:
                raise ValueError(f"index_format: {cfg.name!r} has no sparse indexer (index_topk), expected None")
            if cfg.index_kpool is not None:
                raise ValueError(f"index_format: {cfg.name!r} has the k-pool indexer, whose rows [k | gate] stay in a "
                                 "float dtype (FP8 index keys are DeepSeek's indexer's); expected None")
            if d & (d - 1):
                raise ValueError(f"index_format: the FP8 indexer keys are Hadamard-rotated, which needs "
                                 f"index_head_dim a power of two, got {d}")
        if parallel is not None and not isinstance(parallel, Parallel):
            raise ValueError(f"parallel: expected a mla.Parallel or None, got {type(parallel).__name__}")
        self.cfg, self.parallel = cfg, parallel
        # Helix CP: global block j of every sequence lives on CP rank j % cp_size
        self.cp_size = parallel.cp_size if parallel is not None else 1
        self.cp_rank = parallel.cp_rank if parallel is not None else 0
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.format = "plain" if dtype != torch.float8_e4m3fn else ("fp8" if fp8_scaling == "tensor" else "fp8_tile")
        self.kv_scale = float(kv_scale)
        width = quant.row_width(self.format, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        shape = (num_layers, num_blocks, block_size, width)
        self.kv = _allocate(shape, quant.storage_dtype(self.format, dtype), self.device)
        # the indexer's keys in the cache's dtype, or bfloat16 beside FP8 rows (transformers keeps
        # them in the model's dtype), or DeepSeek's FP8 key rows (index_format)
        self.index_format = index_format
        self.index_dtype = torch.uint8 if index_format else dtype if self.format == "plain" else torch.bfloat16
        self.index_kv = None if not cfg.has_indexer else _allocate(
            (num_layers, num_blocks, block_size,
             quant.index_width(cfg.index_head_dim) if index_format else cfg.index_row_dim),
            self.index_dtype, self.device)
        self.device = self.kv.device    # "cuda" -> "cuda:0": compared with the layer's device
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._blocks: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        # a Batch is stale once one of its sequences changed after its prepare (``check_batch``):
        # every change of a sequence takes a new version from one counter, which also counts all
        # changes (so that a batch checked once is not checked again until something changes)
        self._changes = 0
        self._versions: dict[Hashable, int] = {}
        # the batches prepare made (and only those): a Batch built by hand, or a copy of one,
        # could carry any slot_mapping and overwrite other sequences' rows
        self._prepared: weakref.WeakSet[Batch] = weakref.WeakSet()
        # an engine owns the blocks (``batch_from_tables``): prepare's bookkeeping would hand out
        # the same blocks again, so the cache serves one owner for its lifetime
        self._engine_owned = False

    # ---- queries ---------------------------------------------------------------------------
    def layer(self, layer_idx: int) -> torch.Tensor:
        """The cache of one layer: [num_blocks, block_size, row width] (r + dr for plain and fp8)."""
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx: expected 0..{self.num_layers - 1}, got {layer_idx}")
        return self.kv[layer_idx]

    def index_keys(self, layer_idx: int) -> torch.Tensor:
        """The indexer's keys of one layer: [num_blocks, block_size, index_head_dim] (uint8 rows of
        ``quant.index_width`` bytes with an FP8 ``index_format``; the k-pool indexer's rows
        [k | gate], 2 * index_head_dim), slot for slot beside
        ``layer(layer_idx)``'s latent rows (a config with a sparse indexer only)."""
        if self.index_kv is None:
            raise ValueError(f"layer_idx: the cache of {self.cfg.name!r} has no indexer keys (its config has no "
                             "index_topk)")
        self.layer(layer_idx)   # checks layer_idx
        return self.index_kv[layer_idx]

    def length(self, seq_id: Hashable) -> int:
        self._require(seq_id, "seq_id")
        return self._lengths[seq_id]

    def lengths(self, seq_ids: Iterable[Hashable]) -> list[int]:
        """``length`` of each sequence, in one call (a decode step's host work)."""
        seqs = list(seq_ids)
        try:
            return [self._lengths[s] for s in seqs]
        except (KeyError, TypeError):
            for s in seqs:
                self._require(s, "seq_ids")
            raise

    def local_tokens(self, num_tokens: int) -> int:
        """Of a sequence's first num_tokens tokens, how many this CP rank stores."""
        bs = self.block_size
        full, rem = divmod(num_tokens, bs)
        return _owned(full, self.cp_size, self.cp_rank) * bs + (rem if full % self.cp_size == self.cp_rank else 0)

    def _local_blocks(self, length: int) -> int:
        return _owned(_blocks_for(length, self.block_size), self.cp_size, self.cp_rank)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._lengths

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def max_table_width(self) -> int:
        """Blocks in the widest table a sequence can have: the pool's, or the model's positions'."""
        return min(self.num_blocks, -(-self.cfg.max_position_embeddings // self.block_size))

    @property
    def seq_ids(self) -> list[Hashable]:
        return list(self._lengths)

    def blocks(self, seq_id: Hashable) -> list[int]:
        """The block ids of a sequence, in token order (a copy)."""
        self._require(seq_id, "seq_id")
        return list(self._blocks[seq_id])

    # ---- changes ---------------------------------------------------------------------------
    def prepare(self, requests: Iterable[tuple[Hashable, int]]) -> Batch:
        """Reserve slots for one step: ``requests`` is [(seq_id, num_new_tokens), ...] in the
        order of the rows of hidden_states. Unknown seq_ids start empty. Returns the Batch."""
        if self._engine_owned:
            raise ValueError("requests: this cache's blocks are owned by an engine (batch_from_tables); expected a "
                             "cache whose blocks mla owns")
        reqs = self._check_requests(requests)
        self._reserve(reqs)
        return self._build_batch(reqs)

    def append_tokens(self, seq_ids: Iterable[Hashable]) -> list[int]:
        """Reserve one new token for each sequence, as ``prepare([(seq, 1), ...])`` does, and
        return each token's cache slot (block * block_size + offset) without building a Batch:
        for a caller that packs a pure decode step's metadata itself (``mla.hf``'s whole-model
        decode step), whose host work each step is then a few list operations a sequence.
        Every sequence must exist; without Helix CP only (a CP rank stores a token or not)."""
        if self.cp_size > 1:
            raise ValueError(f"seq_ids: append_tokens serves cp_size 1, the cache has cp_size {self.cp_size}; "
                             "use prepare")
        try:
            seqs = list(seq_ids)
        except TypeError:
            raise ValueError(f"seq_ids: expected an iterable of sequence ids, got {type(seq_ids).__name__}") from None
        slots = self._append_in_place(seqs)
        if slots is not None:
            return slots
        for s in seqs:
            self._require(s, "seq_ids")
        reqs = self._check_requests([(s, 1) for s in seqs])
        self._reserve(reqs)
        bs = self.block_size
        slots = []
        for s in seqs:
            p = self._lengths[s] - 1
            slots.append(self._blocks[s][p // bs] * bs + p % bs)
        return slots

    def _append_in_place(self, seqs: list) -> list[int] | None:
        """append_tokens' common step, 63 of every 64 decode steps at block size 64: each token
        lands in its sequence's partly filled last block, which no other sequence shares, so
        no block moves and nothing can fail. The slots, or None (changing nothing) where any
        sequence needs more (a new block, a copy on write, a check that may raise)."""
        lengths, blocks, refs, bs, limit = self._lengths, self._blocks, self._refs, self.block_size, \
            self.cfg.max_position_embeddings
        slots = []
        try:
            for s in seqs:
                n = lengths[s]
                block = blocks[s][n // bs]
                if n % bs == 0 or n >= limit or refs[block] != 1:
                    return None
                slots.append(block * bs + n % bs)
        except (KeyError, TypeError, IndexError):   # unknown or unhashable: the checks below say which
            return None
        if len(set(seqs)) != len(seqs):
            return None
        for s in seqs:
            lengths[s] += 1
            self._changed(s)
        return slots

    def _reserve(self, reqs: list[tuple[Hashable, int]]) -> None:
        """prepare's bookkeeping: blocks for the new tokens (copy-on-write of a shared partly
        filled last block), the new lengths; CacheFullError, changing nothing, when the pool
        cannot hold them."""
        need, copied = 0, {}   # copied: shared block -> copies counted so far (the last writer keeps it)
        for seq, n in reqs:
            old = self._lengths.get(seq, 0)
            blocks = self._blocks.get(seq, [])
            need += self._local_blocks(old + n) - len(blocks)
            if n > 0 and self._cow_needed(blocks, old, copied.get(blocks[-1] if blocks else None, 0)):
                copied[blocks[-1]] = copied.get(blocks[-1], 0) + 1
                need += 1
        short = self._cp_max(need - len(self._free))
        if short > 0:
            where = "" if self.cp_size == 1 else f" (on the CP rank that lacks the most: {short} short)"
            raise CacheFullError(f"requests: need {need} free blocks, the pool has {len(self._free)}{where} "
                                 f"(num_blocks={self.num_blocks}, block_size={self.block_size})")
        # Nothing can fail past this point.
        for seq, n in reqs:
            old = self._lengths.get(seq, 0)
            blocks = self._blocks.setdefault(seq, [])
            if n > 0 and self._cow_needed(blocks, old):
                blocks[-1] = self._copy_block(blocks[-1])
            while len(blocks) < self._local_blocks(old + n):
                blocks.append(self._alloc())
            self._lengths[seq] = old + n
            self._changed(seq)

    def batch_from_tables(self, requests: Iterable[tuple[Hashable, int, int]], block_tables, slot_mapping=None, *,
                          width: int | None = None) -> Batch:
        """A Batch over blocks that an engine owns: its KV-cache manager allocates the blocks,
        shares prefixes and forks, and the layers read the block tables and slot mapping it
        computed (TensorRT-LLM's, vLLM's and SGLang's split). ``prepare`` is the other owner, mla's
        own bookkeeping; one cache serves one of the two for its lifetime.

        requests: [(seq_id, num_cached, num_new), ...] in the order of the rows of hidden_states.
        block_tables: one list of block ids a sequence, in token order, covering at least its
            num_cached + num_new tokens (ints in 0 .. num_blocks - 1).
        slot_mapping: [T] int64 on the cache's device (T = sum of num_new), the flat slot
            (block * block_size + offset) of every new token, e.g. the engine's write index; None
            derives it from the tables. Its values are checked on CPU only (on CUDA a check would
            sync the stream every step).
        width: the batch's block-table columns; None: the step's longest table. The decode
            kernels choose their split count and compiled variant from the table's width, so an
            engine that gives every step one width (its decode graph's) meets a fixed set of
            variants, which it can compile before serving (``mla.hf.engine``).
        Raises ValueError before anything is written: a malformed request, a sequence twice, a
        length past max_position_embeddings, a table too short or with a block out of range, a
        width narrower than a table needs, a slot_mapping of the wrong shape, dtype, device or
        (CPU) value, Helix CP (not implemented here), or a cache that prepare already serves."""
        if self.cp_size > 1:
            raise ValueError(f"requests: engine-owned blocks under Helix CP (cp_size {self.cp_size}) are not "
                             "implemented; expected a cache with cp_size 1")
        if self._lengths:
            raise ValueError(f"requests: this cache holds {len(self._lengths)} sequences of its own (prepare); "
                             "expected a cache whose blocks an engine owns from the start")
        try:
            reqs = [(seq, c, n) for seq, c, n in requests]
            tables = [list(t) for t in block_tables]
        except (TypeError, ValueError):
            raise ValueError("requests, block_tables: expected (seq_id, num_cached, num_new) triples and one list of "
                             "block ids a sequence") from None
        if len(tables) != len(reqs):
            raise ValueError(f"block_tables: expected one table for each of the {len(reqs)} requests, got {len(tables)}")
        self._check_requests([(seq, n) for seq, _, n in reqs])
        bs, need = self.block_size, []
        for (seq, c, n), table in zip(reqs, tables):
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise ValueError(f"requests: expected num_cached an int >= 0 for {seq!r}, got {c!r}")
            if c + n > self.cfg.max_position_embeddings:
                raise ValueError(f"requests: sequence {seq!r} would reach {c + n} tokens, past "
                                 f"max_position_embeddings={self.cfg.max_position_embeddings}")
            need.append(_blocks_for(c + n, bs))
            if len(table) < need[-1]:
                raise ValueError(f"block_tables: sequence {seq!r} of {c + n} tokens needs {need[-1]} "
                                 f"blocks of {bs}, its table has {len(table)}")
        longest = max(need + [1])
        if width is None:
            width = longest
        elif not isinstance(width, int) or isinstance(width, bool) or width < longest:
            raise ValueError(f"width: expected an int >= {longest} (the step's longest table, in blocks), "
                             f"got {width!r}")
        # the blocks the step reads, as one host tensor checked at once (a step of 256 sequences
        # holds ~10k block ids: a Python check of each costs milliseconds a step); array's int64
        # conversion refuses what is not an int, ~5x faster than torch.tensor of a list
        flat, pad = array.array("q"), array.array("q", bytes(8 * longest))
        try:
            for t, k in zip(tables, need):
                flat.extend(t[:k])
                flat.extend(pad[:longest - k])
            table = torch.frombuffer(flat if flat else array.array("q", [0]), dtype=torch.int64).clone()
        except (TypeError, ValueError, OverflowError):
            table = None
        if table is None or not bool(((table >= 0) & (table < self.num_blocks)).all()):
            raise ValueError(f"block_tables: expected int block ids in 0..{self.num_blocks - 1}, got "
                             f"{[t[:k] for t, k in zip(tables, need)]}"[:300])
        table = table[:len(reqs) * longest].view(len(reqs), longest).to(torch.int32)
        if width > longest:    # one padding op on the checked table, not width - k zeros a row in Python
            table = torch.nn.functional.pad(table, (0, width - longest))
        T = sum(n for _, _, n in reqs)
        if slot_mapping is not None and (
                not isinstance(slot_mapping, torch.Tensor) or tuple(slot_mapping.shape) != (T,)
                or slot_mapping.dtype != torch.int64 or slot_mapping.device != self.device):
            got = (f"{tuple(slot_mapping.shape)} {slot_mapping.dtype} on {slot_mapping.device}"
                   if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__)
            raise ValueError(f"slot_mapping: expected [{T}] int64 on {self.device}, got {got}")
        positions = torch.frombuffer(array.array("q", [p for _, c, n in reqs for p in range(c, c + n)] or [0]),
                                     dtype=torch.int64)[:T].clone()
        if slot_mapping is None or self.device.type == "cpu":
            rows = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor([n for _, _, n in reqs],
                                                                                 dtype=torch.int64))
            derived = table[rows, positions // bs] * bs + positions % bs
            if slot_mapping is None:
                slot_mapping = derived.to(self.device, non_blocking=True)
            elif not torch.equal(slot_mapping, derived):
                raise ValueError("slot_mapping: expected each new token's slot in its sequence's table "
                                 "(block_tables[b][p // block_size] * block_size + p % block_size for position p)")
        self._engine_owned = True
        return self._table_batch(reqs, table, positions, slot_mapping)

    def fork(self, src_seq_id: Hashable, dst_seq_id: Hashable) -> None:
        """dst shares all of src's tokens; a partly filled last block is copied on its first write."""
        self._require(src_seq_id, "src_seq_id")
        try:
            exists = dst_seq_id in self._lengths
        except TypeError:
            raise ValueError(f"dst_seq_id: expected a hashable sequence id, got {type(dst_seq_id).__name__}") from None
        if exists:
            raise ValueError(f"dst_seq_id: expected a new sequence, {dst_seq_id!r} already exists")
        blocks = list(self._blocks[src_seq_id])
        for b in blocks:
            self._refs[b] += 1
        self._blocks[dst_seq_id] = blocks
        self._lengths[dst_seq_id] = self._lengths[src_seq_id]
        self._changed(src_seq_id)     # its blocks are shared now: an older batch would write them unshared
        self._changed(dst_seq_id)

    def truncate(self, seq_id: Hashable, new_length: int) -> None:
        """Keep the first new_length tokens (drop rejected draft tokens)."""
        self._require(seq_id, "seq_id")
        length = self._lengths[seq_id]
        if not isinstance(new_length, int) or isinstance(new_length, bool) or not 0 <= new_length <= length:
            raise ValueError(f"new_length: expected an int in 0..{length} for {seq_id!r}, got {new_length!r}")
        blocks = self._blocks[seq_id]
        keep = self._local_blocks(new_length)
        for b in blocks[keep:]:
            self._unref(b)
        del blocks[keep:]
        self._lengths[seq_id] = new_length
        self._changed(seq_id)

    def release(self, seq_id: Hashable) -> None:
        """Forget a sequence and return the blocks no other sequence shares."""
        self._require(seq_id, "seq_id")
        for b in self._blocks.pop(seq_id):
            self._unref(b)
        del self._lengths[seq_id]
        del self._versions[seq_id]
        self._changes += 1

    def check_batch(self, batch: Batch) -> None:
        """ValueError unless ``batch`` is one that this cache's ``prepare`` returned (not one built
        by hand nor a copy: its slots could be anyone's) and none of its sequences changed
        (prepare, fork, truncate, release) since it was prepared: a stale batch would write slots
        that now belong to other tokens or sequences. Every layer calls this; it costs a
        comparison until the cache changes. (The Batch's tensors are the caller's not to edit in
        place: checking their values would sync the stream on every layer.)"""
        try:
            # Under torch.compile this code runs only while tracing, and what it reads becomes the
            # compiled step's guards: the versions below do (a stale batch fails them, and the
            # retrace raises here), the WeakSet's members cannot (they come and go with the
            # batches), so the membership test is left to eager calls.
            ours = isinstance(batch, Batch) and batch.cache is self and (
                torch.compiler.is_compiling() or batch in self._prepared)
        except TypeError:   # unhashable: not a Batch of ours
            ours = False
        if not ours:
            raise ValueError(f"batch: expected a Batch that this cache prepared (from its prepare), "
                             f"got {'another' if isinstance(batch, Batch) else type(batch).__name__}"
                             f"{' Batch' if isinstance(batch, Batch) else ''}")
        if batch._checked == self._changes:
            return
        for seq, v in zip(batch.seq_ids, batch.versions):
            if self._versions.get(seq) != v:
                what = "was released" if seq not in self._versions else "changed"
                raise ValueError(f"batch: stale, sequence {seq!r} {what} after this batch was prepared "
                                 "(prepare, fork, truncate or release); prepare a new batch")
        batch._checked = self._changes

    def adopt(self, batch: Batch) -> None:
        """Let a static batch of this cache pass ``check_batch``: a ``mla.StepGraph``'s bucket
        (``batch.static``), whose buffers the graph refills before every replay from a batch this
        cache prepared, and checks that one first. It holds no sequence, so it is never stale."""
        if not (isinstance(batch, Batch) and batch.static and batch.cache is self and not batch.versions):
            raise ValueError(f"batch: expected a static Batch of this cache without versions, got "
                             f"{'a Batch' if isinstance(batch, Batch) else type(batch).__name__}")
        self._prepared.add(batch)

    # ---- internals -------------------------------------------------------------------------
    def _changed(self, seq_id: Hashable) -> None:
        self._changes += 1
        self._versions[seq_id] = self._changes

    def _cp_max(self, x: int) -> int:
        """The largest x over the CP ranks (x itself without CP): under Helix CP every rank owns
        other blocks of the same sequences, so each rank's pool may fill at another step, and all
        must refuse a step together (one small all-reduce a prepare; none without CP)."""
        if self.cp_size == 1 or self.parallel.cp_group is None:
            return x
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.parallel.cp_group)
        return int(t.item())

    def _require(self, seq_id, arg: str) -> None:
        try:
            known = seq_id in self._lengths
        except TypeError:
            raise ValueError(f"{arg}: expected a hashable sequence id, got {type(seq_id).__name__}") from None
        if not known:
            raise ValueError(f"{arg}: unknown sequence {seq_id!r}")

    def _check_requests(self, requests) -> list[tuple[Hashable, int]]:
        try:
            reqs = [(seq, n) for seq, n in requests]
        except (TypeError, ValueError):
            raise ValueError("requests: expected an iterable of (seq_id, num_new_tokens) pairs") from None
        seen = set()
        for seq, n in reqs:
            try:
                dup = seq in seen
            except TypeError:
                raise ValueError(f"requests: expected hashable seq_ids, got {type(seq).__name__}") from None
            if dup:
                raise ValueError(f"requests: sequence {seq!r} appears twice in one step")
            seen.add(seq)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"requests: expected num_new_tokens an int >= 0 for {seq!r}, got {n!r}")
            total = self._lengths.get(seq, 0) + n
            if total > self.cfg.max_position_embeddings:
                raise ValueError(f"requests: sequence {seq!r} would reach {total} tokens, past "
                                 f"max_position_embeddings={self.cfg.max_position_embeddings}")
        return reqs

    def _cow_needed(self, blocks: list[int], old_length: int, copies_before: int = 0) -> bool:
        """The next write lands in a partly filled block that is ours and still shared once
        ``copies_before`` earlier writers of this step have copied it away."""
        last = (old_length - 1) // self.block_size
        return (old_length % self.block_size != 0 and last % self.cp_size == self.cp_rank
                and self._refs[blocks[-1]] - copies_before > 1)

    def _alloc(self) -> int:
        b = self._free.popleft()
        self._refs[b] = 1
        return b

    def _unref(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            self._free.append(b)

    def _copy_block(self, b: int) -> int:
        new = self._alloc()
        self.kv[:, new].copy_(self.kv[:, b])
        if self.index_kv is not None:
            self.index_kv[:, new].copy_(self.index_kv[:, b])
        self._unref(b)
        return new

    def _build_batch(self, reqs: list[tuple[Hashable, int]]) -> Batch:
        bs = self.block_size
        positions, slots, cu_q, cu_k, seqlens = [], [], [0], [0], []
        max_blocks = max([len(self._blocks[s]) for s, _ in reqs] + [1])
        table = []
        for seq, n in reqs:
            blocks = self._blocks[seq]
            end = self._lengths[seq]
            for p in range(end - n, end):
                positions.append(p)
                j = p // bs   # global block; -1: another CP rank stores this token
                slots.append(blocks[j // self.cp_size] * bs + p % bs if j % self.cp_size == self.cp_rank else -1)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            seqlens.append(self.local_tokens(end))
            table.append(blocks + [0] * (max_blocks - len(blocks)))

        def ints(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        batch = Batch(
            seq_ids=tuple(s for s, _ in reqs),
            num_cached=tuple(self._lengths[s] - n for s, n in reqs),
            num_new=tuple(n for _, n in reqs),
            positions=ints(positions, torch.int64), slot_mapping=ints(slots, torch.int64),
            block_table=ints(table, torch.int32).view(len(reqs), max_blocks),
            cache_seqlens=ints(seqlens, torch.int32), cu_seqlens_q=ints(cu_q, torch.int32),
            cu_seqlens_k=ints(cu_k, torch.int32), block_size=bs, cache=self,
            versions=tuple(self._versions[s] for s, _ in reqs), _checked=self._changes)
        self._prepared.add(batch)
        return batch

    def _table_batch(self, reqs, table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> Batch:
        cu_q, cu_k = [0], [0]
        for _, c, n in reqs:
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + c + n)

        def ints(x, dtype):
            return torch.as_tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        batch = Batch(
            seq_ids=tuple(s for s, _, _ in reqs), num_cached=tuple(c for _, c, _ in reqs),
            num_new=tuple(n for _, _, n in reqs), positions=ints(positions, torch.int64), slot_mapping=slot_mapping,
            block_table=ints(table, torch.int32), cache_seqlens=ints([c + n for _, c, n in reqs], torch.int32),
            cu_seqlens_q=ints(cu_q, torch.int32), cu_seqlens_k=ints(cu_k, torch.int32), block_size=self.block_size,
            cache=self, _checked=self._changes)
        self._prepared.add(batch)
        return batch


# host bytes of a block's bookkeeping: an int in the free list (deque slot + int object) and a
# refcount slot, rounded up
_HOST_BYTES_PER_BLOCK = 48


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The zeroed storage, or a ValueError naming num_blocks and the bytes it needs when the
    machine cannot hold it: checked first against the device's free memory (CUDA) or the
    machine's physical memory (CPU, where an overcommitted allocation would pass and zeroing it
    could get the process killed), with the host bookkeeping (``_HOST_BYTES_PER_BLOCK`` a block,
    on any device, "meta" too) against physical memory; the allocator's own refusal is reported
    the same way."""
    need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    host = shape[1] * _HOST_BYTES_PER_BLOCK
    limit, ram = _memory_limit(device), _memory_limit(torch.device("cpu"))

    def refuse(why: str) -> ValueError:
        return ValueError(f"num_blocks: {shape[1]} blocks (x {shape[0]} layers x {shape[2]} tokens x {shape[3]} "
                          f"values) need {need} bytes ({need / 2**30:.1f} GiB) on {device} and {host} bytes of "
                          f"host bookkeeping, {why}")
    if limit is not None and need + (host if device.type == "cpu" else 0) > limit:
        raise refuse(f"more than the {limit} bytes {device} has ({'free' if device.type == 'cuda' else 'in all'})")
    if ram is not None and host > ram:
        raise refuse(f"more than the {ram} bytes of host memory")
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:   # torch.OutOfMemoryError is a RuntimeError
        raise refuse(f"and {device} could not allocate them ({str(e).splitlines()[0][:200]})") from None


def _memory_limit(device: torch.device) -> int | None:
    """Bytes one allocation may take on the device: free memory on CUDA, physical memory on CPU;
    None where unknown (e.g. "meta", which allocates nothing)."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None
