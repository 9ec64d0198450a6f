"""mla.hf_engine: transformers' own continuous batching on mla's paged latent cache.

``enable(handle)`` (beside ``mla.hf.patch``) makes a patched model servable by transformers'
engine: ``model.generate_batch(...)``, the manager of ``model.init_continuous_batching()`` (add
requests, stream, cancel) and ``transformers serve`` with continuous batching, which runs on it.

Who owns what (TensorRT-LLM's, vLLM's and SGLang's split):

- the engine schedules (FIFO, chunked prefill under ``max_batch_tokens``, decode) and owns the
  blocks: its ``BlockManager`` allocates them, hashes full blocks for prefix sharing
  (``allow_block_sharing``), forks them for ``num_return_sequences``;
- ``LatentCache``, the engine's cache here, stores one latent row a token and layer (576 values
  for DeepSeek-V3, in a ``PagedLatentCache``) instead of expanded K/V, and sizes the pool from
  that row: the same memory holds ``2 * H * (dn + dr + ...)`` / 576 times more tokens;
- each forward of the engine, the patch's pre-hook asks ``LatentCache.step`` for the step: the
  engine's block tables and write index (its slot mapping) become one ``mla.Batch``
  (``PagedLatentCache.batch_from_tables``) that every MLA layer reads; pure decode steps replay
  each layer's ``mla.StepGraph`` (CUDA), everything else runs eagerly.

Admission never evicts: a request is admitted only when the pool holds its whole life (prompt +
``max_new_tokens``) beside what the admitted requests may still grow to, so a running request
never starves and the engine's offloading never runs. A request that does not fit now waits; one
that can never fit (more blocks than the pool, or past ``max_position_embeddings``) is refused
with a ValueError when it is added.

Where the engine is not extended but configured: its own CUDA graphs, torch.compile paths, async
double-buffering, decode fast path (a flash-attention block table) and CPU offloading assume K/V
tensors and a step re-run from captured inputs; they are refused when asked for and off
otherwise (docs/serving.md says why, one by one).
"""
from __future__ import annotations

import copy
import dataclasses

import torch

from .cache import PagedLatentCache
from .graph import DEFAULT_BUCKETS, StepGraph
from .hf import PatchHandle, _Step

from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_manager import BlockManager, FullAttentionCacheAllocator
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager, ContinuousBatchProcessor)
from transformers.generation.continuous_batching.initialization import update_cb_config_after_cache_creation
from transformers.generation.continuous_batching.requests import get_device_and_memory_breakdown
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

__all__ = ["enable", "Engine", "LatentCache", "RequestRefused", "ATTENTION", "pool_blocks"]

# The attention implementation the engine's model runs under: a paged name, so the engine builds
# no attention mask (its size is max_batch_tokens x the whole pool), and one no module calls:
# the MLA modules are mla's stand-ins, which never reach transformers' attention functions.
ATTENTION = "paged|mla_latent"
DEFAULT_MAX_BATCH_TOKENS = 8192     # the engine's own default
# What the engine's own paths need that a latent cache does not provide (docs/serving.md)
_REFUSED = dict(use_cuda_graph="its graphs capture the model's forward, whose mla step is planned on the host",
                use_async_batching="it prepares step N+1 while step N runs; mla plans a step from the engine's "
                                   "calls for that step",
                varlen_compile_config="torch.compile of the whole forward is not supported with mla's stand-ins",
                decode_compile_config="torch.compile of the whole forward is not supported with mla's stand-ins",
                cpu_offload_space="admission reserves every request's blocks, so nothing is ever offloaded")


class RequestRefused(ValueError):
    """A request the latent cache can never hold (more blocks than the pool, or past the model's
    positions); raised before it is queued."""


def _never_called(*args, **kwargs):
    raise ValueError(f"attn_implementation: {ATTENTION!r} serves only mla's MLA stand-ins (mla.hf_engine); a "
                     "module of this model called it, which mla does not serve")


def enable(handle: PatchHandle, *, graphs: bool | None = None) -> "Engine":
    """Serve ``handle.model`` (patched by ``mla.hf.patch``) through transformers' continuous
    batching: after this, ``model.generate_batch``, ``model.init_continuous_batching`` and
    ``transformers serve`` run on a latent cache. ``graphs``: replay pure decode steps from
    CUDA graphs (one ``mla.StepGraph`` a layer); None: on a GPU, for families without a sparse
    indexer (as ``patch``). Returns the ``Engine``; ``engine.disable()`` (or ``handle.unpatch()``
    then a new patch) restores the model's own method.
    Raises ValueError for a model enabled already, or a family whose other layers keep state the
    engine cannot page (Kimi Linear's and GLM-5.3-Flash's linear attention)."""
    return Engine(handle, graphs=graphs)


class Engine:
    """The link between one patched model and the engine's managers it creates."""

    def __init__(self, handle: PatchHandle, *, graphs: bool | None):
        if not isinstance(handle, PatchHandle):
            raise ValueError(f"handle: expected the PatchHandle of mla.hf.patch, got {type(handle).__name__}")
        model = handle.model
        if handle.engine_step is not None or "init_continuous_batching" in vars(model):
            raise ValueError("handle: expected a patched model not enabled yet, got one enabled already")
        if handle.model_type in ("kimi_linear", "glm5_next_text", "glm5_next"):
            raise ValueError(f"handle: {handle.model_type!r} has linear-attention layers whose recurrent state the "
                             "engine's paged cache cannot hold; continuous batching serves all-MLA models")
        if graphs is not None and not isinstance(graphs, bool):
            raise ValueError(f"graphs: expected True, False or None, got {graphs!r}")
        self.handle, self.model = handle, model
        self.graphs = graphs
        AttentionInterface.register(ATTENTION, _never_called)   # a new name: nothing of transformers changes
        model.init_continuous_batching = self.init_continuous_batching   # this instance only
        handle.engine_step = self._plan

    def disable(self) -> None:
        """Give the model its own ``init_continuous_batching`` back."""
        vars(self.model).pop("init_continuous_batching", None)
        self.handle.engine_step = None

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None,
                                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                                 workload_hints=None) -> "LatentBatchingManager":
        """``model.init_continuous_batching`` for the patched model: the same arguments and result
        (a ``ContinuousBatchingManager``), on a latent cache. Raises ValueError for options the
        latent cache refuses (module docstring) and, given workload hints (``generate_batch``
        gives them), for a workload whose longest request can never fit."""
        if not self.handle._swapped:
            raise ValueError("model: its patch was undone (unpatch); patch it and enable it again")
        cached = getattr(self.model, "_cached_continuous_batching_manager", None)
        if isinstance(cached, LatentBatchingManager):
            cached.use_latent_attention()       # stop() put the model's own implementation back
            return cached
        gen = generation_config if generation_config is not None else self.model.generation_config
        if gen is None:
            raise ValueError("generation_config: expected one, or the model's, got None")
        if gen.eos_token_id is None:
            gen.eos_token_id = -1     # the engine's convention for "no EOS"
        cb = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
        manager = LatentBatchingManager(self, gen, _latent_config(cb), workload_hints)
        if workload_hints is not None:
            manager.check_fits(workload_hints.max_prompt_length, workload_hints.max_generated_length)
        return manager

    def _plan(self, kwargs) -> _Step:
        paged = kwargs.get("cache")
        if not isinstance(paged, LatentCache) or paged.engine is not self:
            raise ValueError(f"cache: expected the LatentCache of this model's engine, got {type(paged).__name__}")
        return paged.step(kwargs)


def _latent_config(cb: ContinuousBatchingConfig) -> ContinuousBatchingConfig:
    """A copy of the user's config with the engine's K/V-only paths off; ValueError where one was asked for."""
    if not isinstance(cb, ContinuousBatchingConfig):
        raise ValueError(f"continuous_batching_config: expected a ContinuousBatchingConfig, got {type(cb).__name__}")
    asked = dict(use_cuda_graph=cb.use_cuda_graph not in (None, False, (False, False)),
                 use_async_batching=bool(cb.use_async_batching), varlen_compile_config=cb.varlen_compile_config,
                 decode_compile_config=cb.decode_compile_config, cpu_offload_space=cb.cpu_offload_space)
    for name, value in asked.items():
        if value:
            raise ValueError(f"continuous_batching_config.{name}: not with mla's latent cache ({_REFUSED[name]}); "
                             f"expected it unset, got {getattr(cb, name)!r}")
    if cb.max_blocks_per_request:
        raise ValueError("continuous_batching_config.max_blocks_per_request: the decode fast path is flash "
                         "attention's block table for K/V; mla reads the engine's tables itself. Expected None or 0, "
                         f"got {cb.max_blocks_per_request}")
    if cb.default_compile_level:
        raise ValueError(f"continuous_batching_config.default_compile_level: expected 0 (no torch.compile of the "
                         f"forward with mla's stand-ins), got {cb.default_compile_level}")
    cb = copy.deepcopy(cb)
    cb.use_cuda_graph, cb.use_async_batching, cb.max_blocks_per_request = False, False, 0
    return cb


def pool_blocks(cfg, *, num_layers: int, dtype: torch.dtype, vocab_size: int, block_size: int,
                max_batch_tokens: int, max_workspace_tokens: int, available: int) -> int:
    """Blocks of latent rows that ``available`` bytes hold beside one step's activations.

    A token costs its latent row in every MLA layer (``kv_lora_rank + qk_rope_head_dim`` values,
    the indexer's key beside it for sparse families) and the engine's int64 read-index slot; a
    step's token costs its hidden states, q, expanded k/v and attention output and its float32
    logits; the expanded prefix rows of ``max_workspace_tokens`` are held at most once."""
    item = torch.empty((), dtype=dtype).element_size()
    row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item
    if cfg.has_indexer:
        row += cfg.index_row_dim * (item if dtype != torch.float8_e4m3fn else 2)
    per_token = num_layers * row + 8
    H, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    per_step_token = item * (4 * cfg.hidden_size + H * (2 * dn + dr + 2 * dv)) + 4 * vocab_size + 64
    workspace = max_workspace_tokens * H * (dn + dv) * item
    tokens = (available - workspace - max_batch_tokens * per_step_token) // per_token
    return max(tokens, 0) // block_size


class LatentBatchingManager(ContinuousBatchingManager):
    """transformers' manager over a ``LatentCache``: the same API (add_request(s), get_result,
    request_id_iter, register_result_handler, cancel_request, start, stop). Its cache is sized
    when it is created, so that a request that can never fit is refused when it is added."""

    def __init__(self, engine: Engine, generation_config, continuous_batching_config, workload_hints):
        self.engine = engine
        restore = self._latent_attention(engine.model)
        super().__init__(engine.model, generation_config, continuous_batching_config, workload_hints)
        self._original_attn_impl = restore          # stop() puts it back
        self.batch_processor = self._create_batch_processor()

    @staticmethod
    def _latent_attention(model) -> str | None:
        """Switch the model to ATTENTION; the implementation to restore, or None."""
        original = model.config._attn_implementation
        if original == ATTENTION:
            return None
        model.set_attn_implementation(ATTENTION)
        return original

    def use_latent_attention(self) -> None:
        """Before a kept manager (``persistent_manager``) serves again."""
        restore = self._latent_attention(self.model)
        if restore is not None:
            self._original_attn_impl = restore

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        processor = getattr(self, "batch_processor", None)
        if isinstance(processor, ContinuousBatchProcessor):
            processor.reset()
            return processor
        cb = self.continuous_batching_config
        cache = LatentCache(self.engine, self.model.config.get_text_config(), cb, self.model.device)
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(cb_config=cb, num_blocks=cache.num_blocks,
                                              max_batch_tokens=cache.max_batch_tokens,
                                              use_prefix_sharing=cache.use_prefix_sharing)
        scheduler = SCHEDULER_MAPPING.get(cb.scheduler_type)
        if scheduler is None:
            raise ValueError(f"continuous_batching_config.scheduler_type: expected one of {sorted(SCHEDULER_MAPPING)}, "
                             f"got {cb.scheduler_type!r}")
        scheduler = scheduler(cache=cache, safety_margin=cb.safety_margin, max_requests_per_batch=cb.max_requests_per_batch)
        cache.scheduler = scheduler
        return ContinuousBatchProcessor(
            cache=cache, config=self.model.config.get_text_config(), generation_config=self.generation_config,
            continuous_batching_config=cb, logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None, output_router=self.output_router,
            background_thread_status=self.background_thread_status, model_device=self.model.device,
            model_dtype=self.model.dtype, scheduler=scheduler, distributed_helper=self.distributed_helper)

    @property
    def cache(self) -> "LatentCache":
        return self.batch_processor.cache

    def check_fits(self, prompt_tokens: int, new_tokens: int | None) -> None:
        """ValueError if a request of prompt_tokens + new_tokens can never fit the cache."""
        self.cache.check_fits(prompt_tokens, new_tokens)

    def add_request(self, input_ids, request_id=None, max_new_tokens=None, *args, **kwargs):
        """As transformers' ``add_request``; raises ValueError (before queueing) for a request that
        can never fit: more blocks than the pool holds, or past max_position_embeddings."""
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if self.batch_processor is None:
            self.batch_processor = self._create_batch_processor()
        self.check_fits(len(input_ids), new)
        return super().add_request(input_ids, request_id, max_new_tokens, *args, **kwargs)

    def add_requests(self, inputs, max_new_tokens=None, *args, **kwargs):
        new = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        for ids in inputs:
            self.check_fits(len(ids), new)
        return super().add_requests(inputs, max_new_tokens, *args, **kwargs)


class LatentCache(PagedAttentionCache):
    """The engine's cache on latent rows. transformers' ``PagedAttentionCache.__init__``
    allocates K and V tensors of ``num_key_value_heads x head_dim`` a token and layer, so this
    class sets up the same bookkeeping (one full-attention group, the engine's ``BlockManager``
    and ``FullAttentionCacheAllocator``) over a ``PagedLatentCache`` instead, and overrides the
    methods that touch storage or the step: ``extend_read_and_write_indices`` (write index only:
    mla reads the rows through the block table), ``copy_cache`` (forks), and the admission
    control of ``allocate_blocks`` / ``compute_max_num_forks`` / ``fork_request`` / ``free_blocks``."""

    def __init__(self, engine: Engine, config, continuous_batching_config, device):
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
        self.latent = PagedLatentCache(cfg, num_layers=len(handle.layers), num_blocks=self.num_blocks,
                                       block_size=self.block_size, dtype=self.dtype, device=self.device)
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
        self.graphs = self._graphs(engine, handle)

    # ---- sizing -----------------------------------------------------------------------------

    def _size(self, handle: PatchHandle, cb) -> tuple[int, int]:
        """(max_batch_tokens, num_blocks): the given ones, or the pool that ``max_memory_percent``
        of the free memory holds (``pool_blocks``), as the engine sizes its own."""
        M = cb.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        if cb.num_blocks is not None:
            return M, cb.num_blocks
        _, total, reserved, allocated = get_device_and_memory_breakdown()
        available = int((total - max(allocated, reserved)) * (cb.max_memory_percent or 0.9))
        blocks = pool_blocks(handle.cfg, num_layers=len(handle.layers), dtype=handle.cache.dtype,
                             vocab_size=self.config.vocab_size, block_size=self.block_size, max_batch_tokens=M,
                             max_workspace_tokens=handle.layers[0].max_workspace_tokens, available=available)
        if blocks < 1:
            raise ValueError(f"continuous_batching_config: {available} bytes available hold no block of "
                             f"{self.block_size} latent rows beside max_batch_tokens={M}; lower max_batch_tokens or "
                             "raise max_memory_percent")
        return M, blocks

    def _graphs(self, engine: Engine, handle: PatchHandle) -> list[StepGraph] | None:
        on = engine.graphs
        if on is None:
            on = self.device.type == "cuda" and not handle.cfg.has_indexer
        if not on:
            return None
        width = min(self.num_blocks, -(-handle.cfg.max_position_embeddings // self.block_size))
        buckets = tuple(b for b in DEFAULT_BUCKETS + (256,) if b <= max(self.max_batch_tokens, 1))
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        return [StepGraph(layer, self.latent, max_blocks_per_seq=width, dtype=layer.dtype, buckets=buckets,
                          pool=pool) for layer in handle.layers]

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
        # rows written: the prompt and every generated token but the last; +1: the engine's
        # scheduler allocates up to one block ahead
        return -(-(prompt_tokens + max(new_tokens - 1, 0)) // self.block_size) + 1

    # ---- admission: a request is admitted with its whole life reserved ----------------------

    def _state(self, request_id: str):
        s = self.scheduler
        return s.active_requests.get(request_id) or s.waiting_requests.get(request_id)

    def _headroom(self) -> int:
        return self.get_num_free_blocks() - sum(self._reserved.values())

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        if request_id not in self._reserved:
            state = self._state(request_id)
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
        """The patch's step for the engine's forward ``kwargs``: the requests the engine prepared
        since the last forward, their block tables and the engine's write index as one Batch."""
        reqs, self._step = self._step, []
        T = kwargs["input_ids"].shape[-1]
        if sum(n for _, _, n in reqs) != T:
            raise ValueError(f"input_ids: {T} tokens, expected the {sum(n for _, _, n in reqs)} of the requests the "
                             "engine prepared for this step")
        tables = [self.group_cache_managers[0].block_table[r] for r, _, _ in reqs]
        write_index = kwargs["write_index"][0][:T]
        if self.device.type == "cuda":
            # the engine fills its index tensors on the default stream and runs the forward on
            # its compute stream: order the two before the layers read the write index
            torch.cuda.current_stream(self.device).wait_stream(torch.cuda.default_stream(self.device))
        batch = self.latent.batch_from_tables(reqs, tables, write_index)
        layers = self.engine.handle.layers
        runners = self.graphs if self.graphs is not None and self.graphs[0].fits(batch) else layers
        return _Step(batch, None, False, runners=runners)
