"""LatentCache: transformers' continuous-batching cache on latent rows (``mla.hf.engine``'s).

The engine's ``PagedAttentionCache`` stores K and V of ``num_key_value_heads x head_dim`` a
token and layer; ``LatentCache`` keeps its block bookkeeping (the engine's ``BlockManager`` and
a ``FullAttentionCacheAllocator``: allocation, prefix hashes, forks) over one
``mla.PagedLatentCache`` of latent rows, turns each step the engine prepares into the patch's
step (``step``: a pure decode step runs the whole model on static buffers, ``mla.hf.decode_step``;
any other step is one ``mla.Batch`` of the engine's tables for the eager forward), and admits
a request only with its whole life reserved, so that no running request ever starves and the
engine never evicts one (``allocate_blocks``).
"""
from __future__ import annotations

import functools
import time
import warnings

import torch

from .. import quant
from ..cache import PagedLatentCache
from ..graph import DEFAULT_BUCKETS
from ..strategy import absorb_max_new
from .decode_step import DecodeStep
from .patch import PatchHandle, _graph_problem, _Step

from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_manager import BlockManager, FullAttentionCacheAllocator
from transformers.generation.continuous_batching.requests import get_device_and_memory_breakdown
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["LatentCache", "RequestRefused", "pool_blocks", "DEFAULT_MAX_BATCH_TOKENS"]

DEFAULT_MAX_BATCH_TOKENS = 8192     # the engine's own default
MAX_DECODE_ROWS = 256               # the largest decode graph's rows, and the widest step warm_up compiles


class RequestRefused(ValueError):
    """A request the latent cache can never hold (more blocks than the pool, or past the model's
    positions); raised before it is queued."""


def pool_blocks(cfg, *, num_layers: int, dtype: torch.dtype, vocab_size: int, block_size: int,
                max_batch_tokens: int, max_workspace_tokens: int, available: int, cache_format: str = "plain",
                index_format: str | None = None) -> int:
    """Blocks of latent rows that ``available`` bytes hold beside one step's activations.

    dtype: the layers' (activations, and a plain cache's rows); cache_format and index_format:
    the cache's (``PagedLatentCache.format``, ``.index_format``). A token costs its latent row in
    every MLA layer (``quant.row_width`` of the format: 576 values for DeepSeek-V3, 656 bytes as
    FP8 tile rows; the indexer's key beside it for sparse families) and the engine's int64
    read-index slot; a step's token costs its hidden states, q, expanded k/v and attention output
    and its float32 logits; the expanded prefix rows of ``max_workspace_tokens`` are held at most
    once."""
    item = torch.empty((), dtype=dtype).element_size()
    row = quant.row_width(cache_format, cfg.kv_lora_rank, cfg.qk_rope_head_dim) * (item if cache_format == "plain"
                                                                                   else 1)
    if cfg.has_indexer:   # FP8 index keys, or keys in the layers' dtype (bfloat16 beside FP8 rows)
        row += quant.index_width(cfg.index_head_dim) if index_format else \
            cfg.index_row_dim * (item if cache_format == "plain" else 2)
    per_token = num_layers * row + 8
    H, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    per_step_token = item * (4 * cfg.hidden_size + H * (2 * dn + dr + 2 * dv)) + 4 * vocab_size + 64
    workspace = max_workspace_tokens * H * (dn + dv) * item
    tokens = (available - workspace - max_batch_tokens * per_step_token) // per_token
    return max(tokens, 0) // block_size


class LatentCache(PagedAttentionCache):
    """The engine's cache on latent rows. transformers' ``PagedAttentionCache.__init__``
    allocates K and V tensors of ``num_key_value_heads x head_dim`` a token and layer, so this
    class sets up the same bookkeeping (one full-attention group, the engine's ``BlockManager``
    and ``FullAttentionCacheAllocator``) over a ``PagedLatentCache`` instead, and overrides the
    methods that touch storage or the step: ``extend_read_and_write_indices`` (write index only:
    mla reads the rows through the block table), ``copy_cache`` (forks), and the admission
    control of ``allocate_blocks`` / ``compute_max_num_forks`` / ``fork_request`` / ``free_blocks``."""

    def __init__(self, engine, config, continuous_batching_config, device):
        # engine: the model's mla.hf.engine.Engine (its handle and graphs option)
        handle = engine.handle
        cb, cfg = continuous_batching_config, handle.cfg
        if cb.block_size < self._min_block_size:
            raise ValueError(f"continuous_batching_config.block_size: expected >= {self._min_block_size}, "
                             f"got {cb.block_size}")
        self.engine, self.config, self.device = engine, config, torch.device(device)
        self.dtype = handle.cache.dtype
        self.block_size, self.num_groups = cb.block_size, 1
        layers = list(range(config.num_hidden_layers))
        self.sliding_windows = dict.fromkeys(layers, 1)
        self.layer_index_to_group_indices = {i: (0, i) for i in layers}
        self.max_batch_tokens, self.num_blocks = self._size(handle, cb)
        self.num_pages = self.num_blocks * self.block_size
        # the patch's cache's row format: FP8 rows, their scaling and the indexer's keys alike
        own = handle.cache
        self.latent = PagedLatentCache(cfg, num_layers=len(handle.layers), num_blocks=self.num_blocks,
                                       block_size=self.block_size, dtype=self.dtype, device=self.device,
                                       fp8_scaling="tile" if own.format == "fp8_tile" else "tensor",
                                       kv_scale=own.kv_scale, index_format=own.index_format)
        # the engine's view of its storage (it only counts bytes with it: offloading is off): one
        # "head" of one latent row a token and layer, no values
        self.num_key_value_heads, self.head_dim = 1, self.latent.kv.shape[-1]
        self.key_cache, self.value_cache = list(self.latent.kv), []
        self.read_trash_index = self.num_pages
        self.sentinel_index = self.num_pages + 1
        self.write_trash_index = self.num_pages + self.block_size
        self.allow_block_sharing = self.use_prefix_sharing = cb.allow_block_sharing
        self.group_cache_managers = [FullAttentionCacheAllocator(0, self.block_size,
                                                                 allow_block_sharing=cb.allow_block_sharing)]
        self.num_full_attention_groups, self.num_sliding_attention_groups = 1, 0
        self.max_sliding_window_blocks_per_request = 0
        self.max_blocks_per_request = 0
        self._block_manager = BlockManager(self.num_blocks, self.block_size, tp_on=False)
        self._total_prefix_length = 0
        self._block_table_key = None
        self.scheduler = None                  # set by the manager: admission reads the requests' budgets
        self._reserved: dict[str, int] = {}    # admitted request -> blocks it may still allocate
        self._step: list[tuple[str, int, int]] = []   # (request, cached, new) of the step being prepared
        # on a GPU every step's block table has the widest table's width, so that the decode
        # kernels of the eager steps come in one variant a decode-row count, compiled by
        # ``warm_up`` before serving
        self._step_width = self.latent.max_table_width if self.device.type == "cuda" else None
        self.decode = self._whole_step(engine, handle)   # pure decode steps; None: every step eager

    # ---- sizing -----------------------------------------------------------------------------

    def _size(self, handle: PatchHandle, cb) -> tuple[int, int]:
        """(max_batch_tokens, num_blocks): the given ones, or the pool that ``max_memory_percent``
        of the free memory holds (``pool_blocks``), as the engine sizes its own."""
        M = cb.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        if cb.num_blocks is not None:
            return M, cb.num_blocks
        _, total, reserved, allocated = get_device_and_memory_breakdown()
        available = int((total - max(allocated, reserved)) * (cb.max_memory_percent or 0.9))
        blocks = pool_blocks(handle.cfg, num_layers=len(handle.layers), dtype=handle.dtype,
                             vocab_size=self.config.vocab_size, block_size=self.block_size, max_batch_tokens=M,
                             max_workspace_tokens=handle.layers[0].max_workspace_tokens, available=available,
                             cache_format=handle.cache.format, index_format=handle.cache.index_format)
        if blocks < 1:
            raise ValueError(f"continuous_batching_config: {available} bytes available hold no block of "
                             f"{self.block_size} latent rows beside max_batch_tokens={M}; lower max_batch_tokens or "
                             "raise max_memory_percent")
        return M, blocks

    def _whole_step(self, engine, handle: PatchHandle) -> DecodeStep | None:
        """The model's whole decode step on static buffers (``mla.hf.decode_step``), one CUDA graph a
        bucket of 1-256 sequences, where ``engine.graphs`` asks for it (None: on a GPU, for
        families without a sparse indexer); ValueError where it was asked for and cannot serve."""
        on = engine.graphs
        if on is None:
            on = self.device.type == "cuda" and not handle.cfg.has_indexer
        if not on:
            return None
        problem = _graph_problem(handle._family_cfg, self.latent)
        if problem:
            raise ValueError(f"graphs: {handle.model_type!r}: {problem} (enable with graphs=False)")
        buckets = tuple(b for b in DEFAULT_BUCKETS + (MAX_DECODE_ROWS,) if b <= max(self.max_batch_tokens, 1))
        return DecodeStep(handle, self.latent.max_table_width, cuda_graphs=True, cache=self.latent, buckets=buckets)

    def check_fits(self, prompt_tokens: int, new_tokens: int | None) -> None:
        """ValueError if a request of prompt_tokens + new_tokens can never be admitted."""
        new = new_tokens or 0
        limit = self.engine.handle.cfg.max_position_embeddings
        if prompt_tokens + new > limit:
            raise RequestRefused(f"input_ids: {prompt_tokens} prompt tokens + max_new_tokens={new} exceed the model's "
                             f"max_position_embeddings={limit}")
        if self._lifetime_blocks(prompt_tokens, new) > self.num_blocks:
            raise RequestRefused(f"input_ids: {prompt_tokens} prompt tokens + max_new_tokens={new} need "
                             f"{self._lifetime_blocks(prompt_tokens, new)} blocks of {self.block_size} tokens, more "
                             f"than the cache's {self.num_blocks}; the request can never fit")

    def _lifetime_blocks(self, prompt_tokens: int, new_tokens: int) -> int:
        # rows written: the prompt and every generated token (the last one's row too: async
        # batching schedules the step after a request's last token before it reads that token);
        # +1: the engine's scheduler allocates up to one block ahead
        return -(-(prompt_tokens + new_tokens) // self.block_size) + 1

    # ---- admission: a request is admitted with its whole life reserved ----------------------

    def _state(self, request_id: str):
        s = self.scheduler
        return s.active_requests.get(request_id) or s.waiting_requests.get(request_id)

    def _headroom(self) -> int:
        return self.get_num_free_blocks() - sum(self._reserved.values())

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        if request_id not in self._reserved:
            state = self._state(request_id)
            if state is None:
                raise ValueError(f"request_id: {request_id!r} is not a request of the engine's scheduler")
            need = self._lifetime_blocks(len(state.initial_tokens), state.max_new_tokens or 0) - allocated_blocks
            if max(need, n_blocks) > self._headroom():
                return None                    # waits: the admitted requests keep their blocks
            self._reserved[request_id] = max(need, n_blocks)
        got = super().allocate_blocks(n_blocks, request_id, allocated_blocks)
        if got is not None:
            self._reserved[request_id] = max(self._reserved[request_id] - got, 0)
        return got

    def free_blocks(self, request_id: str) -> None:
        self._reserved.pop(request_id, None)
        super().free_blocks(request_id)
        if self.decode is not None:
            self.decode.forget(request_id)     # its packed row names the request's blocks

    def compute_max_num_forks(self, source_request_id: str) -> int:
        per_child = self._fork_cost(source_request_id)
        return self._headroom() // per_child if per_child else 2 ** 31

    def _fork_cost(self, source_request_id: str) -> int:
        """Blocks a child of the source takes: copies of its unshareable blocks and its own future growth."""
        blocks = self.group_cache_managers[0].block_table[source_request_id]
        shared = 0
        if self.group_cache_managers[0].uses_block_sharing:
            for b in blocks:
                if not self._block_manager._id_to_block[b].is_complete:
                    break
                shared += 1
        return len(blocks) - shared + self._reserved.get(source_request_id, 0)

    def fork_request(self, source_request_id: str, destination_request_ids: list[str]):
        grow = self._reserved.get(source_request_id, 0)
        out = super().fork_request(source_request_id, destination_request_ids)
        for child in destination_request_ids:
            self._reserved[child] = grow
        return out

    def copy_cache(self, list_source_blocks: list[int], list_forked_blocks: list[int]) -> None:
        src = torch.tensor(list_source_blocks, device=self.device)
        dst = torch.tensor(list_forked_blocks, device=self.device)
        self.latent.kv[:, dst] = self.latent.kv[:, src]
        if self.latent.index_kv is not None:
            self.latent.index_kv[:, dst] = self.latent.index_kv[:, src]

    def free_all_requests(self) -> None:
        super().free_all_requests()
        self._reserved.clear()
        self._step = []
        if self.decode is not None:
            self.decode.invalidate()

    # ---- the step ----------------------------------------------------------------------------

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        """The engine's call for each request of the step, in order: its write index (the slots
        of the new tokens) as the engine computes it, and the request noted for ``step``. No
        read index: mla reads the latent rows through the block table."""
        write_index[0].extend(self.group_cache_managers[0].get_write_indices(request_id, past_length, query_length))
        self._step.append((request_id, past_length, query_length))

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        raise ValueError("max_blocks_per_request: the decode fast path is off with mla's latent cache")

    def update(self, *args, **kwargs):
        raise ValueError("the latent cache holds no K/V: only mla's MLA stand-ins run on it")

    def step(self, kwargs) -> _Step:
        """The patch's step for the engine's forward ``kwargs``, from the requests the engine
        prepared since the last forward: a pure decode step that a bucket holds runs the whole
        model on static buffers (``_Step.run``: one CUDA graph replay, its rows packed from the
        block tables on the host); any other step is one Batch of their block tables and the
        engine's write index, which every MLA layer of the eager forward reads."""
        reqs, self._step = self._step, []
        T = kwargs["input_ids"].shape[-1]
        if sum(n for _, _, n in reqs) != T:
            raise ValueError(f"input_ids: {T} tokens, expected the {sum(n for _, _, n in reqs)} of the requests the "
                             "engine prepared for this step")
        block_table = self.group_cache_managers[0].block_table
        tables = [block_table[r] for r, _, _ in reqs]
        if self.device.type == "cuda":
            # the engine fills its index tensors on the default stream and runs the forward on
            # its compute stream: order the two before the step reads them
            torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))
        decode = self.decode
        if decode is not None and T <= decode.max_rows:
            limit = decode.width * self.block_size
            if all(n == 1 and 0 < c < limit for _, c, n in reqs):
                run = functools.partial(self._run_decode, kwargs["input_ids"], kwargs.get("logits_to_keep"), reqs,
                                        tables)
                return _Step(None, None, requests=reqs, run=run)
        batch = self.latent.batch_from_tables(reqs, tables, kwargs["write_index"][0][:T], width=self._step_width)
        return _Step(batch, None, requests=reqs)

    def warm_up(self, max_rows: int = MAX_DECODE_ROWS) -> float:
        """Capture every decode bucket's graph, then compile the eager steps' kernels, before
        serving. On a GPU a Triton or Gluon kernel compiles at the first call of each variant
        (seconds each), and a variant follows the step's shape: the count of decode rows (the
        split plan's lane block, tiles, split count; the fixed table width the rest), the new
        tokens of an absorbed chunk (its rows), the count of prompts and of chunks in a pass.
        So the MLA layers run eager steps that sweep each: 1..max_rows decode rows (at most
        max_batch_tokens) beside a prompt and a chunk; one chunk of every length the absorbed
        path serves (up to max_batch_tokens); 1..64 prompts; 1..16 expanded chunks; on zero
        inputs over the first blocks of the empty pool (scratch rows: no request holds them,
        nothing reads them back). One layer of each kind serves: the kernels are the layers',
        the rest of the model is torch's.

        A decode step the model cannot capture (a module that syncs or copies from pageable
        host memory, as transformers' float32 grouped-MoE path on the H200) leaves decode steps
        eager, with a warning where graphs were on by default; ValueError where they were asked
        for. Returns the seconds it took; on CPU, or while a request holds blocks, it only
        captures (nothing compiles on CPU; a running engine has warmed up already)."""
        t0 = time.perf_counter()
        if self.decode is not None:
            try:
                self.decode.graph.capture()
            except RuntimeError as e:
                self.decode = None
                if self.engine.graphs:
                    raise ValueError(f"graphs: the model's decode step cannot be captured as a CUDA graph ({e}); "
                                     "enable with graphs=None or False") from e
                warnings.warn(f"mla.hf.engine: the model's decode step cannot be captured as a CUDA graph ({e}); "
                              "its decode steps run eagerly", RuntimeWarning, stacklevel=3)
        if self.device.type == "cuda":
            self._sweep(max_rows)
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _sweep(self, max_rows: int) -> None:
        """warm_up's eager steps (on any device: CPU runs them in the tests); nothing while a
        request holds blocks, or in a pool or model too small for the scratch rows."""
        handle, bs = self.engine.handle, self.block_size
        cfg = handle.cfg
        if self.get_num_free_blocks() < self.num_blocks or self.num_blocks < 3 or cfg.max_position_embeddings < 3 * bs:
            return
        # the layers up to the first that reads another's index rows (it needs its source's run)
        shared = cfg.index_shared_layers
        layers = handle.layers[:1 + (min(shared) if shared else 0)]
        # every row's table: the first blocks of the pool, as many as the longest row needs
        limit = min(self.num_blocks * bs, cfg.max_position_embeddings)
        absorb = min(absorb_max_new(cfg), self.max_batch_tokens, limit - 2 * bs)   # absorbed chunks' lengths
        table = list(range(min(self.num_blocks, -(-(2 * bs + absorb + 3) // bs))))

        def step(rows):
            rows = [(c, n) for c, n in rows if c + n <= min(len(table) * bs, cfg.max_position_embeddings)]
            reqs = [(("warm", i), c, n) for i, (c, n) in enumerate(rows)]
            batch = self.latent.batch_from_tables(reqs, [table] * len(reqs), width=self._step_width)
            # the layers' dtype: an FP8 cache's rows are float8, the activations are not
            x = torch.zeros(batch.num_tokens, cfg.hidden_size, dtype=handle.dtype, device=self.device)
            for layer in layers:
                layer(x, batch)
        decode, chunk, prompt = (bs, 1), (bs, bs + 3), (0, bs + 5)
        with torch.no_grad():
            for b in range(1, min(max_rows, self.max_batch_tokens) + 1):
                step([decode] * b + [chunk, prompt])
            # chunks' prefixes of both alignments: a kernel's integer arguments specialise on it
            for n in range(2, absorb + 1):
                step([decode, (bs + n % 2, n)])
            for k in range(1, 65):
                step([decode] + [(0, bs + k % 3)] * k)
            for k in range(1, 17):
                step([decode] + [(bs + k % 5, absorb + 1 + k % 3)] * k)

    def _run_decode(self, input_ids, logits_to_keep, reqs, tables):
        """The whole decode step: the model's output with the logits the engine samples from,
        [1, rows, V] (the rows of ``logits_to_keep`` where the engine passed it)."""
        logits = self.decode.from_tables(input_ids, reqs, tables)
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits.index_select(0, logits_to_keep)
        elif logits_to_keep:
            logits = logits[-logits_to_keep:]
        return CausalLMOutputWithPast(logits=logits.unsqueeze(0))
