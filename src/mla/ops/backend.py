"""Which implementation an op runs: the backend rule every op shares.

``backend=None`` chooses by device (CUDA tensors -> "triton" when Triton is importable, else
"torch"); "torch" forces the reference (``reference.py``), "triton" the kernels (on CPU tensors
under Triton's interpreter). Each op's body in ``_library`` asks ``use_kernels`` and then calls
its kernel module, which holds the family's own rule (``decode.choose_kernel``,
``prefill.choose_kernel``, ``fp8_gemm.choose_kernel``) and names the inputs it serves
(``CACHE_FORMATS``, ``MAX_COLUMNS``, ``*_takes``); everything else runs the reference.
"""
from __future__ import annotations

import importlib.util

import torch

__all__ = ["BACKENDS", "triton_available", "resolve_backend", "use_kernels"]

BACKENDS = ("torch", "triton")


@torch.compiler.assume_constant_result   # torch.compile takes the answer at trace time (no import traced)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend an op runs on: an explicit choice, or the default for the device."""
    if backend is None:
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not triton_available():
        raise ValueError("backend: 'triton' requested but triton is not installed")
    return backend


def use_kernels(backend: str | None, device: torch.device) -> bool:
    """Whether an op on ``device`` runs its Triton/Gluon kernels (else the reference)."""
    return resolve_backend(backend, device) == "triton"
