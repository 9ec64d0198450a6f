"""The public ops as ``torch.library`` custom ops (``torch.ops.mla.*``), so ``torch.compile`` and
CUDA graphs see each one as a single opaque call with known output shapes.

Each op here is the body a public wrapper in ``mla.ops`` runs after its argument checks: the
checks that read tensor *values* (lengths, block ids, offsets, slots; CPU tensors only), then
the choice between the op's kernel module and the reference (``backend.use_kernels``, then the
inputs the module serves: its ``CACHE_FORMATS`` and the like), the checks that depend on that
choice (bfloat16 kernels refused under Triton's interpreter), and the kernel or reference call.
Kernel modules are imported inside the op that runs them: Triton is optional, and ``import mla``
does not compile or import any kernel. The value checks live in
the op rather than in the wrapper because the wrapper also runs while ``torch.compile`` traces,
on FakeTensors that hold no values; inside the op they run whenever the op runs, eagerly or
from a compiled graph, before anything is written. Each op has a fake implementation that
allocates the outputs' shapes and dtypes and computes nothing (the only thing a trace needs).
A plain eager call runs the body without the dispatcher (``_Op``).

Arguments are the op's tensors plus host values of the types a ``torch.library`` schema holds
(int, float, bool, str, int[], ScalarType, each optionally None). Outputs are fresh contiguous
tensors (the fake implementations promise it, so every backend returns it). ``rope_append`` and
``rope`` write their inputs: they declare them in ``mutates_args`` (q_pe, k_pe, kv_cache, q_out).
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.library import custom_op

from .. import quant
from . import reference
from ._checks import (check, check_apart, check_gather_values, check_index_values, check_interpretable,
                      check_paged_values, check_writable, host_offsets)
from .backend import use_kernels

__all__ = ["mla_decode", "prefill_attention", "fp8_prefill_attention", "merge_attention", "rms_norm", "rms_norm_pair",
           "rope", "rope_append",
           "gather_latent", "quantize_act_1x128", "quantize_rows_fp8", "fp8_linear", "fp8_bmm", "indexer_logits", "topk_indices",
           "sparse_mla_decode", "sparse_prefill_attention", "OPS"]


class _Op:
    """One public op: its body ``fn``, registered as the custom op ``name``. A call runs the body
    itself in plain eager use, and the registered op wherever something traces or transforms the
    call: ``torch.compile``, a dispatch mode (FakeTensorMode, export's), a tensor subclass, or
    autograd over an input that requires a gradient (the op has no backward, and says so). Both
    run the same code; the dispatcher's Python layers around it cost about as much as the body
    of a small op (some 60 us a call on a CPU), where an eager decode step makes a few a layer."""

    def __init__(self, name: str, fn, mutates_args):
        self.body = fn
        self.op = custom_op(name, fn, mutates_args=mutates_args)
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __call__(self, *args):
        return self.body(*args) if _direct(args) else self.op(*args)

    def register_fake(self, fn):
        return self.op.register_fake(fn)


def _op(name: str, *, mutates_args):
    return lambda fn: _Op(name, fn, mutates_args)


def _direct(args) -> bool:
    """Whether a call may skip the dispatcher (``_Op``): nothing compiling or in a dispatch mode,
    every tensor argument a plain tensor (or parameter) that autograd does not follow."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if isinstance(a, Tensor) and ((type(a) is not Tensor and type(a) is not torch.nn.Parameter)
                                      or (grad and a.requires_grad)):
            return False
    return True


def _fresh(*tensors: Tensor):
    """Outputs as the fake implementations describe them: contiguous (a no-op for most kernels;
    the reference's partial-group quantization returns a column slice of a padded buffer)."""
    return tuple(t.contiguous() for t in tensors)


# ---- attention ------------------------------------------------------------------------------

@_op("mla::mla_decode", mutates_args=())
def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, head_dim_v: int,
               softmax_scale: float, causal: bool, kv_scale: float, backend: Optional[str],
               pdl: bool) -> Tuple[Tensor, Tensor]:
    check_paged_values(block_table, cache_seqlens, kv_cache.shape[0], kv_cache.shape[1])
    fmt = quant.cache_format(kv_cache)
    kv_scale = 1.0 if fmt == "plain" else kv_scale      # plain rows hold the values themselves
    if use_kernels(backend, q.device):
        from . import decode
        if fmt in decode.CACHE_FORMATS:
            check_interpretable("mla_decode", False, q.device, q, kv_cache)
            return _fresh(*decode.mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                             causal, kv_scale, pdl=pdl))
    return _fresh(*reference.mla_decode(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                                        kv_scale))


@mla_decode.register_fake
def _(q, kv_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, kv_scale, backend, pdl):
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, head_dim_v), q.new_empty(B, s_q, H, dtype=torch.float32)


@_op("mla::prefill_attention", mutates_args=())
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      softmax_scale: float, causal: bool, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                      offsets_q: Optional[List[int]], offsets_k: Optional[List[int]], backend: Optional[str],
                      kernel: Optional[str]) -> Tuple[Tensor, Tensor]:
    return _fresh(*run_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q,
                               max_seqlen_k, offsets_q, offsets_k, backend, kernel, None))


@prefill_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q, max_seqlen_k, offsets_q,
      offsets_k, backend, kernel):
    return q.new_empty(*q.shape[:2], v.shape[-1]), q.new_empty(q.shape[:2], dtype=torch.float32)


def run_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q, max_seqlen_k,
                offsets_q, offsets_k, backend, kernel, workspace):
    """The body of ``mla::prefill_attention``; called directly (outside torch.library) with a
    FlashInfer workspace object, which no op schema can hold."""
    is_reference = not use_kernels(backend, q.device)
    check_interpretable("prefill_attention", is_reference, q.device, q, k, v)
    check(kernel is None or not is_reference,
          lambda: f"kernel: expected None, or 'flashinfer', 'cudnn' or 'triton' with backend 'triton', got {kernel!r}")
    if q.device.type == "cpu" or is_reference:
        # The offsets' values, checked on the one host copy this path makes anyway: free on CPU,
        # and the reference reads them back on CUDA too (it takes this copy instead). The CUDA
        # kernels' path copies none of them to the host, so there they are the caller's, as
        # offsets_q/k are: checking them would add a stream sync.
        offsets_q = host_offsets("cu_seqlens_q", cu_seqlens_q, "Tq", q.shape[0], "offsets_q", offsets_q)
        offsets_k = host_offsets("cu_seqlens_k", cu_seqlens_k, "Tk", k.shape[0], "offsets_k", offsets_k)
    B = cu_seqlens_q.shape[0] - 1
    if offsets_q is not None and max_seqlen_q is None:
        max_seqlen_q = max(b - a for a, b in zip(offsets_q, offsets_q[1:])) if B else 0
    if offsets_k is not None and max_seqlen_k is None:
        max_seqlen_k = max(b - a for a, b in zip(offsets_k, offsets_k[1:])) if B else 0
    if is_reference:
        return reference.prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q,
                                           max_seqlen_k, offsets_q, offsets_k)
    from . import prefill
    return prefill.prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, max_seqlen_q,
                                     max_seqlen_k, offsets_q, offsets_k, kernel=kernel, workspace=workspace)


@_op("mla::fp8_prefill_attention", mutates_args=())
def fp8_prefill_attention(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor, v_scale: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, softmax_scale: float, causal: bool, offsets_q: Optional[List[int]],
                          offsets_k: Optional[List[int]], backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    is_reference = not use_kernels(backend, q.device)
    check_interpretable("fp8_prefill_attention", is_reference, q.device, q)
    if q.device.type == "cpu" or is_reference:   # as run_prefill: the host copy this path makes anyway
        offsets_q = host_offsets("cu_seqlens_q", cu_seqlens_q, "Tq", q.shape[0], "offsets_q", offsets_q)
        offsets_k = host_offsets("cu_seqlens_k", cu_seqlens_k, "Tk", k.shape[0], "offsets_k", offsets_k)
    if is_reference:
        return _fresh(*reference.fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k,
                                                       softmax_scale, causal, offsets_q, offsets_k))
    from . import prefill
    return _fresh(*prefill.fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k,
                                                 softmax_scale, causal))


@fp8_prefill_attention.register_fake
def _(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, offsets_q, offsets_k, backend):
    return q.new_empty(*q.shape[:2], v.shape[-1]), q.new_empty(q.shape[:2], dtype=torch.float32)


@_op("mla::merge_attention", mutates_args=())
def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor,
                    backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    if use_kernels(backend, out_a.device):
        from . import merge
        return _fresh(*merge.merge_attention(out_a, lse_a, out_b, lse_b))
    return _fresh(*reference.merge_attention(out_a, lse_a, out_b, lse_b))


@merge_attention.register_fake
def _(out_a, lse_a, out_b, lse_b, backend):
    return torch.empty_like(out_a, memory_format=torch.contiguous_format), \
        torch.empty_like(lse_a, memory_format=torch.contiguous_format)


@_op("mla::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, backend: Optional[str]) -> Tensor:
    if use_kernels(backend, x.device):
        from . import norm
        if x.shape[-1] <= norm.MAX_COLUMNS:
            return _fresh(norm.rms_norm(x, weight, eps))[0]
    return _fresh(reference.rms_norm(x, weight, eps))[0]


@rms_norm.register_fake
def _(x, weight, eps, backend):
    return x.new_empty(x.shape)


@_op("mla::rms_norm_pair", mutates_args=())
def rms_norm_pair(x1: Tensor, weight1: Tensor, eps1: float, x2: Tensor, weight2: Tensor, eps2: float,
                  backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    if use_kernels(backend, x1.device):
        from . import norm
        if max(x1.shape[-1], x2.shape[-1]) <= norm.MAX_COLUMNS:
            return _fresh(*norm.rms_norm_pair(x1, weight1, eps1, x2, weight2, eps2))
    return _fresh(*reference.rms_norm_pair(x1, weight1, eps1, x2, weight2, eps2))


@rms_norm_pair.register_fake
def _(x1, weight1, eps1, x2, weight2, eps2, backend):
    return x1.new_empty(x1.shape), x2.new_empty(x2.shape)


# ---- the latent cache -----------------------------------------------------------------------

@_op("mla::rope", mutates_args=("q_pe", "k_pe"))
def rope(q_pe: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, interleave: bool, backend: Optional[str]) -> None:
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe)):
        check_writable(name, t)
    if use_kernels(backend, q_pe.device):
        from . import cache_append
        if cache_append.rope_takes(q_pe, k_pe):
            cache_append.rope(q_pe, k_pe, cos, sin, interleave)
            return
    reference.rope(q_pe, k_pe, cos, sin, interleave)


@rope.register_fake
def _(q_pe, k_pe, cos, sin, interleave, backend):
    return None


@_op("mla::rope_append", mutates_args=("q_pe", "k_pe", "kv_cache", "q_out"))
def rope_append(q_pe: Tensor, k_pe: Tensor, c_kv: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor,
                slot_mapping: Tensor, interleave: bool, kv_scale: float, backend: Optional[str],
                q_out: Optional[Tensor]) -> None:
    q_written = ("q_pe", q_pe) if q_out is None else ("q_out", q_out)
    for name, t in (q_written, ("k_pe", k_pe), ("kv_cache", kv_cache)):
        check_writable(name, t)
    if q_out is not None:
        check_apart("q_out", q_out, "q_pe", q_pe)
    if slot_mapping.device.type == "cpu":   # on CUDA the slots are the caller's (no stream sync)
        slots = kv_cache.shape[0] * kv_cache.shape[1]
        bad = (slot_mapping >= slots).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"slot_mapping: expected slots < {slots} (num_blocks * block_size) or negative "
                             f"(skipped), got {slot_mapping[bad[0]].item()} at index {bad[0]}")
    fmt = quant.cache_format(kv_cache)
    kv_scale = 1.0 if fmt == "plain" else kv_scale
    if use_kernels(backend, kv_cache.device):
        from . import cache_append
        if fmt in cache_append.CACHE_FORMATS and cache_append.rope_append_takes(q_pe, c_kv, kv_cache):
            cache_append.rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale,
                                     q_out=q_out)
            return
    reference.rope_append(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale, q_out=q_out)


@rope_append.register_fake
def _(q_pe, k_pe, c_kv, cos, sin, kv_cache, slot_mapping, interleave, kv_scale, backend, q_out):
    return None


@_op("mla::gather_latent", mutates_args=())
def gather_latent(kv_cache: Tensor, block_table: Tensor, starts: Tensor, cu_seqlens: Tensor, num_tokens: int,
                  backend: Optional[str]) -> Tensor:
    check_gather_values(block_table, starts, cu_seqlens, num_tokens, kv_cache.shape[0], kv_cache.shape[1])
    if use_kernels(backend, kv_cache.device):
        from . import gather
        return gather.gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens).contiguous()
    return reference.gather_latent(kv_cache, block_table, starts, cu_seqlens, num_tokens).contiguous()


@gather_latent.register_fake
def _(kv_cache, block_table, starts, cu_seqlens, num_tokens, backend):
    return kv_cache.new_empty(num_tokens, kv_cache.shape[-1])


# ---- block-scaled FP8 GEMMs -----------------------------------------------------------------

@_op("mla::quantize_act_1x128", mutates_args=())
def quantize_act_1x128(x: Tensor, backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    if use_kernels(backend, x.device):
        from . import fp8_gemm
        return _fresh(*fp8_gemm.quantize_act_1x128(x))
    return _fresh(*reference.quantize_act_1x128(x))


@quantize_act_1x128.register_fake
def _(x, backend):
    M, K = x.shape
    return x.new_empty(M, K, dtype=torch.float8_e4m3fn), x.new_empty(M, (K + 127) // 128, dtype=torch.float32)


@_op("mla::quantize_rows_fp8", mutates_args=())
def quantize_rows_fp8(x: Tensor, backend: Optional[str]) -> Tuple[Tensor, Tensor]:
    if use_kernels(backend, x.device):      # no dot product: bfloat16 is right under the interpreter too
        from . import fp8_gemm
        return _fresh(*fp8_gemm.quantize_rows_fp8(x))
    return _fresh(*reference.quantize_rows_fp8(x))


@quantize_rows_fp8.register_fake
def _(x, backend):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:-1], dtype=torch.float32)


@_op("mla::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, out_dtype: torch.dtype,
               backend: Optional[str]) -> Tensor:
    if use_kernels(backend, x.device):
        from . import fp8_gemm
        return fp8_gemm.fp8_linear(x, weight, weight_scale_inv, out_dtype).contiguous()
    return reference.fp8_linear(x, weight, weight_scale_inv, out_dtype).contiguous()


@fp8_linear.register_fake
def _(x, weight, weight_scale_inv, out_dtype, backend):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)


@_op("mla::fp8_bmm", mutates_args=())
def fp8_bmm(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, out_dtype: torch.dtype,
            backend: Optional[str]) -> Tensor:
    if use_kernels(backend, x.device):
        from . import fp8_gemm
        return fp8_gemm.fp8_bmm(x, weight, weight_scale_inv, out_dtype).contiguous()
    return reference.fp8_bmm(x, weight, weight_scale_inv, out_dtype).contiguous()


@fp8_bmm.register_fake
def _(x, weight, weight_scale_inv, out_dtype, backend):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[1], dtype=out_dtype)


# ---- sparse MLA -----------------------------------------------------------------------------

@_op("mla::indexer_logits", mutates_args=())
def indexer_logits(q: Tensor, weights: Tensor, index_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
                   cu_seqlens_q: Tensor, max_seqlen_k: int, softmax_scale: float, causal: bool,
                   backend: Optional[str] = None) -> Tensor:
    check_paged_values(block_table, cache_seqlens, index_cache.shape[0], index_cache.shape[1])
    if q.device.type == "cpu":
        cq = host_offsets("cu_seqlens_q", cu_seqlens_q, "Tq", q.shape[0], "offsets_q", None)
        for b, n in enumerate(cache_seqlens.tolist()):
            check(n <= max_seqlen_k,
                  lambda: f"max_seqlen_k: expected >= every cache_seqlens, got {max_seqlen_k} < {n} (sequence {b})")
            check(not causal or n == 0 or cq[b + 1] - cq[b] <= n,
                  lambda: f"cache_seqlens: expected each sequence's keys to include its {cq[b + 1] - cq[b]} "
                          f"queries (causal), or 0 (a padding sequence: its queries see none), got {n} for "
                          f"sequence {b}")
    if use_kernels(backend, q.device):
        check_interpretable("indexer_logits", False, q.device, q, index_cache)
        from . import indexer
        return indexer.indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k,
                                      softmax_scale, causal).contiguous()
    return reference.indexer_logits(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k,
                                    softmax_scale, causal).contiguous()


@indexer_logits.register_fake
def _(q, weights, index_cache, block_table, cache_seqlens, cu_seqlens_q, max_seqlen_k, softmax_scale, causal,
      backend=None):
    return q.new_empty(q.shape[0], max_seqlen_k, dtype=torch.float32)


@_op("mla::topk_indices", mutates_args=())
def topk_indices(logits: Tensor, topk: int, block_table: Tensor, cu_seqlens_q: Tensor, block_size: int,
                 backend: Optional[str] = None) -> Tensor:
    if logits.device.type == "cpu":
        host_offsets("cu_seqlens_q", cu_seqlens_q, "Tq", logits.shape[0], "offsets_q", None)
    if use_kernels(backend, logits.device):
        from . import indexer
        return indexer.topk_indices(logits, topk, block_table, cu_seqlens_q, block_size).contiguous()
    return reference.topk_indices(logits, topk, block_table, cu_seqlens_q, block_size).contiguous()


@topk_indices.register_fake
def _(logits, topk, block_table, cu_seqlens_q, block_size, backend=None):
    return logits.new_empty(logits.shape[0], topk, dtype=torch.int32)


@_op("mla::sparse_mla_decode", mutates_args=())
def sparse_mla_decode(q: Tensor, kv_cache: Tensor, indices: Tensor, head_dim_v: int, softmax_scale: float,
                      kv_scale: float, attn_sink: Optional[Tensor] = None,
                      backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    check_index_values("indices", indices, kv_cache.shape[0] * kv_cache.shape[1])
    if use_kernels(backend, q.device):
        from . import sparse_attention
        if quant.cache_format(kv_cache) in sparse_attention.CACHE_FORMATS:
            check_interpretable("sparse_mla_decode", False, q.device, q, kv_cache)
            return _fresh(*sparse_attention.sparse_mla_decode(q, kv_cache, indices, head_dim_v, softmax_scale,
                                                              kv_scale, attn_sink))
    return _fresh(*reference.sparse_mla_decode(q, kv_cache, indices, head_dim_v, softmax_scale, kv_scale, attn_sink))


@sparse_mla_decode.register_fake
def _(q, kv_cache, indices, head_dim_v, softmax_scale, kv_scale, attn_sink=None, backend=None):
    B, s_q, H, _ = q.shape
    return q.new_empty(B, s_q, H, head_dim_v), q.new_empty(B, s_q, H, dtype=torch.float32)


@_op("mla::sparse_prefill_attention", mutates_args=())
def sparse_prefill_attention(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int,
                             attn_sink: Optional[Tensor] = None,
                             backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    check_index_values("indices", indices, kv.shape[0])
    if use_kernels(backend, q.device):
        check_interpretable("sparse_prefill_attention", False, q.device, q, kv)
        from . import sparse_attention
        return _fresh(*sparse_attention.sparse_prefill_attention(q, kv, indices, sm_scale, d_v, attn_sink))
    return _fresh(*reference.sparse_prefill_attention(q, kv, indices, sm_scale, d_v, attn_sink))


@sparse_prefill_attention.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink=None, backend=None):
    return q.new_empty(q.shape[0], q.shape[1], d_v), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


# name -> the registered op (torch.ops.mla.<name>.default): what tests run opcheck on
OPS = {name: getattr(torch.ops.mla, name).default for name in __all__[:-1]}
