"""PatchHandle: a transformers MLA model's attention run by ``mla.MLA`` on one paged latent cache.

``mla.hf.patch(model)`` finds every MLA attention module of a transformers model of an exact family
(``MLAConfig.from_hf`` reads its config; a refused family raises there), builds an ``mla.MLA``
with the module's weights for each, and swaps the module for a thin stand-in that runs it on
one shared ``PagedLatentCache``. The rest of the model (embeddings, norms, MoE, lm_head, the
linear-attention layers of Kimi Linear and GLM-5.3-Flash) stays transformers' own.
User guide: docs/hf.md.

A forward that is not a plain decode step (a prompt, assisted decoding's drafts, a cropped
cache) runs eagerly:

- A forward pre-hook on the decoder stack (``model.base_model``) reads what every layer shares:
  the 2-D ``attention_mask`` ``[B, past + S]``, ``position_ids`` and the transformers ``Cache``.
  Row b of the batch is one mla sequence; its new tokens are the non-pad columns of the last S.
  Padding goes on the left, as ``generate`` expects (a row with padding after a real token is
  refused: ``tokenizer.padding_side = "left"``). The hook checks that the mask's count of past
  tokens equals the sequence's cache length and that ``position_ids`` (where given) are the
  positions mla derives from the cache, then calls ``cache.prepare`` once: plan once, run many.
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

A decode step (one new token a row on the cache of the last forward, ``generate``'s loop) runs
the whole model on static buffers (``mla.hf.decode_step``): with ``graphs`` (on by default on a GPU)
as one CUDA graph a batch bucket, embeddings to logits, its metadata packed on the host and
copied in one transfer, no host read-back; without, the same step eagerly. Both pick the same
decode kernel and split count (the block table is as wide in both), so the graphed and eager
steps give the same tokens.

Static (compileable) caches and 4-D masks are refused: their masks do not say which tokens are
padding, and mla holds the K/V those caches would preallocate.

The stand-ins hold the original modules' tensors under their names, so the patched model's
``state_dict`` and ``save_pretrained`` are the unpatched model's. The patched layers follow the
model: after ``model.to(dtype)`` or ``model.to(device)``, or an in-place change of those tensors
(``load_state_dict``), the next forward rebuilds them (and the cache the patch made, and the
graphs) from the original modules, in the model's dtype and device (so ``unpatch`` restores a
model in its new dtype). The current request is released then.

Training is refused by name: backward through a stand-in raises (mla's layers hold copies of
the weights), and so does a training-mode forward with gradient checkpointing or attention
dropout; so is ``output_attentions`` (mla's kernels never form the attention weights).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import torch
from torch import nn

from ..cache import PagedLatentCache
from ..config import MLAConfig
from ..layer import LAYER_DTYPES, MLA
from ..strategy import static_sparse_problem
from .decode_step import DecodeStep
from .generate import OneStepAhead

__all__ = ["PatchHandle", "patch_config"]


def _is_mla_attention(module: nn.Module) -> bool:
    # Every MLA family in transformers names the latent projections as DeepSeek does.
    return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj")


@dataclasses.dataclass
class _Step:
    """What every stand-in of one forward shares."""
    batch: Any                  # mla.Batch, or None when no row brings a real token
    index: torch.Tensor | None  # [T] flat rows (b * S + s) of the real tokens; None: all B * S rows
    # an engine's step (mla.hf.engine): its (request, cached, new) rows, and the whole forward on
    # static buffers where it runs there (a pure decode step), returning the model's output
    requests: Any = None
    run: Any = None


class _NoBackward(torch.autograd.Function):
    """The stand-in's output ``y`` where autograd records its input ``x`` (mla's layer itself
    records nothing): backward through mla's attention raises instead of passing no gradient."""

    @staticmethod
    def forward(ctx, y, x):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("training: mla.hf.patch serves inference; backward through mla's attention is "
                                  "not implemented (its weights are mla's copies of the module's): train unpatched")


class _MLAAttention(nn.Module):
    """Stands in for one transformers MLA attention module: same call, ``(output, None)`` back.

    It holds the original module's parameters, buffers and submodules (the same objects, under
    the same names), so the patched model's ``state_dict``, ``save_pretrained`` and ``parameters``
    are the unpatched model's and ``model.to`` moves them; its ``mla.MLA`` layer is not registered
    and follows them (``PatchHandle._follow_model``)."""

    def __init__(self, handle: "PatchHandle", layer: MLA, hf_layer_idx: int, original: nn.Module):
        super().__init__()
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            vars(self)[name] = vars(original)[name]
        self.layer_idx = hf_layer_idx          # the module's index in transformers' Cache
        self._handle, self._layer = [handle], [layer]   # lists, so nn.Module does not register them

    @property
    def mla(self) -> MLA:
        return self._layer[0]

    def forward(self, hidden_states: torch.Tensor, *args, past_key_values=None, **kwargs):
        step = self._handle[0]._current_step()
        B, S, D = hidden_states.shape
        if past_key_values is not None:
            # Lengths only: one uint8 per token keeps get_seq_length right without storing K/V;
            # zeros, so that the caches of two equal requests compare equal.
            stub = torch.zeros((B, 1, S, 1), dtype=torch.uint8, device=hidden_states.device)
            past_key_values.update(stub, stub, self.layer_idx)
        out = hidden_states.new_zeros(B * S, D) if step.index is not None or step.batch is None else None
        if step.batch is not None:
            x = hidden_states.reshape(B * S, D)
            x = x if step.index is None else x[step.index]
            y = self.mla(x.to(self.mla.dtype).contiguous(), step.batch).to(hidden_states.dtype)
            if x.requires_grad:
                y = _NoBackward.apply(y, x)
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


def _graph_problem(cfg: MLAConfig, cache: PagedLatentCache) -> str | None:
    """Why the whole-model decode step cannot run on static buffers, or None."""
    if cfg.mla_layers is not None:
        return ("its linear-attention layers keep their state in transformers' Cache, which the whole-step "
                "graph does not carry")
    if cache.cp_size > 1:
        return f"a Helix CP cache (cp_size {cache.cp_size}) is not captured"
    return static_sparse_problem(cfg, cache) if cfg.has_indexer else None


class PatchHandle:
    """The patch of one model: its layers, its cache, and the request it is serving."""

    def __init__(self, model, cache, *, dtype, backend, num_blocks, block_size, max_workspace_tokens, graphs=None,
                 overlap=True, fp8_attention=False):
        cfg, model_type = _configs(model)
        if not isinstance(fp8_attention, bool):
            raise ValueError(f"fp8_attention: expected True or False, got {fp8_attention!r}"[:200])
        if graphs is not None and not isinstance(graphs, bool):
            raise ValueError(f"graphs: expected True, False or None, got {graphs!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap: expected True or False, got {overlap!r}")
        # GLM-5's, GLM-5.3-Flash's and Hy4's decoder layers take a third output from attention,
        # its top-k, and hand it to the next layer as prev_topk_indices (the shared layers reuse
        # it). The stand-ins return None there: mla's layers share their selection through the
        # step's Batch (``Batch.remember``), one Batch serving every layer of a forward (and of
        # a graphed step), so the next stand-in needs nothing from transformers.
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
        self._own_cache = cache is None
        if cache is None:
            cache = PagedLatentCache(self.cfg, num_layers=len(sites), num_blocks=num_blocks, block_size=block_size,
                                     dtype=dtype, device=device)
        elif not isinstance(cache, PagedLatentCache):
            raise ValueError(f"cache: expected a mla.PagedLatentCache or None, got {type(cache).__name__}")
        elif cache.cfg != self.cfg or cache.num_layers < len(sites):
            raise ValueError(f"cache: expected a PagedLatentCache of mla.hf.patch_config(model) and num_layers >= "
                             f"{len(sites)}, got num_layers={cache.num_layers} "
                             f"and {'the same' if cache.cfg == self.cfg else 'another'} config")
        if fp8_attention and cache.format == "plain":
            raise ValueError(f"fp8_attention: needs an FP8 latent cache, got {cache.dtype} rows: pass "
                             "cache=mla.PagedLatentCache(mla.hf.patch_config(model), dtype=torch.float8_e4m3fn, ...)")
        problem = _graph_problem(cfg, cache)
        if graphs and problem:
            raise ValueError(f"graphs: {model_type!r}: {problem} (patch with graphs=False)")
        self.model, self.model_type, self._graphs_arg, self._family_cfg = model, model_type, graphs, cfg
        self._backend = backend
        self._kw = {"fp8_attention": fp8_attention}
        if max_workspace_tokens is not None:
            self._kw["max_workspace_tokens"] = max_workspace_tokens
        self._sites = sites
        self._parents = [model.get_submodule(name.rpartition(".")[0]) for name, _ in sites]
        self._swapped = []                     # (parent, attribute name, original module)
        self._build(cache, dtype, device)
        for parent, (name, module) in zip(self._parents, sites):
            self._swapped.append((parent, name.rpartition(".")[2], module))
        decoder = getattr(model, "base_model", model)
        self._hooks = [decoder.register_forward_pre_hook(self._begin_step, with_kwargs=True),
                       decoder.register_forward_hook(self._end_step, with_kwargs=True)]
        self._had_reorder = "_reorder_cache" in vars(model)
        model._reorder_cache = self._reorder_cache
        self._had_forward = "forward" in vars(model)
        self._original_forward = model.forward
        model.forward = functools.wraps(self._original_forward)(lambda *a, **kw: self._forward(*a, **kw))
        self._had_generate = "generate" in vars(model)
        self._original_generate = getattr(model, "generate", None)
        if self._original_generate is not None:
            model.generate = functools.wraps(self._original_generate)(lambda *a, **kw: self._generate(*a, **kw))
        self._loop = OneStepAhead(self) if overlap else None
        self._ids = itertools.count()
        self._seq_ids: list = []               # one mla sequence per batch row of the request
        self._past_cache = None                # the transformers Cache of the request
        self._lengths_only = False             # its MLA layers only count tokens (set_lengths may serve them)
        self._columns: int | None = 0          # mask columns consumed (None: a forward failed)
        self._step: _Step | None = None
        self._static = False                   # the static decode step's forward is running
        self._pending: int | None = None
        # plans the forwards of transformers' continuous-batching engine (set by mla.hf.enable)
        self.engine_step = None
        self.engine = None                     # that engine (mla.hf.engine.Engine), once made
        self._engine_next: _Step | None = None   # the engine's step planned by _forward, for the pre-hook

    def _build(self, cache: PagedLatentCache, dtype: torch.dtype, device: torch.device) -> None:
        """The layers on ``cache`` from the original modules' weights, their stand-ins swapped in,
        and the decode step on static buffers where it serves."""

        layers, stand_ins = [], []
        for i, (name, module) in enumerate(self._sites):
            layer = MLA(self.cfg, layer_idx=i, dtype=dtype, device=device, backend=self._backend, **self._kw)
            layer.load_hf_state_dict({k: v.detach() for k, v in module.state_dict().items()}, prefix="")
            layers.append(layer)
            stand_ins.append(_MLAAttention(self, layer, getattr(module, "layer_idx", i), module))
        # Swap only once every layer has loaded: a failed load leaves the model as it was.
        for parent, (name, _), stand_in in zip(self._parents, self._sites, stand_ins):
            setattr(parent, name.rpartition(".")[2], stand_in)   # ModuleList children by their string index too
        self.cache, self.layers, self.dtype, self.device = cache, layers, dtype, torch.device(device)
        self._built = self._versions()         # the weights the layers hold
        self._layer_ids = [m.layer_idx for m in stand_ins]
        graphs = self._graphs_arg
        problem = _graph_problem(self._family_cfg, cache)
        if graphs is None:
            graphs = cache.device.type == "cuda" and not self.cfg.has_indexer and problem is None
        # the widest table a sequence can have; the eager decode steps of a dense family run the
        # same static step, so that their decode kernel and split count (chosen from the table's
        # width) are the graph's
        static = problem is None and (graphs or not self.cfg.has_indexer)
        self._decode = DecodeStep(self, cache.max_table_width, cuda_graphs=bool(graphs)) if static else None
        self._graphs_on = bool(graphs) and static

    @property
    def graphs(self) -> bool:
        """Whether decode steps run the whole model as one graph a bucket (``patch(graphs=)``; on
        CPU the same static step, eagerly)."""
        return self._graphs_on

    # ---- the request --------------------------------------------------------------------

    def release(self) -> None:
        """Return the current request's blocks to the cache; the next forward starts a new one."""
        for s in self._seq_ids:
            if s in self.cache:
                self.cache.release(s)
        self._seq_ids, self._past_cache, self._columns = [], None, 0
        if self._decode is not None:
            self._decode.invalidate()

    def unpatch(self) -> None:
        """Release the request's blocks and put the original attention modules back."""
        self.release()
        for h in self._hooks:
            h.remove()
        for parent, attr, module in self._swapped:
            setattr(parent, attr, module)
        if not self._had_reorder:
            vars(self.model).pop("_reorder_cache", None)
        if self._swapped:
            for name, had, original in (("forward", self._had_forward, self._original_forward),
                                        ("generate", self._had_generate, self._original_generate)):
                if had:
                    setattr(self.model, name, original)
                else:
                    vars(self.model).pop(name, None)
            # the engine's entry (mla.hf.engine.attach) goes with the patch: transformers' own again
            vars(self.model).pop("init_continuous_batching", None)
        self._hooks, self._swapped = [], []
        self.engine_step = self.engine = None

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

    def _versions(self) -> tuple[int, ...]:
        """The in-place version counters of the original modules' tensors (``load_state_dict``
        bumps them)."""
        return tuple(t._version for _, m in self._sites for t in itertools.chain(m.parameters(), m.buffers()))

    def _follow_model(self, values: bool = False) -> None:
        """Rebuild the layers (and the cache the patch made) where ``model.to`` moved or cast the
        original modules' parameters since the last forward or, with ``values`` (a forward's
        pre-hook, not a decode step), where their values changed in place (module docstring)."""
        w = next(self._sites[0][1].parameters())
        if w.dtype == self.dtype and w.device == self.device and not (values and self._versions() != self._built):
            return
        dtype, device = w.dtype, w.device
        if dtype not in LAYER_DTYPES:
            raise ValueError(f"model: cast to {dtype} after patch; mla's layers run in one of {LAYER_DTYPES}: "
                             "cast the model to one of them")
        if not self._own_cache and (self.cache.device != device or
                                    (self.cache.format == "plain" and self.cache.dtype != dtype)):
            raise ValueError(f"model: its MLA layers are now {dtype} on {device} (model.to after patch), the cache "
                             f"given to patch holds {self.cache.dtype} rows on {self.cache.device}: unpatch, and patch "
                             "again with a cache of the model's dtype and device (or no cache: patch makes one)")
        self.release()
        cache = self.cache
        if self._own_cache:
            sizes = dict(num_layers=cache.num_layers, num_blocks=cache.num_blocks, block_size=cache.block_size)
            cache = self.cache = self._decode = None    # the old pool and graphs go before the new ones
            cache = PagedLatentCache(self.cfg, **sizes, dtype=dtype, device=device)
        self._build(cache, dtype, device)

    # ---- generate -----------------------------------------------------------------------

    # generate's arguments whose decoding the one-step-ahead loop leaves to transformers: another
    # decoding method, its drafts, the tokenizer of stop strings (a custom method does not get it)
    _OWN_DECODING = ("custom_generate", "assistant_model", "tokenizer", "assistant_tokenizer", "synced_gpus",
                     "prefix_allowed_tokens_fn", "negative_prompt_ids")

    def _generate(self, *args, **kwargs):
        """``model.generate``: transformers' own, its greedy and sampled decoding run one step
        ahead of the GPU where the static decode step serves them (``mla.hf.generate``)."""
        if (self._loop is not None and self._swapped and self._decode is not None
                and all(kwargs.get(k) is None for k in self._OWN_DECODING)):
            kwargs["custom_generate"] = self._loop
            if kwargs.get("streamer") is not None:
                kwargs["mla_streamer"] = kwargs["streamer"]
        return self._original_generate(*args, **kwargs)

    # ---- one forward --------------------------------------------------------------------

    def _forward(self, *args, **kwargs):
        """The model's forward: a decode step on the static step, an engine's step as its plan
        says, anything else as it was."""
        if self._swapped:
            self._follow_model()
            if self.engine_step is not None and "write_index" in kwargs:
                step = self.engine_step(kwargs)
                if step.run is not None:      # the whole forward on static buffers
                    return step.run()
                self._engine_next = step
                try:
                    return self._original_forward(*args, **kwargs)
                finally:
                    self._engine_next = None
            if self._decode is not None and not args:
                out = self._decode_step(kwargs)
                if out is not None:
                    return out
        return self._original_forward(*args, **kwargs)

    # generate's decode-step arguments the static step serves (others run the eager forward)
    _DECODE_KWARGS = frozenset(("input_ids", "attention_mask", "position_ids", "past_key_values", "use_cache",
                                "return_dict", "cache_position", "logits_to_keep", "output_attentions",
                                "output_hidden_states"))

    def _decode_step(self, kwargs):
        """One token a row over the request's cache, on the static step; None where the step is
        not that (the eager forward then serves it, or raises)."""
        ids, past_cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
        if (not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] != 1 or past_cache is None
                or past_cache is not self._past_cache or not self._lengths_only or self._columns in (None, 0)
                or not self._DECODE_KWARGS.issuperset(kwargs) or kwargs.get("use_cache") is False
                or kwargs.get("output_attentions") or kwargs.get("output_hidden_states")):
            return None
        B, past = ids.shape[0], self._columns
        if B != len(self._seq_ids) or B > self._decode.max_rows or past_cache.get_seq_length() != past:
            return None
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, past + 1)):
            return None
        if positions is not None and (not isinstance(positions, torch.Tensor) or positions.ndim != 2
                                      or positions.shape[1] != 1 or positions.shape[0] not in (1, B)):
            return None
        lengths = self.cache.lengths(self._seq_ids)
        if max(lengths) >= self._decode.width * self.cache.block_size or (mask is None and min(lengths) != past):
            return None
        logits = self._decode(ids, self._seq_ids, lengths)
        self._decode.set_lengths(past_cache, self._layer_ids, B, past + 1)
        self._columns = past + 1
        if mask is not None or positions is not None:
            self._decode.pending_check = (mask if mask is not None else torch.ones(B, past + 1, device=ids.device),
                                          positions, [n + 1 for n in lengths], past)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_cache)

    def _enter_static(self, batch) -> None:
        """The static step's forward is running (``mla.hf.decode_step``): the stand-ins serve its batch,
        the hooks stand aside."""
        self._step, self._static = _Step(batch, None), True

    def _leave_static(self) -> None:
        self._step, self._static = None, False

    def _begin_step(self, module, args, kwargs):
        if self._static:                      # the static step's forward: its batch is set
            return None
        if self.engine_step is not None and "write_index" in kwargs:
            # an engine step: the engine's tables, not a Cache (planned by _forward already, unless
            # the decoder stack was called directly)
            step, self._engine_next = self._engine_next, None
            self._step = step if step is not None else self.engine_step(kwargs)
            return None
        self._follow_model(values=True)
        self._refuse_unserved(module, kwargs)
        if self._decode is not None:
            self._decode.check_pending()       # the last decode step's mask, now that the host waits anyway
            self._decode.invalidate()
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
        if mask.shape[1] > 1:
            gaps = (mask[:, 1:] < mask[:, :-1]).any(1).nonzero().flatten().tolist()
            if gaps:
                raise ValueError(f"attention_mask: row {gaps[0]} has padding after a real token (right padding); "
                                 "mla serves left-padded batches, as generate expects: pad on the left "
                                 "(tokenizer.padding_side = 'left')")
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
        self._step = _Step(batch, index)
        self._past_cache = past_cache
        self._columns = None                   # set again when the forward completes
        self._pending = past + S
        return None

    def _refuse_unserved(self, decoder, kwargs) -> None:
        """What the stand-ins do not serve, refused by name before anything runs (docs/hf.md)."""
        if kwargs.get("output_attentions", getattr(getattr(decoder, "config", None), "output_attentions", False)):
            raise NotImplementedError("output_attentions: mla's attention does not return its weights (its kernels "
                                      "never form the softmax matrix); call without output_attentions")
        if decoder.training and torch.is_grad_enabled():
            if getattr(self.model, "is_gradient_checkpointing", False):
                raise NotImplementedError("training: gradient checkpointing recomputes the attention in backward, "
                                          "which mla does not implement; mla.hf.patch serves inference (model.eval())")
            dropout = getattr(self._sites[0][1], "attention_dropout", 0.0)
            if dropout:
                raise NotImplementedError(f"training: attention_dropout={dropout} in training mode; mla's attention "
                                          "has no dropout, it serves inference (model.eval())")

    def _end_step(self, module, args, kwargs, output):
        if self._static:
            return None
        step, self._step = self._step, None
        if step is not None and step.requests is not None:   # an engine step: the request is not the patch's
            return None
        past_cache = kwargs.get("past_key_values")
        if past_cache is None:                 # the model made its own Cache (use_cache, no cache given)
            past_cache = getattr(output, "past_key_values", None)
        self._past_cache = past_cache
        self._lengths_only = self.counts_lengths(past_cache)
        self._columns, self._pending = self._pending, None
        return None

    def counts_lengths(self, past_cache) -> bool:
        """Whether transformers' Cache ``past_cache`` holds, for every MLA layer, only what the
        stand-ins' stubs give it: layers whose length is their keys' length, nothing else (the
        indexed layer's indexer keys stay empty: mla keeps them), so the static decode step may
        set those lengths itself."""
        layers = getattr(past_cache, "layers", None)
        return layers is not None and all(
            i < len(layers) and type(layers[i]).__name__ in ("DynamicLayer", "DynamicIndexedLayer")
            for i in self._layer_ids)

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
        if self._decode is not None:
            self._decode.invalidate()
        past_key_values.reorder_cache(beam_idx)
        return past_key_values
