"""The one set of ceilings every benchmark reports against, measured on one NVIDIA H200.

    roofline time = max(bytes / COPY_BYTES_PER_S, flops / GEMM_FLOPS_PER_S)

and a benchmark's "roof" column is roofline time / measured time (1.0: at the ceiling).
"""
from __future__ import annotations

__all__ = ["COPY_BYTES_PER_S", "GEMM_FLOPS_PER_S", "roofline_us", "fraction"]

# device-to-device copy, bytes read + written: the most a memory-bound kernel can move
COPY_BYTES_PER_S = 4.28e12
# bf16 dense GEMM (8192^3, cuBLAS): the most a tensor-core kernel can compute
GEMM_FLOPS_PER_S = 790e12


def roofline_us(nbytes: float, flops: float = 0.0) -> float:
    """The shortest time in microseconds a call moving ``nbytes`` and computing ``flops`` can take."""
    return max(nbytes / COPY_BYTES_PER_S, flops / GEMM_FLOPS_PER_S) * 1e6


def fraction(us: float, nbytes: float, flops: float = 0.0) -> float:
    """The fraction of the roofline a measured time of ``us`` microseconds reaches."""
    return roofline_us(nbytes, flops) / us
