"""Varlen packed attention with log-sum-exp (the expanded path): the one dispatch that chooses
the kernel.

Kernels (``KERNELS``), in the order the rule tries them:

    flashinfer   FlashInfer's fa3 ragged prefill (``peers``): where it is installed, the caller
                 gives the offsets on the host and the shapes are ones it serves
                 (``peers.use_flashinfer``); the fastest on the H200
    cudnn        PyTorch's cuDNN attention (``peers``): equal-length batches with no prefix,
                 16-bit, compute capability >= 9.0 (``peers.use_cudnn``)
    triton       the Triton kernel (``triton``): everything, on any GPU and on CPU (interpreter)

The reference stays behind all three in ``mla.ops.reference``.
"""
from __future__ import annotations

from . import peers
from . import triton as triton_kernel
from .peers import DEFAULT_WORKSPACE, FlashInferWorkspace

__all__ = ["prefill_attention", "fp8_prefill_attention", "choose_kernel", "KERNELS", "FlashInferWorkspace",
           "DEFAULT_WORKSPACE"]

KERNELS = ("flashinfer", "cudnn", "triton")


def choose_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, max_seqlen_q=None, max_seqlen_k=None,
                  offsets_q=None, offsets_k=None) -> str:
    """The rule: the first of ``KERNELS`` that serves these inputs."""
    if peers.use_flashinfer(q, k, v, causal, offsets_q, offsets_k):
        return "flashinfer"
    if peers.use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return "cudnn"
    return "triton"


def prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True, max_seqlen_q=None,
                      max_seqlen_k=None, offsets_q=None, offsets_k=None, *, kernel: str | None = None,
                      workspace: FlashInferWorkspace | None = None):
    """Varlen packed attention with LSE (see ``mla.ops.reference.prefill_attention``).

    q [Tq, H, dq], k [Tk, H, dq], v [Tk, H, dv]; cu_seqlens_q/k [B + 1] int32 (from 0);
    offsets_q/k: the same offsets as host ints, or None. Returns out [Tq, H, dv] in q's dtype
    and lse [Tq, H] float32.
    kernel: None (``choose_kernel``'s rule; where FlashInfer's first call of a configuration
    fails, it warns once and the rule goes on to the others), or one of ``KERNELS``, which must
    serve the inputs (else ValueError). workspace: FlashInfer's buffers and planned wrappers
    (default ``DEFAULT_WORKSPACE``).
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel: expected None or one of {KERNELS}, got {kernel!r}")
    if kernel is None:
        rule = choose_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, max_seqlen_q, max_seqlen_k, offsets_q,
                             offsets_k)
    elif kernel == "triton":
        rule = kernel
    else:
        can = (peers.use_flashinfer(q, k, v, causal, offsets_q, offsets_k) if kernel == "flashinfer" else
               peers.use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
        if not can:
            raise ValueError(f"kernel: {kernel!r} does not serve these inputs (see mla.ops.prefill.peers.use_{kernel})")
        rule = kernel
    if rule == "flashinfer":
        res = peers.flashinfer_prefill(q, k, v, offsets_q, offsets_k, softmax_scale, causal, workspace)
        if res is not None:
            return res
        if kernel == "flashinfer":
            raise RuntimeError("kernel: 'flashinfer' failed on its first call for this configuration (see the warning)")
        rule = "cudnn" if peers.use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) else "triton"
    if rule == "cudnn":
        return peers.cudnn_prefill(q, k, v, cu_seqlens_q.shape[0] - 1, softmax_scale, causal)
    return triton_kernel.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                triton_kernel.default_config(q, v.shape[-1]))



def fp8_prefill_attention(q, k, v, k_scale, v_scale, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal=True):
    """``mla.ops.fp8_prefill_attention`` on the Triton kernel (FP8 operands, ``triton.fp8_config``'s
    tiles): the one FP8 context kernel here."""
    return triton_kernel.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                                triton_kernel.fp8_config(q, q.shape[-1], v.shape[-1]), k_scale, v_scale)
