"""Tensor and Helix context parallelism on torch.distributed (NCCL on GPUs, gloo on CPU).

Ranks are laid out ``rank = cp_rank * tp_size + tp_rank``. Every rank gets the same
batch and returns the full ``[tokens, hidden]`` output.

- TP: the H heads split into tp_size groups of H_tp = H / tp_size. q_b_proj (or q_proj)
  and kv_b_proj are column-parallel by heads; q_a_proj, kv_a_proj_with_mqa and the norms
  are replicated, and so is the latent cache (one latent row per token serves all heads).
- Helix CP: each CP rank stores whole blocks of every sequence, block j on cp rank
  j % cp_size, so a long context's cache is split cp_size ways. Absorbed attention runs
  on every rank over its share for all H_tp heads, with LSE; an all-to-all in the CP
  group hands each rank the partials of its slice of H_s = H_tp / cp_size heads, which an
  LSE combine finishes. W_UV is applied before the exchange (it commutes with the
  combine), so dv instead of r values per head cross the wire. Prompts with no cached
  prefix compute their head slice directly. o_proj is row-parallel over all tp * cp
  ranks: each rank holds the columns of its head slice, and one all-reduce sums them.
- Attention DP needs none of this: each rank runs its own batch on its own cache with
  ``parallel=None`` (TP 1 inside attention); the caller gathers around the MoE.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import MLAConfig
from .weights import FP8_BLOCK

__all__ = ["Parallel", "shard_hf_weights", "shard_block_fp8"]


@dataclass(frozen=True)
class Parallel:
    tp_size: int = 1
    cp_size: int = 1
    rank: int | None = None          # rank within `group`; default: this process's rank there
    group: object | None = None      # default: the default process group, of size tp_size * cp_size
    v_before_exchange: bool = True   # Helix: apply W_UV before the all-to-all (dv, not r, per head)
    # counters for monitoring (bytes this rank sent in Helix exchanges), not switches
    stats: dict = field(default_factory=lambda: {"exchange_bytes": 0}, compare=False, repr=False)

    def __post_init__(self):
        for name in ("tp_size", "cp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        world = self.tp_size * self.cp_size
        if world > 1 or self.group is not None or self.rank is not None:
            if not dist.is_initialized():
                raise ValueError("parallel: torch.distributed is not initialized (init_process_group first)")
            size = dist.get_world_size(self.group)
            if size != world:
                raise ValueError(f"group: expected size tp_size * cp_size = {world}, got {size}")
        rank = self.rank
        if rank is None:
            rank = dist.get_rank(self.group) if world > 1 else 0
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank: expected an int in 0..{world - 1}, got {rank!r}")
        object.__setattr__(self, "rank", rank)
        tp_group = cp_group = None
        if world > 1:   # every rank creates every subgroup, in the same order
            glob = [dist.get_global_rank(self.group, i) if self.group is not None else i for i in range(world)]
            for c in range(self.cp_size):
                g = dist.new_group([glob[c * self.tp_size + t] for t in range(self.tp_size)])
                if c == self.cp_rank:
                    tp_group = g
            for t in range(self.tp_size):
                g = dist.new_group([glob[c * self.tp_size + t] for c in range(self.cp_size)])
                if t == self.tp_rank:
                    cp_group = g
        object.__setattr__(self, "tp_group", tp_group)
        object.__setattr__(self, "cp_group", cp_group)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp_size

    def check_config(self, cfg: MLAConfig) -> None:
        """ValueError naming ``parallel`` where a layer of ``cfg`` cannot be split this way: heads
        that do not split evenly over tp_size and then cp_size, and the features whose sharding
        is not implemented (A.X-K2's fused q_gate_proj; Helix CP of the k-pool indexer)."""
        H = cfg.num_heads
        if H % self.tp_size or (H // self.tp_size) % self.cp_size:
            raise ValueError(f"parallel: num_heads={H} must split evenly over tp_size={self.tp_size} "
                             f"and then cp_size={self.cp_size}")
        if cfg.q_gate_fused:
            raise ValueError(f"parallel: {cfg.name!r} has a fused q_gate_proj (A.X-K2), whose TP/CP sharding mla "
                             "does not implement; expected parallel=None")
        if cfg.index_kpool is not None and self.cp_size > 1:
            raise ValueError(f"parallel: cp_size {self.cp_size} with {cfg.name!r}'s k-pool indexer (index_kpool): "
                             "Helix CP of the pooled selection is not implemented; expected cp_size 1")

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over all tp * cp ranks (o_proj is row-parallel over all of them)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def helix_exchange(self, out: torch.Tensor, lse: torch.Tensor):
        """out [T, H_tp, d], lse [T, H_tp] float32: partials over this rank's share of the keys.

        All-to-all in the CP group: rank j receives every rank's partials of head slice j.
        Returns (out [cp, T, H_s, d], lse [cp, T, H_s]) to be combined by LSE.
        """
        cp, T, H_tp, d = self.cp_size, out.shape[0], out.shape[1], out.shape[2]
        hs = H_tp // cp
        # [cp, T, hs, ...]: the slice for CP rank j first along dim 0
        send_o = out.view(T, cp, hs, d).transpose(0, 1).contiguous()
        send_l = lse.view(T, cp, hs).transpose(0, 1).contiguous()
        recv_o, recv_l = torch.empty_like(send_o), torch.empty_like(send_l)
        dist.all_to_all_single(recv_o, send_o, group=self.cp_group)
        dist.all_to_all_single(recv_l, send_l, group=self.cp_group)
        # bytes this rank sends to the others (its own slice stays)
        self.stats["exchange_bytes"] += (cp - 1) * T * hs * (d * out.element_size() + lse.element_size())
        return recv_o, recv_l

    def cp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] -> [cp_size, ...]: every CP rank's x (the same shape on all), in CP rank order
        (Helix sparse MLA gathers each rank's top-k candidates this way)."""
        parts = [torch.empty_like(x) for _ in range(self.cp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.cp_group)
        return torch.stack(parts)


def _share(name: str, shape, cfg: MLAConfig, parallel: Parallel):
    """(dim, start, stop) of this rank's share of a full weight, or None where it is replicated:
    q_b_proj/q_proj/kv_b_proj rows and sinks of its TP heads, o_proj columns and gate_proj rows of
    its head slice."""
    H, tp, cp = cfg.num_heads, parallel.tp_size, parallel.cp_size
    H_tp, H_s = H // tp, H // tp // cp
    h0 = parallel.tp_rank * H_tp
    s0 = h0 + parallel.cp_rank * H_s
    if name in ("q_b_proj.weight", "q_proj.weight", "kv_b_proj.weight"):
        per = shape[0] // H
        return 0, h0 * per, (h0 + H_tp) * per
    if name == "o_proj.weight":
        return 1, s0 * cfg.v_head_dim, (s0 + H_s) * cfg.v_head_dim
    if name == "gate_proj.weight":   # gates the head slice's attention output, as o_proj reads it
        return 0, s0 * cfg.v_head_dim, (s0 + H_s) * cfg.v_head_dim
    if name == "sinks":              # the sparse attention runs this rank's TP heads
        return 0, h0, h0 + H_tp
    return None


def shard_hf_weights(w: dict[str, torch.Tensor], cfg: MLAConfig, parallel: Parallel | None) -> dict[str, torch.Tensor]:
    """Slice full (dequantized) weights to this rank's share (``_share``); the rest replicated."""
    if parallel is None or parallel.world_size == 1:
        return w
    out = dict(w)
    for name, t in w.items():
        share = _share(name, t.shape, cfg, parallel)
        if share is not None:
            dim, start, stop = share
            out[name] = t.narrow(dim, start, stop - start)
    return out


def shard_block_fp8(name: str, weight: torch.Tensor, scale: torch.Tensor, cfg: MLAConfig,
                    parallel: Parallel | None, block: int = FP8_BLOCK):
    """This rank's share of a block-FP8 weight and of its [ceil(out/block), ceil(in/block)]
    scales, or None where the share does not begin and end on block edges (then the caller
    dequantizes: a block's scale cannot be split)."""
    if parallel is None or parallel.world_size == 1:
        return weight, scale
    share = _share(name, weight.shape, cfg, parallel)
    if share is None:
        return weight, scale
    dim, start, stop = share
    if start % block or (stop % block and stop != weight.shape[dim]):
        return None
    b0, b1 = start // block, -(-stop // block)
    return weight.narrow(dim, start, stop - start), scale.narrow(dim, b0, b1 - b0)
