"""mla.hf: run a transformers MLA model's attention through ``mla.MLA`` on one paged latent cache.

``patch(model)`` finds every MLA attention module of a transformers model of an exact family
(``MLAConfig.from_hf`` reads its config; a refused family raises there), builds an ``mla.MLA``
with the module's weights for each, and swaps the module for a thin stand-in that runs it on
one shared ``PagedLatentCache``. The rest of the model (embeddings, norms, MoE, lm_head, the
linear-attention layers of Kimi Linear and GLM-5.3-Flash) stays transformers' own.

How one forward of the patched model runs:

- A forward pre-hook on the decoder stack (``model.base_model``) reads what every layer shares:
  the 2-D ``attention_mask`` ``[B, past + S]``, ``position_ids`` and the transformers ``Cache``.
  Row b of the batch is one mla sequence; its new tokens are the non-pad columns of the last S
  (left padding, as ``generate`` pads). The hook checks that the mask's count of past tokens
  equals the sequence's cache length and that ``position_ids`` (where given) are the positions
  mla derives from the cache, then calls ``cache.prepare`` once: plan once, run many.
- Each stand-in gathers the rows of the real tokens from ``hidden_states [B, S, D]``, runs its
  ``mla.MLA`` on them and scatters the output back; pad rows get zeros.
- transformers' ``Cache`` keeps only the lengths: each stand-in appends a ``[B, 1, S, 1]`` uint8
  stub to its layer, so ``get_seq_length`` (which ``generate`` and the models ask for slicing
  inputs, positions and masks) counts tokens as if the module had stored its K/V, at one byte
  per token and layer instead of the latents.
- A forward whose cache says 0 past tokens (a fresh ``generate``, a call without a cache) is a
  new request: the sequences of the previous one are released first. A cache cropped by
  ``generate`` (stop-check rollback, assisted decoding) truncates the sequences to match, and
  beam search's reorder forks them (copy-on-write) through ``model._reorder_cache``.

Static (compileable) caches and 4-D masks are refused: their masks do not say which tokens are
padding, and mla holds the K/V those caches would preallocate.

``graphs`` (on by default on a GPU) runs each patched layer's decode steps (one new token a row,
up to 128 rows) in CUDA graphs, one ``mla.StepGraph`` a layer, all in one memory pool: eagerly a
layer's step is about a millisecond of host time (its Python, each op's dispatch, a dozen kernel
launches), so a patched model decodes far slower than transformers' compiled static-cache
``generate``; replayed, the host cost of a layer is the copy of the step's batch into the
graph's buffers.
Prompts, mixed and larger batches stay eager. Each batch size's graphs are captured at its
first decode step. Sparse-indexer families get them when asked (``patch(graphs=True)``), every
step on the sparse path; refused where layers share a top-k (GLM-5) or the step needs host
lengths (the k-pool indexer).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from torch import nn

from .cache import PagedLatentCache
from .config import MLAConfig
from .graph import StepGraph
from .layer import MLA
from .strategy import static_sparse_problem

__all__ = ["patch", "patch_config", "PatchHandle"]


def _is_mla_attention(module: nn.Module) -> bool:
    # Every MLA family in transformers names the latent projections as DeepSeek does.
    return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj")


def patch(model: nn.Module, cache: PagedLatentCache | None = None, *, dtype: torch.dtype | None = None,
          backend: str = "auto", num_blocks: int = 256, block_size: int = 64,
          max_workspace_tokens: int | None = None, graphs: bool | None = None) -> "PatchHandle":
    """Swap every MLA attention module of ``model`` (a transformers model of an exact MLA family,
    e.g. ``DeepseekV3ForCausalLM``) for ``mla.MLA`` on one shared ``PagedLatentCache``.

    cache: a ``PagedLatentCache`` to use, built for ``patch_config(model)`` (= ``handle.cfg``) with
        ``num_layers >= M`` (the model's M MLA modules); None creates one of ``num_blocks``
        blocks of ``block_size`` tokens.
    dtype: the layers' and the created cache's dtype; None takes the modules' parameter dtype.
    backend: as ``mla.MLA``'s ("auto" | "torch" | "triton").
    graphs: replay each layer's decode steps from CUDA graphs (module docstring); on CPU the
        same static buffers run eagerly. None (the default): on where the cache is on a GPU and
        the family has no sparse indexer (2.2-2.5x eager's tokens a second on the H200, 4
        DeepSeek-V3 layers, batch 1-32); True asks for them anywhere, for a sparse family too
        (every decode step on the sparse path, the logits as wide as the table: the pool or the
        model's positions), refused where a layer shares another's top-k or the graph would need
        host lengths (``strategy.static_sparse_problem``).

    Returns a ``PatchHandle``: ``handle.cache``, ``handle.layers``, ``handle.graphs``,
    ``handle.release()`` (return the current request's blocks now) and ``handle.unpatch()``
    (restore the original modules).
    Raises NotImplementedError (naming the model_type) for a family ``from_hf`` refuses, and
    ValueError for a model without MLA attention modules, an unusable cache, or ``graphs`` where
    a graph cannot serve the family's sparse indexer.
    """
    return PatchHandle(model, cache, dtype=dtype, backend=backend, num_blocks=num_blocks,
                       block_size=block_size, max_workspace_tokens=max_workspace_tokens, graphs=graphs)


@dataclasses.dataclass
class _Step:
    """What every stand-in of one forward shares."""
    batch: Any                  # mla.Batch, or None when no row brings a real token
    index: torch.Tensor | None  # [T] flat rows (b * S + s) of the real tokens; None: all B * S rows
    graphed: bool = False       # every layer's StepGraph serves the batch (patch(graphs=True))
    runners: Any = None         # what runs each MLA layer (by index) instead, for an engine's step (mla.hf_engine)


class _MLAAttention(nn.Module):
    """Stands in for one transformers MLA attention module: same call, ``(output, None)`` back."""

    def __init__(self, handle: "PatchHandle", layer: MLA, hf_layer_idx: int, graph: StepGraph | None):
        super().__init__()
        self.mla = layer
        self.layer_idx = hf_layer_idx          # the module's index in transformers' Cache
        self._handle = [handle]                # a list, so nn.Module does not register it
        self.graph = graph                     # the layer's decode-step graphs (patch(graphs=True)) or None

    def forward(self, hidden_states: torch.Tensor, *args, past_key_values=None, **kwargs):
        step = self._handle[0]._current_step()
        B, S, D = hidden_states.shape
        if past_key_values is not None:
            # Lengths only: one uint8 per token keeps get_seq_length right without storing K/V.
            stub = torch.empty((B, 1, S, 1), dtype=torch.uint8, device=hidden_states.device)
            past_key_values.update(stub, stub, self.layer_idx)
        out = hidden_states.new_zeros(B * S, D)
        if step.batch is not None:
            x = hidden_states.reshape(B * S, D)
            x = x if step.index is None else x[step.index]
            x = x.to(self.mla.dtype).contiguous()
            run = step.runners[self.mla.layer_idx] if step.runners is not None else \
                self.graph if step.graphed else self.mla
            y = run(x, step.batch).to(hidden_states.dtype)
            if step.index is None:
                out = y
            else:
                out[step.index] = y
        if self._handle[0].returns_topk:
            return out.view(B, S, D), None, None
        return out.view(B, S, D), None


def _configs(model) -> tuple[MLAConfig, str]:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model: expected a transformers model with a .config, got {type(model).__name__}")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    # from_hf refuses what mla does not implement, by name
    return MLAConfig.from_hf(text_config), getattr(text_config, "model_type", "unknown")


def patch_config(model: nn.Module) -> MLAConfig:
    """The MLAConfig of ``patch(model)``'s layers and cache (a cache given to ``patch`` is built
    for it): ``MLAConfig.from_hf`` of the model's (text) config with its MLA layers numbered
    0 .. M-1 in model order (LongCat has two per decoder layer, Kimi Linear and GLM-5.3-Flash
    only their MLA layers), the shared indexer layers among them alike."""
    return _numbered(_configs(model)[0])


def _numbered(cfg: MLAConfig) -> MLAConfig:
    shared = cfg.index_shared_layers
    if cfg.mla_layers is not None:   # a shared layer's source, the MLA layer before it, moves alike
        shared = tuple(cfg.mla_layers.index(i) for i in shared)
    return dataclasses.replace(cfg, mla_layers=None, index_shared_layers=shared)


class PatchHandle:
    """The patch of one model: its layers, its cache, and the request it is serving."""

    def __init__(self, model, cache, *, dtype, backend, num_blocks, block_size, max_workspace_tokens, graphs=None):
        cfg, model_type = _configs(model)
        if graphs is not None and not isinstance(graphs, bool):
            raise ValueError(f"graphs: expected True, False or None, got {graphs!r}")
        if graphs and cfg.index_shared_layers:
            raise ValueError(f"graphs: {model_type!r} shares a top-k across layers, which a graph a layer cannot "
                             "hand on (patch with graphs=False)")
        # GLM-5's, GLM-5.3-Flash's and Hy4's decoder layers take a third output from attention,
        # its top-k, and hand it to the next layer as prev_topk_indices (the shared layers reuse
        # it). The stand-ins return None there: mla's layers share their selection through the
        # step's Batch (``Batch.remember``), one Batch serving every layer of a forward, so the
        # next stand-in needs nothing from transformers.
        self.returns_topk = model_type in ("glm_moe_dsa", "glm5_next_text", "glm5_next", "hy_v4")
        self.cfg = _numbered(cfg)
        if any(isinstance(m, _MLAAttention) for m in model.modules()):
            raise ValueError("model: expected an unpatched model, got one patched already (unpatch it first)")
        sites = [(name, m) for name, m in model.named_modules() if _is_mla_attention(m)]
        if not sites:
            raise ValueError(f"model: expected MLA attention modules (kv_a_proj_with_mqa, kv_b_proj) in a "
                             f"model of model_type {model_type!r}, found none")
        if cfg.mla_layers is not None and len(cfg.mla_layers) != len(sites):
            raise ValueError(f"model: expected the {len(cfg.mla_layers)} MLA layers its config names, "
                             f"found {len(sites)} modules")
        first = next(sites[0][1].parameters())
        dtype = first.dtype if dtype is None else dtype
        device = first.device
        if cache is None:
            cache = PagedLatentCache(self.cfg, num_layers=len(sites), num_blocks=num_blocks, block_size=block_size,
                                     dtype=dtype, device=device)
        elif not isinstance(cache, PagedLatentCache):
            raise ValueError(f"cache: expected a mla.PagedLatentCache or None, got {type(cache).__name__}")
        elif cache.cfg != self.cfg or cache.num_layers < len(sites):
            raise ValueError(f"cache: expected a PagedLatentCache of mla.hf.patch_config(model) and num_layers >= "
                             f"{len(sites)}, got num_layers={cache.num_layers} "
                             f"and {'the same' if cache.cfg == self.cfg else 'another'} config")
        problem = static_sparse_problem(cfg, cache) if cfg.has_indexer else None
        if graphs and problem:
            raise ValueError(f"graphs: {model_type!r}: {problem} (patch with graphs=False)")
        if graphs is None:
            graphs = cache.device.type == "cuda" and not cfg.has_indexer
        self.model, self.cache, self.model_type = model, cache, model_type
        kw = {} if max_workspace_tokens is None else {"max_workspace_tokens": max_workspace_tokens}
        self.layers: list[MLA] = []
        self._graphs: list[StepGraph] = []     # one a layer with graphs=True, all alike in what they serve
        self._swapped = []                     # (parent, attribute name, original module)
        stand_ins = []
        # one pool for every layer's graphs: the layers' steps never overlap, and each graph's
        # output is copied out before the next module runs
        pool = torch.cuda.graph_pool_handle() if graphs and cache.device.type == "cuda" else None
        # the widest table a sequence can have: the pool, or the model's positions
        width = min(cache.num_blocks, -(-self.cfg.max_position_embeddings // cache.block_size))
        for i, (name, module) in enumerate(sites):
            layer = MLA(self.cfg, layer_idx=i, dtype=dtype, device=device, backend=backend, **kw)
            layer.load_hf_state_dict({k: v.detach() for k, v in module.state_dict().items()}, prefix="")
            self.layers.append(layer)
            graph = StepGraph(layer, cache, max_blocks_per_seq=width, dtype=dtype, pool=pool) if graphs else None
            if graph is not None:
                self._graphs.append(graph)
            parent_name, _, attr = name.rpartition(".")
            stand_ins.append((model.get_submodule(parent_name), attr, module,
                              _MLAAttention(self, layer, getattr(module, "layer_idx", i), graph)))
        # Swap only once every layer has loaded: a failed load leaves the model as it was.
        for parent, attr, module, stand_in in stand_ins:
            setattr(parent, attr, stand_in)    # ModuleList children are set by their string index too
            self._swapped.append((parent, attr, module))
        decoder = getattr(model, "base_model", model)
        self._hooks = [decoder.register_forward_pre_hook(self._begin_step, with_kwargs=True),
                       decoder.register_forward_hook(self._end_step, with_kwargs=True)]
        self._had_reorder = "_reorder_cache" in vars(model)
        model._reorder_cache = self._reorder_cache
        self._ids = itertools.count()
        self._seq_ids: list = []               # one mla sequence per batch row of the request
        self._past_cache = None                # the transformers Cache of the request
        self._columns: int | None = 0          # mask columns consumed (None: a forward failed)
        self._step: _Step | None = None
        self._pending: int | None = None
        # plans the forwards of transformers' continuous-batching engine (set by mla.hf_engine.enable)
        self.engine_step = None

    @property
    def graphs(self) -> bool:
        """Whether the layers' decode steps replay from CUDA graphs (``patch(graphs=)``)."""
        return bool(self._graphs)

    # ---- the request --------------------------------------------------------------------

    def release(self) -> None:
        """Return the current request's blocks to the cache; the next forward starts a new one."""
        for s in self._seq_ids:
            if s in self.cache:
                self.cache.release(s)
        self._seq_ids, self._past_cache, self._columns = [], None, 0

    def unpatch(self) -> None:
        """Release the request's blocks and put the original attention modules back."""
        self.release()
        for h in self._hooks:
            h.remove()
        for parent, attr, module in self._swapped:
            setattr(parent, attr, module)
        if not self._had_reorder:
            vars(self.model).pop("_reorder_cache", None)
        self._hooks, self._swapped = [], []

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def _current_step(self) -> _Step:
        if self._step is None:
            raise ValueError("a patched attention module runs only inside the patched model's forward "
                             f"(the pre-hook on {type(getattr(self.model, 'base_model', self.model)).__name__} "
                             "builds the step)")
        return self._step

    # ---- one forward --------------------------------------------------------------------

    def _begin_step(self, module, args, kwargs):
        if self.engine_step is not None and "write_index" in kwargs:
            self._step = self.engine_step(kwargs)   # an engine step: the engine's tables, not a Cache
            return None
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None:
            raise ValueError("input_ids or inputs_embeds: expected one of them, got neither")
        B, S = x.shape[0], x.shape[1]
        past_cache = kwargs.get("past_key_values")
        if past_cache is not None and getattr(past_cache, "is_compileable", False):
            raise ValueError(f"past_key_values: expected a dynamic transformers Cache (mla holds the K/V), got "
                             f"{type(past_cache).__name__}; use generate's default cache, not a static one")
        past = past_cache.get_seq_length() if past_cache is not None else 0
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(B, past + S, dtype=torch.bool, device=x.device)
        elif not isinstance(mask, torch.Tensor) or mask.ndim != 2 or tuple(mask.shape) != (B, past + S):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask: expected a 2-D padding mask of shape {(B, past + S)} "
                             f"(batch, past + new tokens), got {got}")
        mask = mask.bool()
        if past == 0:
            self.release()                     # a new request
            self._seq_ids = [("hf", next(self._ids)) for _ in range(B)]
        else:
            if past_cache is not self._past_cache or self._columns is None:
                raise ValueError(f"past_key_values: a cache of {past} tokens that this patch did not fill in its "
                                 "last forward (another request's cache, or one after a failed forward)")
            if B != len(self._seq_ids):
                raise ValueError(f"input: expected the request's batch of {len(self._seq_ids)} rows, got {B}")
            if past > self._columns:
                raise ValueError(f"past_key_values: {past} tokens, more than the {self._columns} this patch stored")
            if past < self._columns:           # generate cropped its cache: drop the same tokens
                for s, keep in zip(self._seq_ids, mask[:, :past].sum(1).tolist()):
                    if s in self.cache and self.cache.length(s) > keep:
                        self.cache.truncate(s, keep)
        before = mask[:, :past].sum(1).tolist()
        new = mask[:, past:]
        num_new = new.sum(1).tolist()
        for b, s in enumerate(self._seq_ids):
            have = self.cache.length(s) if s in self.cache else 0
            if have != before[b]:
                raise ValueError(f"attention_mask: row {b} attends {before[b]} past tokens, expected the "
                                 f"{have} its sequence holds")
        positions = kwargs.get("position_ids")
        if positions is not None:
            expect = torch.tensor(before, device=new.device).view(B, 1) + new.long().cumsum(1) - 1
            got = positions.to(new.device).expand(B, S) if positions.ndim == 2 else None
            if got is None or not torch.equal(got[new], expect[new]):
                raise ValueError("position_ids: expected the positions mla derives from the cache (attended "
                                 "tokens before each token, as generate computes them from attention_mask)")
        requests = [(s, n) for s, n in zip(self._seq_ids, num_new) if n > 0]
        batch = self.cache.prepare(requests) if requests else None
        index = None if bool(new.all()) else new.reshape(-1).nonzero().squeeze(1)
        # the layers' graphs have the same buckets, width and s_q: one asks for all
        self._step = _Step(batch, index, batch is not None and bool(self._graphs) and self._graphs[0].fits(batch))
        self._past_cache = past_cache
        self._columns = None                   # set again when the forward completes
        self._pending = past + S
        return None

    def _end_step(self, module, args, kwargs, output):
        step, self._step = self._step, None
        if step is not None and step.runners is not None:   # an engine step: the request is not the patch's
            return None
        past_cache = kwargs.get("past_key_values")
        if past_cache is None:                 # the model made its own Cache (use_cache, no cache given)
            past_cache = getattr(output, "past_key_values", None)
        self._past_cache = past_cache
        self._columns = self._pending
        return None

    def _reorder_cache(self, past_key_values, beam_idx: torch.Tensor):
        """Beam search: row i continues row beam_idx[i]; forks share blocks copy-on-write."""
        old = self._seq_ids
        new = [("hf", next(self._ids)) for _ in old]
        for dst, src in zip(new, beam_idx.tolist()):
            if old[src] in self.cache:
                self.cache.fork(old[src], dst)
        for s in old:
            if s in self.cache:
                self.cache.release(s)
        self._seq_ids = new
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
