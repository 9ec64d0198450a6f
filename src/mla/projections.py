"""What an MLA family changes around the attention, picked once when a layer is built: the
query projection and the output gate. Notation as in layer.py.

Query projections (``query_projection(cfg)``), each from the layer's first GEMM
``a = x @ [W_q | W_kva]^T`` to the step's q [T, H, dn + dr], normed c_kv [T, r] and unrotated
k_pe [T, dr]:

    LiteQuery          q = q_proj(x)                                        DeepSeek-V2-Lite
    LowRankQuery       q = q_b_proj(rmsnorm(q_a))                           DeepSeek-V2/V3 and most
    FusedQueryGate     [q | gate] = q_gate_proj(cat(rmsnorm(q_a), q_a))     A.X-K2: per head the
                                                                            query, then dv gate logits

Output gates (``output_gate(cfg)``), on attn [T, H_s, dv] (this rank's head slice) before o_proj:

    NoGate             attn
    ProjectedGate      attn * sigmoid(gate_proj(x))                         Hy4
    FusedGate          attn * sigmoid(gate), gate from FusedQueryGate       A.X-K2

Each part is stateless: its parameters live on the layer under the names it declares
(``params``), so that other modules and FP8 reloads find them there, and its calls take the layer.
A new family's variant is a new class here and one line in the picker.
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F

from . import ops
from .config import MLAConfig

__all__ = ["Projection", "LiteQuery", "LowRankQuery", "FusedQueryGate", "query_projection",
           "NoGate", "ProjectedGate", "FusedGate", "output_gate"]


class Projection(NamedTuple):
    """What the query projection gives the rest of the step."""
    q: torch.Tensor                    # [T, H, dn + dr]
    q_a: torch.Tensor | None           # rmsnorm(q_a) [T, rq], the sparse indexer's input; None if lite
    c_kv: torch.Tensor                 # rmsnorm(kv_a[:r]) [T, r]
    k_pe: torch.Tensor                 # [T, dr], before RoPE
    gate_logits: torch.Tensor | None   # [T, H, dv] where the query projection makes them (A.X-K2)


# ---- query projections ------------------------------------------------------------------------

class LiteQuery:
    """No query compression: the q rows of the first GEMM are q_proj itself ([H * (dn + dr), D])."""
    hf_name = "q_proj"                 # the checkpoint tensor of the q rows of the first GEMM
    fp8_names: tuple[str, ...] = ()    # projections that may stay FP8 (``MLA.load_hf_state_dict``)

    def q_rows(self, cfg: MLAConfig, H: int) -> int:
        return H * cfg.qk_head_dim

    def params(self, cfg: MLAConfig, H: int) -> dict[str, tuple[int, ...]]:
        return {}

    def load(self, layer, w: Mapping[str, torch.Tensor], kept: Mapping) -> None:
        pass

    def __call__(self, layer, a: torch.Tensor) -> Projection:
        cfg, q_dim, r = layer.cfg, layer.q_dim, layer.cfg.kv_lora_rank
        c_kv = ops.rms_norm(a[:, q_dim: q_dim + r], layer.kv_a_norm, cfg.kv_norm_eps, backend=layer.op_backend)
        q = a[:, :q_dim].reshape(a.shape[0], layer.num_local_heads, cfg.qk_head_dim)
        return Projection(q, None, c_kv, a[:, q_dim + r:], None)


class LowRankQuery:
    """q = q_b_proj(rmsnorm(q_a)): q_a [rq] from the first GEMM, its norm in the same launch as
    c_kv's; q_b_proj [H * (dn + dr), rq] may stay block-FP8 (``fp8_names``)."""
    hf_name = "q_a_proj"
    fp8_names: tuple[str, ...] = ("q_b_proj.weight",)

    def q_rows(self, cfg: MLAConfig, H: int) -> int:
        return cfg.q_lora_rank

    def params(self, cfg: MLAConfig, H: int) -> dict[str, tuple[int, ...]]:
        return {"q_a_norm": (cfg.q_lora_rank,), "w_q_b": (H * cfg.qk_head_dim, cfg.q_lora_rank)}

    def load(self, layer, w: Mapping[str, torch.Tensor], kept: Mapping) -> None:
        layer.q_a_norm.copy_(w["q_a_layernorm.weight"])
        layer.set_weight("w_q_b", w["q_b_proj.weight"], kept.get("q_b_proj.weight"))

    def latents(self, layer, a: torch.Tensor):
        """rmsnorm(q_a) [T, rq] and rmsnorm(c_kv) [T, r], both norms in one launch."""
        cfg, q_dim = layer.cfg, layer.q_dim
        return ops.rms_norm_pair(a[:, :q_dim], layer.q_a_norm, cfg.q_norm_eps,
                                 a[:, q_dim: q_dim + cfg.kv_lora_rank], layer.kv_a_norm, cfg.kv_norm_eps,
                                 backend=layer.op_backend)

    def __call__(self, layer, a: torch.Tensor) -> Projection:
        cfg = layer.cfg
        q_a, c_kv = self.latents(layer, a)
        q = layer.linear(q_a, layer.w_q_b, layer.w_q_b_scale)
        q = q.reshape(a.shape[0], layer.num_local_heads, cfg.qk_head_dim)
        return Projection(q, q_a, c_kv, a[:, layer.q_dim + cfg.kv_lora_rank:], None)


class FusedQueryGate(LowRankQuery):
    """A.X-K2: no q_b_proj; q_gate_proj [H * (dn + dr + dv), 2 * rq] over cat(rmsnorm(q_a), q_a)
    gives per head the query, then the output gate's dv logits (``FusedGate``). Its weight is
    kept in the layer's dtype: a fused FP8 GEMM of it is not implemented."""
    fp8_names: tuple[str, ...] = ()

    def params(self, cfg: MLAConfig, H: int) -> dict[str, tuple[int, ...]]:
        return {"q_a_norm": (cfg.q_lora_rank,),
                "w_q_b": (H * (cfg.qk_head_dim + cfg.v_head_dim), 2 * cfg.q_lora_rank)}

    def load(self, layer, w: Mapping[str, torch.Tensor], kept: Mapping) -> None:
        layer.q_a_norm.copy_(w["q_a_layernorm.weight"])
        layer.set_weight("w_q_b", w["q_gate_proj.weight"], None)

    def __call__(self, layer, a: torch.Tensor) -> Projection:
        cfg, dq = layer.cfg, layer.cfg.qk_head_dim
        q_a, c_kv = self.latents(layer, a)
        qg = layer.linear(torch.cat((q_a, a[:, : layer.q_dim]), -1), layer.w_q_b, layer.w_q_b_scale)
        qg = qg.reshape(a.shape[0], layer.num_local_heads, dq + cfg.v_head_dim)
        return Projection(qg[..., :dq].contiguous(), q_a, c_kv, a[:, layer.q_dim + cfg.kv_lora_rank:],
                          qg[..., dq:])


def query_projection(cfg: MLAConfig) -> LiteQuery:
    """The config's query projection."""
    if cfg.q_lora_rank is None:
        return LiteQuery()
    return FusedQueryGate() if cfg.q_gate_fused else LowRankQuery()


# ---- output gates -----------------------------------------------------------------------------

class NoGate:
    """No gate: attention output straight to o_proj."""

    def params(self, cfg: MLAConfig, H_s: int) -> dict[str, tuple[int, ...]]:
        return {}

    def load(self, layer, w: Mapping[str, torch.Tensor]) -> None:
        pass

    def __call__(self, layer, hidden_states: torch.Tensor, attn: torch.Tensor,
                 gate_logits: torch.Tensor | None) -> torch.Tensor:
        return attn


class ProjectedGate(NoGate):
    """Hy4: attn * sigmoid(gate_proj(x)), gate_proj.weight [H * dv, D] sharded to this rank's head
    slice (``w_gate`` [H_s * dv, D]). Under Helix CP it gates the slice after the exchange: a
    per-head, per-token factor commutes with the LSE combine."""

    def params(self, cfg: MLAConfig, H_s: int) -> dict[str, tuple[int, ...]]:
        return {"w_gate": (H_s * cfg.v_head_dim, cfg.hidden_size)}

    def load(self, layer, w: Mapping[str, torch.Tensor]) -> None:
        layer.w_gate.copy_(w["gate_proj.weight"])

    def __call__(self, layer, hidden_states, attn, gate_logits):
        return attn * torch.sigmoid(F.linear(hidden_states, layer.w_gate).view(attn.shape))


class FusedGate(NoGate):
    """A.X-K2: attn * sigmoid(gate) with the gate logits [T, H, dv] of ``FusedQueryGate`` (this
    rank's head slice of them), in float32 as its module computes it."""

    def __call__(self, layer, hidden_states, attn, gate_logits):
        gate = gate_logits[:, layer.slice_start: layer.slice_start + layer.num_slice_heads]
        return (attn.float() * torch.sigmoid(gate.float())).to(attn.dtype)


def output_gate(cfg: MLAConfig) -> NoGate:
    """The config's output gate."""
    if cfg.output_gate is None:
        return NoGate()
    return FusedGate() if cfg.q_gate_fused else ProjectedGate()
