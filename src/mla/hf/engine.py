"""Engine: transformers' own continuous batching on mla's paged latent cache.

A patched model is servable by transformers' engine: ``model.generate_batch(...)``, the manager
of ``model.init_continuous_batching()`` (add requests, stream, cancel) and ``transformers serve``
with continuous batching, which runs on it. ``mla.hf.patch`` routes the model's
``init_continuous_batching`` here (``attach``): its first call makes the ``Engine`` with
``enable``'s defaults, and refuses by name a family the engine cannot serve, before any request
is queued. ``enable(handle, graphs=...)`` makes it explicitly; ``engine.disable()`` refuses the
engine's entry until ``enable`` is called again (``handle.unpatch()`` gives transformers' own back).

Who owns what (TensorRT-LLM's, vLLM's and SGLang's split):

- the engine schedules (FIFO, chunked prefill under ``max_batch_tokens``, decode) and owns the
  blocks: its ``BlockManager`` allocates them, hashes full blocks for prefix sharing
  (``allow_block_sharing``), forks them for ``num_return_sequences``;
- ``LatentCache``, the engine's cache here, stores one latent row a token and layer (576 values
  for DeepSeek-V3, in a ``PagedLatentCache``) instead of expanded K/V, and sizes the pool from
  that row: the same memory holds ``H * (dn + dr + dv) / (r + dr)`` times more tokens (71x for
  DeepSeek-V3's 128 heads);
- each forward of the engine, the patched forward asks ``LatentCache.step`` for the step. A pure
  decode step (one new token a request) that a bucket holds runs the whole model, embeddings to
  logits, on static buffers (``mla.hf.decode_step.DecodeStep``, as the patch's ``generate`` does): one
  CUDA graph replay a step, its rows packed on the host from the engine's block tables and
  copied in one transfer. Any other step (prefills, chunked prefills, mixed) runs the model
  eagerly: the engine's block tables and write index (its slot mapping) become one ``mla.Batch``
  (``PagedLatentCache.batch_from_tables``) that every MLA layer reads.
- before the loop serves, the manager's ``warmup`` captures the decode graphs and compiles the
  kernel variants the eager steps will meet (``LatentCache.warm_up``).

Admission never evicts: a request is admitted only when the pool holds its whole life (prompt +
``max_new_tokens``) beside what the admitted requests may still grow to, so a running request
never starves and the engine's offloading never runs. A request that does not fit now waits; one
that can never fit (more blocks than the pool, or past ``max_position_embeddings``) is refused
with ``RequestRefused`` (a ValueError) when it is added.

One patched model serves one thing at a time: while a manager runs, the patch's plain
``generate`` must not (both drive the same stand-ins).

On a GPU the engine's async double-buffering is on by default (``_latent_config``): step N+1
is prepared and launched before step N's tokens are read back, so the host's scheduling and
packing run under the GPU's step. Where the engine is not extended but configured: its own CUDA
graphs, torch.compile paths, decode fast path (a flash-attention block table) and CPU
offloading assume K/V tensors and a step re-run from captured inputs; they are refused when
asked for and off otherwise (docs/serving.md says why, one by one).
"""
from __future__ import annotations

import copy
import functools

import torch

from .patch import PatchHandle, _Step
from .engine_cache import LatentCache, RequestRefused, pool_blocks

from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager, ContinuousBatchProcessor)
from transformers.generation.continuous_batching.initialization import update_cb_config_after_cache_creation
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

__all__ = ["attach", "enable", "Engine", "LatentBatchingManager", "LatentCache", "RequestRefused", "ATTENTION",
           "pool_blocks"]

# The attention implementation the engine's model runs under: a paged name, so the engine builds
# no attention mask (its size is max_batch_tokens x the whole pool), and one no module calls:
# the MLA modules are mla's stand-ins, which never reach transformers' attention functions.
ATTENTION = "paged|mla_latent"
# What the engine's own paths need that a latent cache does not provide (docs/serving.md)
_REFUSED = dict(use_cuda_graph="its graphs capture the model's forward on the engine's padded inputs; mla's pure "
                                "decode steps replay a graph of their own (enable's graphs)",
                varlen_compile_config="torch.compile of the whole forward is not supported with mla's stand-ins",
                decode_compile_config="torch.compile of the whole forward is not supported with mla's stand-ins",
                cpu_offload_space="admission reserves every request's blocks, so nothing is ever offloaded")


def _never_called(*args, **kwargs):
    raise ValueError(f"attn_implementation: {ATTENTION!r} serves only mla's MLA stand-ins (mla.hf.engine); a "
                     "module of this model called it, which mla does not serve")


def attach(handle: PatchHandle) -> None:
    """Route the patched model's ``init_continuous_batching`` (which ``generate_batch`` and
    ``transformers serve`` call) to mla's engine, made at its first call with ``enable``'s
    defaults: the engine's own would build K/V caches that the stand-ins never fill."""
    handle.model.init_continuous_batching = functools.partial(_first_use, handle)


def _first_use(handle: PatchHandle, *args, **kwargs):
    engine = handle.engine if handle.engine is not None else Engine(handle, graphs=None)
    return engine.init_continuous_batching(*args, **kwargs)


def _disabled(*args, **kwargs):
    raise ValueError("model: its mla engine was disabled (engine.disable()); call mla.hf.enable(handle) to serve "
                     "generate_batch and init_continuous_batching on the latent cache again, or handle.unpatch() "
                     "for transformers' own attention and engine")


def enable(handle: PatchHandle, *, graphs: bool | None = None, prefill_tokens: int | None = None) -> "Engine":
    """Serve ``handle.model`` (patched by ``mla.hf.patch``) through transformers' continuous
    batching: after this, ``model.generate_batch``, ``model.init_continuous_batching`` and
    ``transformers serve`` run on a latent cache. ``graphs``: run pure decode steps as the whole
    model on static buffers, one CUDA graph a bucket of 1-256 requests (on CPU the same static
    step, eagerly); None: on a GPU, for families without a sparse indexer (as ``patch``); True
    for a sparse family too, refused (ValueError when the manager is made) for the k-pool
    indexer, which needs host lengths. ``prefill_tokens``: the prompt tokens a step takes beside
    the requests decoding (transformers' FIFO schedules those first, then prompts and chunks in
    the rest of ``max_batch_tokens``): a long prompt is chunked to this many tokens a step while
    others decode, so their steps stay short and regular; None: the rest of ``max_batch_tokens``
    (transformers' rule). A step with nothing decoding takes ``max_batch_tokens`` of prompts
    either way. Returns the ``Engine``; ``engine.disable()`` (or ``handle.unpatch()``
    then a new patch) restores the model's own method.
    Raises ValueError for a model enabled already, or a family whose other layers keep state the
    engine cannot page (Kimi Linear's and GLM-5.3-Flash's linear attention)."""
    return Engine(handle, graphs=graphs, prefill_tokens=prefill_tokens)


class Engine:
    """The link between one patched model and the engine's managers it creates."""

    def __init__(self, handle: PatchHandle, *, graphs: bool | None, prefill_tokens: int | None = None):
        if not isinstance(handle, PatchHandle):
            raise ValueError(f"handle: expected the PatchHandle of mla.hf.patch, got {type(handle).__name__}")
        model = handle.model
        if not handle._swapped:
            raise ValueError("handle: its patch was undone (unpatch); patch the model again")
        if handle.engine is not None:
            raise ValueError("handle: expected a patched model not enabled yet, got one enabled already "
                             "(engine.disable() first to enable it with other options)")
        if handle.model_type in ("kimi_linear", "glm5_next_text", "glm5_next"):
            raise ValueError(f"handle: {handle.model_type!r} has linear-attention layers whose recurrent state the "
                             "engine's paged cache cannot hold; continuous batching (generate_batch, "
                             "init_continuous_batching) serves all-MLA models; generate serves this one")
        if graphs is not None and not isinstance(graphs, bool):
            raise ValueError(f"graphs: expected True, False or None, got {graphs!r}")
        if prefill_tokens is not None and (isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int)
                                           or prefill_tokens < 1):
            raise ValueError(f"prefill_tokens: expected a positive int or None, got {prefill_tokens!r}")
        self.handle, self.model = handle, model
        self.graphs, self.prefill_tokens = graphs, prefill_tokens
        AttentionInterface.register(ATTENTION, _never_called)   # a new name: nothing of transformers changes
        model.init_continuous_batching = self.init_continuous_batching   # this instance only
        handle.engine_step, handle.engine = self._plan, self

    def disable(self) -> None:
        """Detach the engine: the model's ``init_continuous_batching`` (and ``generate_batch``)
        then refuse, naming ``mla.hf.enable``, until it is enabled again; transformers' own engine
        would run the stand-ins on K/V caches they never fill."""
        if self.handle.engine is not self:
            return
        if self.handle._swapped:
            self.model.init_continuous_batching = _disabled
        self.handle.engine_step = self.handle.engine = None

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
        manager = LatentBatchingManager(self, gen, _latent_config(cb, self.handle.device), workload_hints)
        if workload_hints is not None:
            manager.check_fits(workload_hints.max_prompt_length, workload_hints.max_generated_length)
        return manager

    def _plan(self, kwargs) -> _Step:
        paged = kwargs.get("cache")
        if not isinstance(paged, LatentCache) or paged.engine is not self:
            raise ValueError(f"cache: expected the LatentCache of this model's engine, got {type(paged).__name__}")
        return paged.step(kwargs)


def _latent_config(cb: ContinuousBatchingConfig, device: torch.device) -> ContinuousBatchingConfig:
    """A copy of the user's config with the engine's K/V-only paths off (ValueError where one was
    asked for) and its async double-buffering on where the model is on a GPU, unless asked off:
    the engine prepares and launches step N+1 before it reads step N's tokens back (their ids
    reach step N+1 on the device), so the GPU runs steps back to back. mla's steps build their
    rows on the host from the engine's tables at the forward (known when the step is scheduled)
    and copy them on the compute stream; a request that finishes at N's update has had its token
    of N+1 computed and dropped, its rows written before any later step reuses its blocks (one
    stream orders them), and admission reserves that one extra row (``_lifetime_blocks``)."""
    if not isinstance(cb, ContinuousBatchingConfig):
        raise ValueError(f"continuous_batching_config: expected a ContinuousBatchingConfig, got {type(cb).__name__}")
    asked = dict(use_cuda_graph=cb.use_cuda_graph not in (None, False, (False, False)),
                 varlen_compile_config=cb.varlen_compile_config,
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
    on_gpu = torch.device(device).type == "cuda"
    if cb.use_async_batching and not on_gpu:
        raise ValueError(f"continuous_batching_config.use_async_batching: its double-buffering runs on CUDA streams; "
                         f"the model is on {device}. Expected None or False, got {cb.use_async_batching!r}")
    cb = copy.deepcopy(cb)
    cb.use_cuda_graph, cb.max_blocks_per_request = False, 0
    cb.use_async_batching = on_gpu if cb.use_async_batching is None else bool(cb.use_async_batching)
    return cb


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
        self.warmup_s = 0.0                         # the last warm-up's seconds

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
        self.warmed_up = False                 # a new cache: its graphs are not captured yet
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(cb_config=cb, num_blocks=cache.num_blocks,
                                              max_batch_tokens=cache.max_batch_tokens,
                                              use_prefix_sharing=cache.use_prefix_sharing)
        scheduler = SCHEDULER_MAPPING.get(cb.scheduler_type)
        if scheduler is None:
            raise ValueError(f"continuous_batching_config.scheduler_type: expected one of {sorted(SCHEDULER_MAPPING)}, "
                             f"got {cb.scheduler_type!r}")
        if self.engine.prefill_tokens is not None:
            scheduler = _decode_regular(scheduler, self.engine.prefill_tokens)
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

    def warmup(self) -> None:
        """transformers' warm-up before serving (``generate_batch`` calls it; ``start`` does
        where it was not called): capture every decode bucket's graph and compile the kernel
        variants of the eager steps, on the calling thread (``LatentCache.warm_up``), so that
        neither stalls the engine's loop (a first-time compile takes seconds a variant).
        ValueError where graphs were asked for and the model's decode step cannot be captured;
        the model's attention implementation is then restored."""
        if self.batch_processor is None:
            self.batch_processor = self._create_batch_processor()
        try:
            self.warmup_s = self.cache.warm_up()
        except ValueError:       # graphs asked for and not capturable: the model as it was
            if self._original_attn_impl is not None:
                self.model.set_attn_implementation(self._original_attn_impl)
            raise
        self.warmed_up = True

    def start(self) -> None:
        """Warm up where ``warmup`` was not called, then start the engine's loop."""
        if self.batch_processor is None:           # a manager stopped before, started again
            self.batch_processor = self._create_batch_processor()
        if not self.warmed_up and not self.is_running():
            self.warmup()
        super().start()

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

    def load(self) -> dict[str, int]:
        """The engine's load now, for a server's metrics and logs (``mla.hf.metrics``): requests
        ``running`` (admitted: they hold blocks) and ``waiting`` (queued, or not admitted yet),
        the cache's ``blocks_used`` and ``num_blocks``. Read from any thread while the loop runs,
        without a lock: each count is one len(), the four may straddle one step."""
        processor = self.batch_processor
        queued = self.input_queue.qsize()
        if processor is None:
            return dict(running=0, waiting=queued, blocks_used=0, num_blocks=0)
        scheduler, cache = processor.scheduler, processor.cache
        return dict(running=len(scheduler.active_requests), waiting=len(scheduler.waiting_requests) + queued,
                    blocks_used=cache.num_blocks - cache.get_num_free_blocks(), num_blocks=cache.num_blocks)



def _decode_regular(scheduler: type, prefill_tokens: int) -> type:
    """The engine's scheduler class with a step's token budget cut, while requests decode, to
    their one token each plus ``prefill_tokens`` (``enable``'s)."""

    class DecodeRegular(scheduler):
        def schedule_batch(self, token_budget: int, cache_budget: int):
            decoding = sum(s.status == RequestStatus.DECODING for s in self.active_requests.values())
            if decoding:
                token_budget = min(token_budget, decoding + prefill_tokens)
            return super().schedule_batch(token_budget, cache_budget)

    DecodeRegular.__name__ = f"DecodeRegular{scheduler.__name__}"
    return DecodeRegular
