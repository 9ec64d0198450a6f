"""The peers that serve ``prefill_attention`` where they measured faster than the Triton kernel:
PyTorch's cuDNN attention and FlashInfer's fa3 ragged prefill (an optional library, imported
here only, on first use). ``mla.ops.prefill.prefill_attention`` chooses among them.

cuDNN's causal mask is aligned at the top-left, which equals ours (aligned at the ends) only when
nq == nk; FlashInfer's is aligned at the ends, as ours.
"""
from __future__ import annotations

import functools
import math
import warnings

import torch

__all__ = ["use_cudnn", "cudnn_prefill", "use_flashinfer", "flashinfer_prefill", "FlashInferWorkspace",
           "DEFAULT_WORKSPACE"]

_CUDNN_MIN_LEN_CHECKED = 1024   # see use_cudnn


def use_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None) -> bool:
    """Whether cuDNN serves: (through PyTorch, with log-sum-exp) it runs 1.1-2.3x faster than
    the Triton kernel on the H200 on every shape it can serve, so it serves 16-bit inputs on CUDA devices of compute capability >= 9.0 with
    head dims <= 256 (multiples of 8) when all B sequences have the same length n and as many
    queries as keys (cuDNN's causal mask is aligned top-left, ours at the ends: the two agree
    only without a prefix; equal lengths make [Tq, H, d] a free [B, H, n, d] view). Everything
    else (varlen batches, cached prefixes, fp32, CPU) runs the Triton kernel.

    Shapes decide first (inputs are packed: cu_seqlens[-1] is the row count). One sequence
    with Tq == Tk qualifies without a host read, and so do B sequences when the caller gives
    the longest lengths (the layer does): all are equal exactly when B * max_seqlen == Tq.
    Without them several sequences need one read of the offsets, which drains the stream (0.1-0.2 ms a
    call), so they are checked only when n = Tq / B >=
    1024, where cuDNN's lead is larger than that."""
    Tq, Tk, B = q.shape[0], k.shape[0], cu_seqlens_q.shape[0] - 1
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    dq, dv = q.shape[-1], v.shape[-1]
    if dq > 256 or dv > 256 or dq % 8 or dv % 8:
        return False
    if B <= 0 or Tq == 0 or Tq != Tk or Tq % B:
        return False
    if B == 1:
        return True
    if max_seqlen_q is not None and max_seqlen_k is not None:
        return B * max_seqlen_q == Tq and B * max_seqlen_k == Tk
    if Tq // B < _CUDNN_MIN_LEN_CHECKED:
        return False
    equal = torch.arange(B + 1, device=q.device, dtype=torch.int32) * (Tq // B)
    return bool(((cu_seqlens_q != equal) | (cu_seqlens_k != equal)).any().logical_not().item())


def cudnn_prefill(q, k, v, batch: int, softmax_scale: float, causal: bool):
    """cuDNN attention on B equal-length sequences with nq == nk, packed [B * n, H, d]."""
    Tq, H, dq = q.shape
    n = Tq // batch

    def bhnd(t):  # [B * n, H, d] -> [B, H, n, d] as a strided view
        return t.view(batch, n, H, t.shape[-1]).transpose(1, 2)

    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        bhnd(q), bhnd(k), bhnd(v), None, True, 0.0, causal, False, scale=softmax_scale)
    out, lse = res[0], res[1]
    out = out.transpose(1, 2).reshape(Tq, H, v.shape[-1])
    lse = lse.reshape(batch, H, n).transpose(1, 2).reshape(Tq, H).float()
    return out, lse


# ---------------------------------------------------------------------------------------------
# FlashInfer's fa3 ragged prefill.

_FI_DIMS = ((192, 128),)         # (dq, dv) measured on the H200: DeepSeek-V2/V3 and Kimi K2 heads


class FlashInferWorkspace:
    """What FlashInfer's prefill keeps between calls: a 128 MiB float scratch buffer per device
    (shared by all wrappers of that device) and one planned wrapper per configuration (device,
    dtype, heads, head dims, scale, causal), with the offsets it was planned for; a
    configuration whose first call failed is remembered and not tried again.

    ``mla.ops.prefill_attention`` uses ``DEFAULT_WORKSPACE`` unless given one (``workspace=``);
    ``free()`` releases the buffers and wrappers (the next call allocates them again)."""

    SCRATCH_BYTES = 128 << 20

    def __init__(self):
        self._scratch: dict = {}     # device -> uint8 scratch
        self._wrappers: dict = {}    # configuration -> [wrapper, planned offsets], or False after a failure

    def scratch(self, device: torch.device) -> torch.Tensor:
        if device not in self._scratch:
            self._scratch[device] = torch.empty(self.SCRATCH_BYTES, dtype=torch.uint8, device=device)
        return self._scratch[device]

    def free(self) -> None:
        self._scratch.clear()
        self._wrappers.clear()


DEFAULT_WORKSPACE = FlashInferWorkspace()


@functools.cache
def _flashinfer():
    """The flashinfer module, imported on first use; None where it does not import."""
    try:
        import flashinfer
    except Exception:   # noqa: BLE001 - absent, or a build that does not load here
        return None
    return flashinfer


def _tma_friendly(t: torch.Tensor) -> bool:
    """Unit stride along the head dim, 16-byte aligned start and other strides (TMA's terms)."""
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(x * t.element_size() % 16 == 0 for x in t.stride()[:-1]))


def use_flashinfer(q, k, v, causal, offsets_q, offsets_k) -> bool:
    """Whether FlashInfer can serve (and, where it can, it is the fastest path on the H200):
    FlashInfer (0.6.18 measured) serves bfloat16 q/k 192, v 128 on compute
    capability 9.0 (float16 compiled there but is not yet checked against the reference) when
    the caller gives the offsets on the host (its plan reads them there; from device offsets
    it would drain the stream), outside CUDA-graph capture (the plan copies to the device), and
    when every query sees at least one key (causal: nk >= nq; full: nk > 0 where nq > 0),
    since a query with none is ours to define (out 0, lse -inf). Views are fine where TMA can
    read them (:func:`_tma_friendly`)."""
    if offsets_q is None or offsets_k is None or q.shape[0] == 0:
        return False
    if q.device.type != "cuda" or q.dtype != torch.bfloat16:
        return False
    if (q.shape[-1], v.shape[-1]) not in _FI_DIMS or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if not all(_tma_friendly(t) for t in (q, k, v)):
        return False
    if torch.cuda.is_current_stream_capturing():
        return False
    for b in range(len(offsets_q) - 1):
        nq, nk = offsets_q[b + 1] - offsets_q[b], offsets_k[b + 1] - offsets_k[b]
        if nq > 0 and (nk < nq if causal else nk == 0):
            return False
    return _flashinfer() is not None


def flashinfer_prefill(q, k, v, offsets_q, offsets_k, softmax_scale: float, causal: bool,
                       workspace: FlashInferWorkspace | None = None):
    """FlashInfer's ragged prefill (fa3 backend) on host offsets; out [Tq, H, dv], lse [Tq, H]
    float32 in base e (FlashInfer's is in base 2). The plan (host work, ~0.3 ms) is redone
    only when the offsets change. The first call of a configuration compiles FlashInfer's
    kernel (nvcc); if that call fails (e.g. no CUDA toolkit), this warns once and returns None
    for that configuration from then on (in ``workspace``, default ``DEFAULT_WORKSPACE``), and
    the op takes its other paths."""
    ws = DEFAULT_WORKSPACE if workspace is None else workspace
    fi = _flashinfer()
    H, dq, dv = q.shape[1], q.shape[-1], v.shape[-1]
    key = (q.device, q.dtype, H, dq, dv, softmax_scale, causal)
    entry = ws._wrappers.get(key)
    if entry is False:
        return None
    first = entry is None
    offsets = (tuple(offsets_q), tuple(offsets_k))
    try:
        if first:
            entry = [fi.BatchPrefillWithRaggedKVCacheWrapper(ws.scratch(q.device), "NHD", backend="fa3"), None]
        if entry[1] != offsets:
            entry[0].plan(torch.tensor(offsets[0], dtype=torch.int32), torch.tensor(offsets[1], dtype=torch.int32),
                          H, H, dq, head_dim_vo=dv, causal=causal, sm_scale=softmax_scale,
                          q_data_type=q.dtype, kv_data_type=k.dtype)
            entry[1] = offsets
        out, lse = entry[0].run(q, k, v, return_lse=True)
    except Exception as e:  # noqa: BLE001 - only a configuration's first call is forgiven
        if not first:
            raise
        ws._wrappers[key] = False
        warnings.warn(f"mla prefill_attention: FlashInfer failed on its first call for {H} heads, "
                      f"{q.dtype}, causal={causal} ({type(e).__name__}: {str(e)[:200]}); using the other "
                      f"paths for it (kernel='cudnn' or 'triton' skips FlashInfer)", RuntimeWarning, stacklevel=3)
        return None
    ws._wrappers[key] = entry
    return out, lse.mul_(math.log(2))
