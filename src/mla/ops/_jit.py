"""Triton launch glue shared by every kernel of ``mla.ops``: :func:`jit`, the device queries
that schedules read, and the cache-format code kernels specialise on.

Kernels are declared with :func:`jit` instead of ``triton.jit``: the same kernel then runs
compiled on CUDA tensors and under Triton's interpreter on CPU tensors, without setting
``TRITON_INTERPRET`` before import.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from ..quant import CACHE_FORMATS, cache_format

__all__ = ["jit", "kv_fmt", "num_sms", "sm_major", "INTERPRETER_BROKEN", "LOG2E", "KERNEL_LOG2E", "LN2"]

# The attention kernels compute the softmax in base 2 (exp2, log2: one instruction each): the
# host folds log2(e) into the scale it passes, and a natural-log LSE is the base-2 one times ln 2.
LOG2E = 1.4426950408889634                  # log2(e), for the host
KERNEL_LOG2E = triton.language.constexpr(LOG2E)     # the same, for a kernel (a sink logit to base 2)
LN2 = triton.language.constexpr(0.6931471805599453)  # ln(2) = 1 / log2(e), for a kernel

_interpreted_library: dict = {}


def _call_interpreted(self, *args, **kwargs):
    """JITFunction.__call__ while an interpreted kernel runs: Triton's own jit functions
    (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) were declared compiled (no TRITON_INTERPRET at
    import), and the interpreter calls them as plain Python, so they must run through the
    interpreter too. Triton 3.6 offers no per-launch hook for this: the class attribute is
    swapped for the duration of one interpreted launch (``_DualKernel.run``) and put back after
    it, and only here."""
    fn = _interpreted_library.get(self.fn)
    if fn is None:
        fn = _interpreted_library[self.fn] = InterpretedFunction(self.fn)
    return fn(*args, **kwargs)


def _language_state() -> list:
    """The attributes of triton.language's modules and tensor class, to put back after an
    interpreted launch: the interpreter patches them, and a device-function call inside it
    (tl.max, tl.cdiv, ...) patches triton.language.core without restoring it (Triton 3.6),
    which breaks every later compilation in the process."""
    import triton.language as tl

    return [(obj, dict(vars(obj))) for obj in (tl, tl.core, tl.math, tl.tensor)]


def _restore_language(state) -> None:
    for obj, saved in state:
        for name in set(vars(obj)) - set(saved):
            delattr(obj, name)
        for name, value in saved.items():
            if vars(obj).get(name) is not value:
                setattr(obj, name, value)


def _interpreter_breaks() -> bool:
    """Triton 3.6's interpreter fails on run-time loop bounds with numpy >= 2.4
    (triton-lang/triton#9171), and a launch that fails inside it leaves the process unable to
    compile Gluon kernels afterwards (restoring the attributes of triton.language's and Gluon's
    modules does not prevent it). So where a GPU could be used later in the process, CPU
    launches are refused up front; without one, the interpreter runs and reports its own
    error."""
    import numpy

    def version(v):
        return tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
    return (version(numpy.__version__) >= (2, 4) and version(triton.__version__) <= (3, 6)
            and torch.cuda.is_available())


INTERPRETER_BROKEN = _interpreter_breaks()


class _DualKernel(JITFunction):
    """A JITFunction that hands CPU-tensor launches (and calls from interpreted
    kernels) to an InterpretedFunction of the same Python function."""

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self.interpreted = InterpretedFunction(fn)

    def run(self, *args, grid, warmup, **kwargs):
        on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (*args, *kwargs.values()))
        if on_cpu:
            if INTERPRETER_BROKEN:
                raise RuntimeError(
                    "mla: Triton kernels run on CPU tensors through Triton's interpreter, which fails with "
                    "numpy >= 2.4 in Triton 3.6 (triton-lang/triton#9171) and then breaks later GPU "
                    "compilation in the process; install numpy < 2.4, or pass backend='torch' for CPU tensors")
            plain_call, language = JITFunction.__call__, _language_state()
            JITFunction.__call__ = _call_interpreted
            try:
                return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                JITFunction.__call__ = plain_call
                _restore_language(language)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)

    def __call__(self, *args, **kwargs):  # a device-function call inside an interpreted kernel
        return self.interpreted(*args, **kwargs)


def jit(fn=None, **kwargs):
    """``triton.jit`` that also runs on CPU tensors (through the interpreter)."""
    if triton.knobs.runtime.interpret:  # TRITON_INTERPRET=1 set by the user: plain interpreter
        return triton.jit(fn, **kwargs) if fn is not None else triton.jit(**kwargs)
    if fn is None:
        return lambda f: _DualKernel(f, **kwargs)
    return _DualKernel(fn, **kwargs)


def kv_fmt(kv_cache: torch.Tensor) -> int:
    """The kernels' KV_FMT code of a cache: 0 plain rows, 1 FP8 rows, 2 FP8 tile rows (the index
    of ``mla.quant.cache_format`` in ``mla.quant.CACHE_FORMATS``)."""
    return CACHE_FORMATS.index(cache_format(kv_cache))


@lru_cache(maxsize=None)
def sm_major(device_index: int) -> int:
    """The compute capability's major version of a CUDA device."""
    return torch.cuda.get_device_capability(device_index)[0]


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """The multiprocessor count of a CUDA device (the schedules size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
