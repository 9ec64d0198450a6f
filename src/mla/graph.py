"""mla.StepGraph: a model's decode step captured in CUDA graphs, one per batch-size bucket.

A decode step launches a few dozen kernels per layer, each of a few microseconds at small
batches: the host's launch time, not the GPU, sets the step time. A CUDA graph replays the
whole step (every layer, and whatever else the step runs) in one launch. A capture fixes
shapes, addresses and the kernels chosen, so the step is made to have all three fixed:

- shapes: a batch of B sequences runs in the smallest bucket (``buckets``) of at least B
  sequences, each of exactly s_q new tokens (1, or 1 + k drafts for MTP / speculative
  verify), and its block table is padded to ``max_blocks_per_seq`` columns. The table's width
  also fixes the decode kernel and its split count, which come from
  ``block_table.shape[1] * block_size`` (``mla.ops.decode``), not from the lengths.
- addresses: the step's inputs live in static buffers: hidden states [bucket * s_q, ...],
  positions, slot_mapping, block_table [bucket, max_blocks_per_seq], cache_seqlens,
  cu_seqlens_q/k. ``prepare`` still makes a fresh Batch every step; the graph copies its
  tensors into the buffers (device-to-device copies, no sync) and replays.
- no host reads: the strategy plan of the bucket's static batch is the pure decode plan
  (``strategy.decode_plan``: one absorbed group of all rows), which reads no host lengths, and
  on CUDA the ops read no values back (their value checks run on CPU tensors only). CUDA
  refuses a sync inside a capture, so a host read that slipped into the step fails the
  capture rather than replaying a stale value.

Padding rows (rows B .. bucket of the buffers) have slot -1, which ``rope_append`` skips, so
they write no cache row; length 0, for which decode gives out 0 and lse -inf (never NaN);
position 0 and hidden state 0. Their outputs are dropped.

Usage (the cache is shared by every layer of the step)::

    def step(x, batch):                   # any number of mla.MLA layers, and whatever else
        for block in blocks:
            x = block(x, batch)
        return x

    graph = mla.StepGraph(step, cache, max_blocks_per_seq=64, s_q=1)
    graph.capture()                       # optional: every bucket now, not at its first use
    batch = cache.prepare([(seq, 1) for seq in running])
    out = graph(x, batch) if graph.fits(batch) else step(x, batch)   # prefill / mixed: eager

Between calls the cache may change freely (prepare, fork, truncate, release): the graphs hold
no sequence, and each call checks its batch as a layer would (prepared by the graph's cache,
not stale) before anything is copied. A batch the graph cannot serve raises ValueError naming
the argument, before anything is written: not pure decode (a prefill, a mixed batch, other
than s_q tokens a sequence), more sequences than the largest bucket, a table wider than
``max_blocks_per_seq``. Refused at construction: Helix CP caches, and of the sparse-indexer
configs those whose path needs host lengths (``strategy.static_sparse_problem``: the k-pool
indexer). The others run every sequence on the sparse path, the indexer's
logits as wide as the table (max_blocks_per_seq * block_size keys a query). The graphs capture
the step's weights by address: load them before the first call, and build a new StepGraph after
loading again.

On CPU there are no CUDA graphs: a call runs the step eagerly on the same padded static
buffers, so the padding and copies are the same code as on the GPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from .batch import Batch
from .cache import PagedLatentCache
from .strategy import absorb_max_new, static_sparse_problem

__all__ = ["StepGraph", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class StepGraph:
    """A decode step on static buffers: one CUDA graph per bucket (module docstring)."""

    def __init__(self, step_fn: Callable, cache: PagedLatentCache, *, max_blocks_per_seq: int, s_q: int = 1,
                 buckets=DEFAULT_BUCKETS, dtype: torch.dtype = torch.bfloat16,
                 input_shape: tuple[int, ...] | None = None, pool=None, cuda_graphs: bool = True):
        """step_fn(x, batch): the step, x [T, *input_shape] (T = batch.num_tokens) -> a tensor, or
            a tuple of tensors, of T rows; it may read only the batch's tensors (and pass the batch
            to mla.MLA layers): in a bucket its host fields are placeholders (``mla.Batch``).
        cache: the PagedLatentCache every layer of the step reads and writes.
        max_blocks_per_seq: the block table's width, so the longest sequence is
            max_blocks_per_seq * block_size tokens.
        s_q: new tokens per sequence, 1 (decode) or 1 + k (MTP / speculative verify).
        buckets: batch sizes with a graph each; a batch runs in the smallest that holds it.
        dtype, input_shape: the dtype and per-token shape of x; default (hidden_size,), the
            hidden states; () with torch.int64 for token ids, where step_fn embeds them.
        pool: a CUDA graph memory pool (``torch.cuda.graph_pool_handle()``) to share with other
            StepGraphs whose calls never overlap, e.g. one per layer of a model whose other
            modules run between them (``mla.hf.patch``); default: a pool of this graph's own.
            A graph's output is copied out before the call returns, so a later replay of any
            graph in the pool may reuse every buffer it wrote.
        cuda_graphs: False runs every call eagerly on the same static buffers, as on CPU: the
            same kernels, split counts and padding as the replay, without a capture."""
        if not callable(step_fn):
            raise ValueError(f"step_fn: expected a callable step_fn(x, batch), got {type(step_fn).__name__}")
        if not isinstance(cache, PagedLatentCache):
            raise ValueError(f"cache: expected a mla.PagedLatentCache, got {type(cache).__name__}")
        if cache.cp_size > 1:
            raise ValueError(f"cache: Helix CP (cp_size {cache.cp_size}) is not captured; expected cp_size 1")
        problem = static_sparse_problem(cache.cfg, cache) if cache.cfg.has_indexer else None
        if problem:
            raise ValueError(f"cache: a CUDA graph cannot serve this sparse indexer: {problem}")
        for name, v in (("max_blocks_per_seq", max_blocks_per_seq), ("s_q", s_q)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if s_q > absorb_max_new(cache.cfg):
            raise ValueError(f"s_q: expected at most {absorb_max_new(cache.cfg)} (the absorbed path's limit), "
                             f"got {s_q}")
        try:
            sizes = sorted(set(buckets))
        except TypeError:
            sizes = None
        if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes):
            raise ValueError(f"buckets: expected positive ints, got {buckets!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected a torch.dtype, got {dtype!r}")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"cuda_graphs: expected True or False, got {cuda_graphs!r}")
        if pool is not None and not isinstance(pool, tuple):
            raise ValueError(f"pool: expected None or a torch.cuda.graph_pool_handle(), got {type(pool).__name__}")
        input_shape = (cache.cfg.hidden_size,) if input_shape is None else input_shape
        if not (isinstance(input_shape, tuple) and all(isinstance(d, int) and d > 0 for d in input_shape)):
            raise ValueError(f"input_shape: expected a tuple of positive ints, got {input_shape!r}")
        self.step_fn, self.cache, self.s_q = step_fn, cache, s_q
        self.buckets, self.max_blocks_per_seq = tuple(sizes), max_blocks_per_seq
        self.input_shape, self.dtype = input_shape, dtype
        n, dev = sizes[-1], cache.device
        self._x = torch.zeros(n * s_q, *input_shape, dtype=dtype, device=dev)
        self._positions = torch.zeros(n * s_q, dtype=torch.int64, device=dev)
        self._slots = torch.full((n * s_q,), -1, dtype=torch.int64, device=dev)
        self._table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._seqlens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev) * s_q   # every row has s_q tokens
        self._cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self._rows = 0          # sequences whose values the buffers hold; rows past them are padding
        self._batches = {b: self._static_batch(b) for b in sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}   # bucket -> (graph, its output)
        self._pool = pool       # one memory pool for every bucket's graph (they never run at once)
        self._replay = cuda_graphs and dev.type == "cuda"

    # ---- the public surface ---------------------------------------------------------------

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets captured so far (none on CPU or with ``cuda_graphs=False``)."""
        return tuple(sorted(self._graphs))

    def bucket(self, batch: Batch) -> int:
        """The bucket a batch runs in (ValueError, naming the argument, if the graph cannot serve it)."""
        problem = self._problem(batch)
        if problem:
            raise ValueError(problem)
        return next(b for b in self.buckets if b >= batch.num_seqs)

    def fits(self, batch: Batch) -> bool:
        """Whether a call can serve ``batch``: pure decode of s_q tokens a sequence, at most the
        largest bucket's sequences, its block table at most max_blocks_per_seq wide."""
        return self._problem(batch) is None

    @torch.no_grad()
    def __call__(self, hidden_states: torch.Tensor, batch: Batch):
        """hidden_states [T, *input_shape] (T = batch.num_tokens, rows in the batch's order; token
        ids where input_shape is ()) -> step_fn's output for the batch's T rows, as fresh tensors
        (no later call overwrites them)."""
        n = self.bucket(batch)
        batch.cache.check_batch(batch)     # prepared by the graph's cache, and not stale
        T = batch.num_tokens
        expected = (T, *self.input_shape)
        x = hidden_states
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"hidden_states: expected shape {expected}, got {got}")
        if x.dtype != self.dtype or x.device != self.cache.device:
            raise ValueError(f"hidden_states: expected {self.dtype} on {self.cache.device}, got {x.dtype} on "
                             f"{x.device}")
        if self._replay and n not in self._graphs:
            self._capture(n)
        self._fill(x, batch)
        return self._launch(n, T)

    @torch.no_grad()
    def run_packed(self, x: torch.Tensor, num_seqs: int):
        """A step whose metadata travels in x itself: x [num_seqs * s_q, *input_shape] (on the
        cache's device, or on the CPU: then copied in one asynchronous transfer, so pinned
        memory must stay as it is until the stream has run the copy) goes into the first rows of
        the input buffer, the rows after them are zero, and the bucket's graph replays (on CPU,
        or with ``cuda_graphs=False``, step_fn runs eagerly on the buffers). step_fn fills the
        static batch's tensors from its x (inside the graph) and must treat an all-zero row as
        padding: slot -1, length 0 (``mla.hf``'s decode step packs [token, position, slot + 1,
        length, block table] a row). Nothing is checked against the cache: the caller reserved
        the slots it packs. Returns step_fn's output for the num_seqs * s_q rows, as fresh
        tensors."""
        if not isinstance(num_seqs, int) or isinstance(num_seqs, bool) or not 1 <= num_seqs <= self.buckets[-1]:
            raise ValueError(f"num_seqs: expected 1 to {self.buckets[-1]} (the largest of buckets={self.buckets}), "
                             f"got {num_seqs!r}")
        T = num_seqs * self.s_q
        expected = (T, *self.input_shape)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != expected:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape {expected}, got {got}")
        if x.dtype != self.dtype or x.device not in (self.cache.device, torch.device("cpu")):
            raise ValueError(f"x: expected {self.dtype} on {self.cache.device} or the CPU, got {x.dtype} on {x.device}")
        n = next(b for b in self.buckets if b >= num_seqs)
        if self._replay and n not in self._graphs:
            self._capture(n)
        self._pad(num_seqs)
        self._x[:T].copy_(x, non_blocking=True)
        self._rows = num_seqs
        return self._launch(n, T)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket not captured yet (what a server does at start-up, so that no
        capture falls in its serving loop), the largest first: the smaller graphs then reuse
        its memory. Nothing on CPU or with ``cuda_graphs=False``."""
        if self._replay:
            for n in reversed(self.buckets):
                if n not in self._graphs:
                    self._capture(n)

    # ---- internals ------------------------------------------------------------------------

    def _launch(self, n: int, T: int):
        """Replay bucket n (or run it eagerly) on what the buffers hold; the first T rows out."""
        if not self._replay:
            return _rows(self._run(n), T, n * self.s_q)
        graph, out = self._graphs[n]
        graph.replay()
        return _rows(out, T, n * self.s_q)

    def _problem(self, batch) -> str | None:
        """Why a call cannot serve ``batch``, or None."""
        if not isinstance(batch, Batch) or batch.static:
            return f"batch: expected a mla.Batch from PagedLatentCache.prepare, got {type(batch).__name__}"
        if batch.cache is not self.cache:
            return "batch: prepared by another cache than the graph's"
        for seq, c, n in zip(batch.seq_ids, batch.num_cached, batch.num_new):
            if n != self.s_q or c == 0:
                return (f"batch: expected pure decode, every sequence with s_q={self.s_q} new tokens over a cached "
                        f"prefix; sequence {seq!r} brings {n} over {c} (run prefill and mixed batches eagerly: "
                        "step_fn(hidden_states, batch))")
        if not 1 <= batch.num_seqs <= self.buckets[-1]:
            return (f"batch: expected 1 to {self.buckets[-1]} sequences (the largest of buckets={self.buckets}), "
                    f"got {batch.num_seqs}")
        width = batch.block_table.shape[1]
        if width > self.max_blocks_per_seq:
            return (f"batch: its block_table is {width} blocks wide, more than max_blocks_per_seq="
                    f"{self.max_blocks_per_seq} (sequences of at most {self.max_blocks_per_seq * self.cache.block_size}"
                    " tokens)")
        return None

    def _static_batch(self, n: int) -> Batch:
        """Bucket n's Batch over the first n sequences' share of the buffers (``Batch.static``)."""
        T = n * self.s_q
        batch = Batch(seq_ids=(None,) * n, num_cached=(0,) * n, num_new=(self.s_q,) * n,
                      positions=self._positions[:T], slot_mapping=self._slots[:T], block_table=self._table[:n],
                      cache_seqlens=self._seqlens[:n], cu_seqlens_q=self._cu_q[: n + 1],
                      cu_seqlens_k=self._cu_k[: n + 1], block_size=self.cache.block_size, cache=self.cache,
                      static=True)
        self.cache.adopt(batch)
        return batch

    def _fill(self, x: torch.Tensor, batch: Batch) -> None:
        """Copy the batch into the buffers' first rows and make the rows after them padding."""
        B, T, width = batch.num_seqs, batch.num_tokens, batch.block_table.shape[1]
        self._pad(B)
        self._x[:T].copy_(x)
        self._positions[:T].copy_(batch.positions)
        self._slots[:T].copy_(batch.slot_mapping)
        self._table[:B, :width].copy_(batch.block_table)
        self._table[:B, width:].zero_()    # as prepare pads a table: never read (past every length)
        self._seqlens[:B].copy_(batch.cache_seqlens)
        self._cu_k[: B + 1].copy_(batch.cu_seqlens_k)
        self._cu_k[B + 1:].copy_(batch.cu_seqlens_k[B:].expand(self._cu_k.shape[0] - B - 1))   # 0 keys each
        self._rows = B

    def _pad(self, B: int) -> None:
        """Rows B.. to padding where an earlier call left values: slot -1 (no cache write),
        length 0 (out 0), position 0, hidden state 0."""
        old = self._rows
        if old > B:
            s = self.s_q
            self._x[B * s: old * s].zero_()
            self._positions[B * s: old * s].zero_()
            self._slots[B * s: old * s].fill_(-1)
            self._table[B:old].zero_()
            self._seqlens[B:old].zero_()
            self._cu_k[B + 1:].copy_(self._cu_k[B:B + 1].expand(self._cu_k.shape[0] - B - 1))
        self._rows = min(old, B)

    def _run(self, n: int):
        """step_fn on bucket n's static batch, its memo cleared: RoPE tables and the like derive
        from this call's buffers (under capture: inside the graph)."""
        batch = self._batches[n]
        batch.clear_memo()
        out = self.step_fn(self._x[: n * self.s_q], batch)
        batch.clear_memo()
        return out

    def _capture(self, n: int) -> None:
        """Warm up and capture bucket n. Every row is padding meanwhile, so neither the warm-up
        (a real run: Triton compiles, cuBLAS picks its algorithms, which a capture cannot do)
        nor the capture writes a cache row."""
        self._pad(0)
        with torch.cuda.device(self.cache.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                _rows(self._run(n), 0, n * self.s_q)    # checks the output's shape
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            rng = torch.cuda.default_generators[torch.cuda.current_device()]      # the cache's, here
            before = rng.get_state()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._run(n)
            except BaseException:
                _release_rng(rng, before)
                raise
        self._graphs[n] = (graph, out)


def _release_rng(rng: torch.Generator, state: torch.Tensor) -> None:
    """The device's default generator as it was before a capture that failed. A capture puts
    the generator in capture mode and only a capture that ends well takes it out, so after a
    failed one every random op on the device raises ("Offset increment outside graph capture");
    the generator gets a fresh state holding the seed and offset from before the capture."""
    fresh = torch.Generator(device=rng.device)
    fresh.set_state(state)
    rng.graphsafe_set_state(fresh)


def _rows(out, T: int, rows: int):
    """Copies of the first T rows of step_fn's output (a tensor, or a tuple of tensors, of
    ``rows`` rows): it may be a graph's static output, or a view of the static buffers."""
    many = isinstance(out, (tuple, list))
    parts = tuple(out) if many else (out,)
    for p in parts:
        if not isinstance(p, torch.Tensor) or p.dim() == 0 or p.shape[0] != rows:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"step_fn: expected a tensor, or a tuple of tensors, of {rows} rows (the bucket's "
                             f"tokens), got {got}")
    parts = tuple(p[:T].clone() for p in parts)
    return parts if many else parts[0]
