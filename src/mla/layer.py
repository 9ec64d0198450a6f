"""class MLA: the attention layer of DeepSeek-V2/V3 and Kimi K2 on a paged latent cache.

Notation (DeepSeek-V2 paper; vLLM's MLA docstring uses the same):

    D   hidden size           H   heads             rq  q_lora_rank (None: "lite")
    r   kv_lora_rank (Lkv)    dn  qk_nope_head_dim  dr  qk_rope_head_dim   dv  v_head_dim
    W_UK [H, dn, r], W_UV [H, dv, r]: the two halves of kv_b_proj, per head

One step, for the T new tokens of a batch:

    [q_a | kv_a] = x @ [W_qa | W_kva]^T               one GEMM (q_proj instead of q_a if lite)
    q            = query(q_a)               [T, H, dn + dr] -> q_nope, q_pe: q_b_proj(rmsnorm(q_a)),
                                                             or a family's (projections.py)
    c_kv, k_pe   = rmsnorm(kv_a[:r]), kv_a[r:]             (both norms one launch: ops.rms_norm_pair)
    indexer      = a sparse config's index rows written, its top-k inputs kept (sparse.py)
    rope(q_pe), rope(k_pe); cache[slot] = [c_kv | k_pe]      (ops.rope_append; at a pure decode step
                                                             rope(q_pe) lands in the absorbed query)
    per sequence, by the strategy plan (strategy.py): expanded (expanded.py) or absorbed (absorbed.py),
    or with a sparse indexer past cfg.sparse_max_keys keys: the indexer's top-k keys only
    (sparse.py; GLM-5.3-Flash: its top pools and its open pool, kpool.py; under Helix CP a top-k
    merged from every rank's candidates, sparse_cp.py)
    attn         = gate(x, attn [T, H, dv])                identity, or a family's (projections.py)
    out          = o_proj(attn [T, H * dv])

What a family changes (the query projection, the output gate, the indexer) is picked once in
``__init__``; ``forward`` is the same path for every family.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import absorbed, expanded, ops, sparse, sparse_cp
from .batch import Batch
from .config import MLAConfig
from .ops._checks import check_fp8_tensor_cores
from .parallel import Parallel, shard_block_fp8, shard_hf_weights
from .plan import Plan
from .projections import output_gate, query_projection
from .rope import cos_sin, inv_freq, query_temperature
from .strategy import build_plan, check_strategy
from .weights import dequant_block_fp8, read_hf_weights, split_kv_b

__all__ = ["MLA"]

LAYER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


FP8_WEIGHTS = ("auto", "always", "never")   # keep q_b_proj / o_proj in FP8: on CUDA, always, never


class MLA(nn.Module):
    def __init__(self, cfg: MLAConfig, layer_idx: int = 0, dtype: torch.dtype = torch.bfloat16, device="cpu",
                 backend: str = "auto", max_workspace_tokens: int = 65536, parallel=None, fp8_weights: str = "auto",
                 strategy: str | None = None, fp8_attention: bool = False):
        super().__init__()
        if not isinstance(cfg, MLAConfig):
            raise ValueError(f"cfg: expected an MLAConfig, got {type(cfg).__name__}")
        if dtype not in LAYER_DTYPES:
            raise ValueError(f"dtype: expected one of {LAYER_DTYPES}, got {dtype}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "triton" and dtype == torch.bfloat16 and torch.device(device).type == "cpu":
            raise ValueError("backend: expected 'torch' or 'auto' for a bfloat16 layer on CPU (Triton's interpreter "
                             "computes bfloat16 dot products wrongly; float32 and float16 layers can use it)")
        if not isinstance(max_workspace_tokens, int) or max_workspace_tokens <= 0:
            raise ValueError(f"max_workspace_tokens: expected a positive int, got {max_workspace_tokens!r}")
        if fp8_weights not in FP8_WEIGHTS:
            raise ValueError(f"fp8_weights: expected one of {FP8_WEIGHTS}, got {fp8_weights!r}")
        if not isinstance(fp8_attention, bool):
            raise ValueError(f"fp8_attention: expected a bool, got {fp8_attention!r}"[:200])
        if fp8_attention:
            check_fp8_tensor_cores("fp8_attention", device)
        cfg.check_layer_idx(layer_idx)
        check_strategy(cfg, strategy)
        if fp8_attention and (cfg.has_indexer or cfg.attention_sinks):
            raise ValueError(f"fp8_attention: {cfg.name!r} attends through its sparse indexer (DeepSeek Sparse "
                             "Attention), whose kernels have no e4m3 arithmetic; FP8 context attention serves "
                             "dense MLA configs")
        if parallel is not None:
            if not isinstance(parallel, Parallel):
                raise ValueError(f"parallel: expected a mla.Parallel or None, got {type(parallel).__name__}")
            parallel.check_config(cfg)
        self.cfg, self.layer_idx, self.dtype, self.parallel = cfg, layer_idx, dtype, parallel
        self.op_backend = None if backend == "auto" else backend
        self.fp8_weights = fp8_weights
        # context attention (expanded paths, absorbed context chunks) in e4m3, over an FP8 cache only
        self.fp8_attention = fp8_attention
        self.max_workspace_tokens = max_workspace_tokens
        # None: the cost rule of strategy.py per sequence; a name pins that path wherever it can
        # serve (tests and benchmarks reach every path this way)
        self.strategy = strategy
        tp, cp = (parallel.tp_size, parallel.cp_size) if parallel is not None else (1, 1)
        # H: this rank's TP heads (q, W_UK, W_UV); H_s: its slice of them under CP (o_proj, context)
        self.num_local_heads = H = cfg.num_heads // tp
        self.num_slice_heads = H // cp
        self.slice_start = (parallel.cp_rank if parallel is not None else 0) * self.num_slice_heads
        # what the family changes around the attention, picked once (projections.py, sparse.py)
        self.query = query_projection(cfg)
        self.gate = output_gate(cfg)
        self.indexer = sparse.indexer(cfg, layer_idx)
        self.has_own_indexer = isinstance(self.indexer, sparse.OwnIndexer)
        self.q_dim = self.query.q_rows(cfg, H)

        def param(*shape, dtype=dtype):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)

        # the q rows (q_a_proj, or q_proj) and kv_a_proj_with_mqa fused: both read x, one GEMM
        self.w_a = param(self.q_dim + cfg.kv_dim, cfg.hidden_size)
        self.b_a = param(self.q_dim + cfg.kv_dim) if cfg.attention_bias else None
        self.kv_a_norm = param(cfg.kv_lora_rank)
        self.w_kv_b = param(H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.w_o = param(cfg.hidden_size, self.num_slice_heads * cfg.v_head_dim)
        self.b_o = param(cfg.hidden_size) if cfg.attention_bias else None
        parts = {**self.query.params(cfg, H), **self.gate.params(cfg, self.num_slice_heads),
                 **self.indexer.params(cfg)}
        for name, shape in parts.items():
            setattr(self, name, param(*shape))
        # Hy4's sink logit per TP head, float32 as the sparse ops take it
        self.sinks = param(H, dtype=torch.float32) if cfg.attention_sinks else None
        # block scales of w_q_b / w_o where they are kept in FP8 (see load_hf_state_dict)
        self.register_buffer("w_q_b_scale", None, persistent=False)
        self.register_buffer("w_o_scale", None, persistent=False)
        self.register_buffer("inv_freq", inv_freq(cfg).to(device), persistent=False)
        self.loaded = False

    # W_UK [H, dn, r] and W_UV [H, dv, r]: views of kv_b_proj, derived once by weights.split_kv_b
    @property
    def W_UK(self) -> torch.Tensor:
        return split_kv_b(self.w_kv_b, self.num_local_heads, self.cfg.qk_nope_head_dim, self.cfg.v_head_dim)[0]

    @property
    def W_UV(self) -> torch.Tensor:
        return split_kv_b(self.w_kv_b, self.num_local_heads, self.cfg.qk_nope_head_dim, self.cfg.v_head_dim)[1]

    @property
    def W_UV_slice(self) -> torch.Tensor:
        return self.W_UV[self.slice_start: self.slice_start + self.num_slice_heads]

    @torch.no_grad()
    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor], prefix: str = "", strict: bool = True) -> None:
        """Load one layer from HF names (``prefix + "q_a_proj.weight"``, ...). Every tensor is
        checked before any is copied: a missing or mis-shaped one, and with ``strict`` any tensor
        under ``prefix`` the layer does not use (``strict=False`` skips those), raise ValueError
        and leave the layer as it was. FP8 weights with ``weight_scale_inv`` are dequantized,
        except q_b_proj and o_proj, which stay FP8 with their block scales and run as
        block-scaled FP8 GEMMs (``mla.ops.fp8_linear``) when ``fp8_weights`` is "always", or
        "auto" on a CUDA device, where they are faster at decode sizes (docs/PERF.md). A TP/CP
        share that would split a 128-block is dequantized, and so is A.X-K2's q_gate_proj (it
        replaces q_b_proj; a fused FP8 GEMM of it is not implemented)."""
        if not isinstance(sd, Mapping):
            raise ValueError(f"sd: expected a mapping of names to tensors, got {type(sd).__name__}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix: expected a str, got {type(prefix).__name__}")
        fp8_names = ("o_proj.weight",) + self.query.fp8_names
        keep = self.fp8_weights == "always" or (self.fp8_weights == "auto" and self.w_a.device.type == "cuda")
        w = read_hf_weights(self.cfg, sd, prefix, keep_fp8=fp8_names if keep else (), strict=bool(strict),
                            layer_idx=self.layer_idx)
        kept = {}     # name -> this rank's (e4m3 weight, scales) of a weight that stays FP8
        for name in fp8_names:
            if isinstance(w[name], tuple):   # stored as e4m3 and asked for as such
                kept[name] = shard_block_fp8(name, *w[name], self.cfg, self.parallel)
                w[name] = dequant_block_fp8(*w[name]) if kept[name] is None else w[name][0]
        w = shard_hf_weights(w, self.cfg, self.parallel)
        q_name = self.query.hf_name
        self.w_a.copy_(torch.cat((w[q_name + ".weight"], w["kv_a_proj_with_mqa.weight"]), 0))
        if self.b_a is not None:
            kv_bias = w["kv_a_proj_with_mqa.bias"]
            q_bias = w.get(q_name + ".bias", torch.zeros(self.q_dim))    # q_proj has none
            self.b_a.copy_(torch.cat((q_bias.to(kv_bias), kv_bias)))
        self.kv_a_norm.copy_(w["kv_a_layernorm.weight"])
        self.w_kv_b.copy_(w["kv_b_proj.weight"])
        self.set_weight("w_o", w["o_proj.weight"], kept.get("o_proj.weight"))
        if self.b_o is not None:
            self.b_o.copy_(w["o_proj.bias"])
        if self.sinks is not None:
            self.sinks.copy_(w["sinks"])
        self.query.load(self, w, kept)
        self.gate.load(self, w)
        self.indexer.load(self, w)
        self.loaded = True

    def set_weight(self, attr: str, full: torch.Tensor, fp8) -> None:
        """A projection's weight: the dequantized ``full`` in the layer's dtype, or ``fp8`` =
        (float8_e4m3fn weight, float32 block scales) as stored."""
        dev = self.w_a.device
        if fp8 is None:
            if getattr(self, attr).dtype != self.dtype:   # FP8 from a load with fp8_weights kept
                setattr(self, attr, nn.Parameter(torch.empty(full.shape, dtype=self.dtype, device=dev),
                                                 requires_grad=False))
            getattr(self, attr).copy_(full)
            setattr(self, attr + "_scale", None)
        else:
            setattr(self, attr, nn.Parameter(fp8[0].to(dev).contiguous(), requires_grad=False))
            setattr(self, attr + "_scale", fp8[1].to(dev, torch.float32).contiguous())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x @ weight^T, or the block-scaled FP8 GEMM where ``weight`` is kept in FP8 (``scale``)."""
        if scale is None:
            return F.linear(x, weight)
        return ops.fp8_linear(x, weight, scale, backend=self.op_backend)

    def expand_kv(self, c_kv: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor) -> None:
        """kv_b_proj for this rank's head slice, written in place: c_kv [N, r] -> k_nope [N, H_s, dn]
        and v [N, H_s, dv]; both may be strided views with unit last stride (k_nope = k[..., :dn])."""
        cfg, heads = self.cfg, slice(self.slice_start, self.slice_start + self.num_slice_heads)
        W_UK, W_UV = split_kv_b(self.w_kv_b, self.num_local_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
        if c_kv.device.type == "cpu" and c_kv.dtype != torch.float32:
            # CPU bf16/fp16 bmm (oneDNN) would copy the broadcast input per head ([H_s, N, r]):
            # one GEMM into a temporary, then two copies, is far smaller there
            rows = cfg.qk_nope_head_dim + cfg.v_head_dim
            w = self.w_kv_b[self.slice_start * rows: (self.slice_start + self.num_slice_heads) * rows]
            kv = F.linear(c_kv, w).view(c_kv.shape[0], self.num_slice_heads, rows)
            k_nope.copy_(kv[..., : cfg.qk_nope_head_dim])
            v.copy_(kv[..., cfg.qk_nope_head_dim:])
            return
        x = c_kv.expand(self.num_slice_heads, *c_kv.shape)      # [H_s, N, r]: stride 0 over heads, no copy
        # One GEMM per head (bmm) rather than one F.linear: a head's [N, d] output block is a matrix
        # whose row stride exceeds its width, which cuBLAS writes in place, so neither half goes
        # through an [N, H_s, dn + dv] temporary.
        absorbed.bmm_into(x, W_UK[heads].mT, k_nope.transpose(0, 1))
        absorbed.bmm_into(x, W_UV[heads].mT, v.transpose(0, 1))

    def plan(self, batch: Batch) -> Plan:
        """The step's strategy plan (strategy.py) for this layer's workspace and ``strategy``:
        built by the first layer that asks and shared by every layer that would build the same."""
        gathers = ops.resolve_backend(self.op_backend, batch.device) == "torch"   # the sparse reference
        return batch.memo(("plan", self.cfg, self.max_workspace_tokens, self.strategy, gathers),
                          lambda: build_plan(batch, self.cfg, self.max_workspace_tokens, self.strategy, gathers))

    def _check(self, hidden_states: torch.Tensor, batch: Batch) -> None:
        if not isinstance(batch, Batch):
            raise ValueError(f"batch: expected a mla.Batch from PagedLatentCache.prepare, got {type(batch).__name__}")
        cache = batch.cache
        cache.check_batch(batch)
        if cache.cfg != self.cfg:
            raise ValueError("batch: its cache was built for another MLAConfig")
        cp, cp_rank = (self.parallel.cp_size, self.parallel.cp_rank) if self.parallel is not None else (1, 0)
        if (cache.cp_size, cache.cp_rank) != (cp, cp_rank):
            raise ValueError(f"batch: its cache is CP rank {cache.cp_rank} of {cache.cp_size}, the layer CP rank "
                             f"{cp_rank} of {cp}: give the layer and the cache the same parallel")
        if self.fp8_attention and cache.format == "plain":
            raise ValueError(f"fp8_attention: needs an FP8 latent cache (PagedLatentCache dtype float8_e4m3fn), "
                             f"the batch's cache stores {cache.dtype} rows")
        if cache.format == "plain" and cache.dtype != self.dtype:
            raise ValueError(f"batch: its cache stores {cache.dtype} rows, expected the layer's dtype {self.dtype} "
                             "(or an FP8 cache)")
        if self.layer_idx >= cache.num_layers:
            raise ValueError(f"layer_idx: {self.layer_idx} is past the cache's num_layers={cache.num_layers}")
        expected = (batch.num_tokens, self.cfg.hidden_size)
        if not isinstance(hidden_states, torch.Tensor) or tuple(hidden_states.shape) != expected:
            got = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise ValueError(f"hidden_states: expected shape {expected} (tokens of the batch, hidden), got {got}")
        if hidden_states.dtype != self.dtype:
            raise ValueError(f"hidden_states: expected dtype {self.dtype}, got {hidden_states.dtype}")
        if hidden_states.device != self.w_a.device or cache.device != self.w_a.device:
            raise ValueError(f"hidden_states: expected device {self.w_a.device}, got {hidden_states.device} "
                             f"(cache on {cache.device})")
        if not self.loaded:
            raise ValueError("weights: call load_hf_state_dict before the first forward")

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, batch: Batch) -> torch.Tensor:
        """hidden_states [T, D] (T = batch.num_tokens, rows in the batch's sequence order) -> [T, D]."""
        self._check(hidden_states, batch)
        cfg, T, r, dn = self.cfg, batch.num_tokens, self.cfg.kv_lora_rank, self.cfg.qk_nope_head_dim
        plan = self.plan(batch)     # before any write: a plan the batch cannot have raises here
        proj = self.query(self, F.linear(hidden_states, self.w_a, self.b_a))    # q, q_a, c_kv, k_pe, gate
        q = proj.q
        cos, sin = batch.memo(("rope", cfg), lambda: cos_sin(cfg, batch.positions, self.inv_freq))
        temperature = batch.memo(("temperature", cfg), lambda: query_temperature(cfg, batch.positions))
        # the sparse indexer, first to write (its index rows); a shared layer whose source layer has
        # not run raises before any write
        index_qkw, shared = self.indexer(self, hidden_states, proj.q_a, cos, sin, batch, plan)
        kv_cache = batch.cache.layer(self.layer_idx)
        # a step whose every row is absorbed decode: the rotated RoPE columns of the queries go
        # straight into the absorbed query's buffer (W_UK fills the rest), not into q and a copy
        q_rope = None
        if temperature is None and _absorbed_only(plan, T):
            q_rope = absorbed.query_buffer(self, T, q.dtype, q.device)
        ops.rope_append(q[..., dn:], proj.k_pe, proj.c_kv, cos, sin, kv_cache, batch.slot_mapping,
                        cfg.rope_interleave, kv_scale=batch.cache.kv_scale, backend=self.op_backend,
                        q_out=None if q_rope is None else q_rope[..., r:])
        if temperature is not None:
            q = (q.float() * temperature[:, None, None]).to(q.dtype)

        Hs = self.num_slice_heads
        attn = torch.empty(T, Hs, cfg.v_head_dim, dtype=self.dtype, device=hidden_states.device)
        q_slice = q[:, self.slice_start: self.slice_start + Hs]     # the context paths' heads
        if plan.prefill is not None:
            expanded.prefill(self, q_slice, proj.c_kv, proj.k_pe, plan.prefill, attn)
        for p in plan.cached:
            expanded.cached(self, q_slice, p, kv_cache, batch.cache, attn)
        if plan.chunked is not None:
            expanded.chunked(self, q_slice, proj.c_kv, proj.k_pe, plan.chunked, kv_cache, batch.cache, attn)
        for group in plan.absorbed:
            absorbed.attend(self, q, group, kv_cache, attn, batch.cache.kv_scale, q_rope)
        if plan.sparse:
            # Helix CP: a top-k merged over every rank's keys, partials combined by LSE (sparse_cp.py)
            attend = sparse.attend if batch.cache.cp_size == 1 else sparse_cp.attend
            attend(self, q, index_qkw, shared, plan, batch, kv_cache, attn)
        attn = self.gate(self, hidden_states, attn, proj.gate_logits)
        out = self.linear(attn.reshape(T, Hs * cfg.v_head_dim), self.w_o, self.w_o_scale)
        if self.parallel is not None:
            self.parallel.all_reduce(out)    # o_proj is row-parallel over all tp * cp ranks
        return out if self.b_o is None else out + self.b_o


def _absorbed_only(plan, T: int) -> bool:
    """Whether one absorbed group serves all T rows of the step in order (pure decode, one s_q),
    so that nothing else reads the queries' RoPE columns."""
    return (plan.prefill is None and not plan.cached and plan.chunked is None and not plan.sparse
            and len(plan.absorbed) == 1 and isinstance(plan.absorbed[0].rows, slice)
            and plan.absorbed[0].rows == slice(0, T))
