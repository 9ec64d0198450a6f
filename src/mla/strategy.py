"""Which path serves each sequence of a step: the cost rule (``choose_strategy``, a pure
function of one sequence's lengths) and ``build_plan``, which applies it to a batch and hands
each path's sequences to that path's packer (plan.py). The plan is built once per step
(``Batch.memo``) and shared by every layer.

The cost rule (docs/design.md section 2), per sequence with c cached and n new tokens:

- n == 0: nothing to do.
- c == 0: **prefill**, expanded attention over the n new tokens (causal).
- c > 0 and n <= absorb_max_new(cfg): **absorbed** (latent MQA over the paged cache).
  Per key row the absorbed path costs 2*H*n*(r + dr + r) FLOPs against the expanded
  path's 2*H*(r*(dn + dv) + n*(dn + dr + dv)); they cross at
  n* = r*(dn + dv) / (2r + dr - dn - dr - dv) (170 for DeepSeek-V3: 512*256 / 768).
  Decode rows (1 token, or 1 + k draft tokens) are always below it.
- c > 0, larger n, c <= max_workspace_tokens: **cached**, expanded attention over the
  gathered prefix + new rows (causal, ends aligned). Sequences are packed into passes
  whose prefixes together fit the workspace.
- c > max_workspace_tokens: **chunked**, the prefix expanded chunk by chunk (full mask),
  then the new tokens among themselves (causal), merged by log-sum-exp.
- a config with a sparse indexer (DeepSeek Sparse Attention) and c + n > cfg.sparse_max_keys
  (index_topk; with GLM-5.3-Flash's k-pool indexer index_topk + index_kpool - 1):
  **sparse**, every new token attends to the keys its indexer selects (absorbed form over the
  latent cache, sparse.py). With c + n <= sparse_max_keys every query sees at most that many
  keys, so the selection holds all of them (with k-pool: all its complete pools and its open
  pool's tokens): the dense paths above give the identical result, and serve those sequences.

A batch of decodes only (every sequence absorbed, all with the same s_q) gets the **decode
plan** (``decode_plan``): one absorbed group over all rows, on the batch's own block table and
lengths, with no index tensor built and nothing copied to the device. It is the only plan of a
static batch (a ``mla.StepGraph``'s bucket), whose host lengths are not the replay's: a CUDA
graph replays it whatever the lengths in its buffers. With a sparse indexer a static batch is
sparse throughout instead, one chunk over its own tensors (``_static_plan``).
"""
from __future__ import annotations

import functools

from . import kpool
from .batch import Batch
from .config import MLAConfig
from .plan import (Group, Pass, Plan, SparseChunk, decode_plan, device_ints, pack_absorbed, pack_cached,
                   pack_chunked, pack_prefill, sparse_chunks)

# the plan's structures and packers are plan.py's; the ones the layer's modules use are
# importable from here too
__all__ = ["STRATEGIES", "check_strategy", "absorb_max_new", "choose_strategy", "build_plan", "static_sparse_problem",
           "Plan", "Group", "Pass", "SparseChunk", "decode_plan", "sparse_chunks"]

STRATEGIES = ("prefill", "cached", "chunked", "absorbed", "sparse")


def check_strategy(cfg: MLAConfig, strategy: str | None) -> None:
    """ValueError naming ``strategy`` unless it is None (the rule) or a path that can serve a
    layer of ``cfg``: attention sinks exist in the sparse ops only, and "sparse" needs an indexer."""
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES} or None, got {strategy!r}")
    if cfg.attention_sinks and strategy not in (None, "sparse"):
        raise ValueError(f"strategy: {cfg.name!r} has attention sinks, which only the 'sparse' path serves; "
                         f"expected None or 'sparse', got {strategy!r}")
    if strategy == "sparse" and not cfg.has_indexer:
        raise ValueError(f"strategy: 'sparse' needs a config with a sparse indexer (index_topk), {cfg.name!r} "
                         "has none")


def absorb_max_new(cfg: MLAConfig) -> int:
    """Largest n for which absorbed attention over a cached prefix costs fewer FLOPs."""
    r, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    extra_per_query = 2 * r + dr - (dn + dr + dv)   # absorbed minus expanded attention width
    if extra_per_query <= 0:
        return 1 << 30
    return max(1, (r * (dn + dv)) // extra_per_query)


def choose_strategy(cfg: MLAConfig, num_cached: int, num_new: int, max_workspace_tokens: int,
                    force: str | None = None, cp_size: int = 1) -> str | None:
    """The cost rule (module docstring) for one sequence of c = ``num_cached`` and n = ``num_new``
    tokens: the path that serves it, or None when it brings no tokens. ``force`` (the layer's
    ``strategy``) pins a path for sequences with a cached prefix ("prefill" there would drop the
    prefix; "cached" past the workspace is "chunked"). Under Helix CP (``cp_size`` > 1) a cached
    prefix is never whole on one rank: such a sequence is absorbed, whose partials the ranks
    combine. A sparse config's sequences past sparse_max_keys keys (all of them with ``force``
    "sparse", or with attention sinks, which only the sparse ops take) are sparse."""
    if num_new == 0:
        return None
    if num_cached == 0:
        s = "prefill"
    elif num_new <= absorb_max_new(cfg):
        s = "absorbed"
    else:
        s = "cached" if num_cached <= max_workspace_tokens else "chunked"
    if force is not None and force != "prefill" and num_cached > 0:
        s = "chunked" if force == "cached" and num_cached > max_workspace_tokens else force
    if cp_size > 1 and s in ("cached", "chunked"):
        s = "absorbed"
    if cfg.has_indexer and (num_cached + num_new > cfg.sparse_max_keys or force == "sparse" or cfg.attention_sinks):
        s = "sparse"
    return s


def build_plan(batch: Batch, cfg: MLAConfig, max_workspace_tokens: int, force: str | None = None,
               gathers: bool = True) -> Plan:
    """Assign every sequence its path (``choose_strategy``; ``force`` overrides the rule where it
    applies) and pack each path's sequences into its calls, their index tensors built once.
    ``gathers``: the sparse attention op copies the selected rows (the reference does; the kernel
    reads them in place), see ``sparse_chunks``."""
    if batch.static:
        return _static_plan(batch, cfg, force)
    W, cp_size = max_workspace_tokens, batch.cache.cp_size
    strategy = [choose_strategy(cfg, c, n, W, force, cp_size) for c, n in zip(batch.num_cached, batch.num_new)]
    s_q = batch.num_new[0] if batch.num_new else 0
    if strategy and all(s == "absorbed" for s in strategy) and all(n == s_q for n in batch.num_new) and (
            cp_size == 1 or s_q == 1):
        return decode_plan(batch, s_q)
    by = {s: [b for b, x in enumerate(strategy) if x == s] for s in STRATEGIES}
    plan = Plan(strategy, prefill=pack_prefill(batch, by["prefill"]), cached=pack_cached(batch, by["cached"], W),
                chunked=pack_chunked(batch, by["chunked"], W), absorbed=pack_absorbed(batch, by["absorbed"]))
    if by["sparse"]:
        ints = functools.partial(device_ints, device=batch.device)
        plan.sparse = sparse_chunks(batch, cfg, by["sparse"], W, ints, gathers)
        if cfg.index_kpool is not None:
            plan.pools = kpool.pool_plan(batch, cfg, by["sparse"], plan.sparse, W, ints)
    return plan


def static_sparse_problem(cfg: MLAConfig, cache) -> str | None:
    """Why a static (CUDA-graph) decode batch of a sparse-indexer config over ``cache`` cannot be
    served, or None. It is served on the sparse path for every sequence, whatever its length (a
    sequence within sparse_max_keys keys gets all of them: the dense paths' result), over the
    batch's own tensors; what needs host lengths is refused: the k-pool indexer (its pool
    tables) and Helix CP (each rank's key counts)."""
    if cfg.index_kpool is not None:
        return f"{cfg.name!r} has the k-pool indexer, whose pool tables are built from host lengths"
    if cache.cp_size > 1:
        return f"Helix CP (cp_size {cache.cp_size}) with a sparse indexer needs each rank's key counts on the host"
    return None


def _static_plan(batch: Batch, cfg: MLAConfig, force: str | None) -> Plan:
    """The decode plan of a static batch, or a ValueError where the rule would choose another
    path for some lengths (the plan of a CUDA graph cannot depend on them). With a sparse indexer
    every sequence is sparse: one chunk over the batch's tensors, the logits as wide as its
    block table (``static_sparse_problem`` says what is refused)."""
    s_q = batch.num_new[0]
    if force not in (None, "absorbed", "prefill", "sparse"):   # "prefill" never applies over a cached prefix
        raise ValueError(f"strategy: a static (CUDA-graph) decode batch runs the absorbed (or, with a sparse "
                         f"indexer, the sparse) path, the layer forces {force!r}; expected None, 'absorbed' or "
                         "'sparse'")
    if s_q > absorb_max_new(cfg) or (batch.cache.cp_size > 1 and s_q > 1):
        raise ValueError(f"batch: a static batch of s_q={s_q} is not a decode batch the absorbed path serves alone "
                         f"(s_q <= {absorb_max_new(cfg)}, and 1 under Helix CP)")
    if not cfg.has_indexer:
        return decode_plan(batch, s_q)
    problem = static_sparse_problem(cfg, batch.cache)
    if problem:
        raise ValueError(f"batch: a static (CUDA-graph) batch cannot serve this sparse layer: {problem}")
    B = batch.num_seqs
    chunk = SparseChunk(seqs=list(range(B)), rows=slice(0, B * s_q), block_table=batch.block_table,
                        cache_seqlens=batch.cache_seqlens, cu_seqlens_q=batch.cu_seqlens_q,
                        max_seqlen_k=batch.block_table.shape[1] * batch.block_size, num_rows=B * s_q)
    return Plan(["sparse"] * B, sparse=[chunk])


