"""Triton backends of the ops in ``mla.ops`` (same signatures as ``mla.ops.reference``).

Kernels are declared with :func:`jit` below instead of ``triton.jit``: the same
kernel then runs compiled on CUDA tensors and under Triton's interpreter on CPU
tensors, without setting ``TRITON_INTERPRET`` before import.
"""
from __future__ import annotations

import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


_interpreted_library: dict = {}


def _call_interpreted(self, *args, **kwargs):
    """JITFunction.__call__ while an interpreted kernel runs: Triton's own jit functions
    (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) are compiled JITFunctions here, so run them
    through the interpreter too."""
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
    compile Gluon kernels afterwards (on the H200 the decode kernel's compile then failed;
    restoring the attributes of triton.language's and Gluon's modules did not prevent it).
    So where a GPU could be used later in the process, CPU launches are refused up front;
    without one, the interpreter runs and reports its own error."""
    import numpy
    import torch

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
        import torch

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


def kv_fmt(kv_cache) -> int:
    """The kernels' KV_FMT code of a cache: 0 plain rows, 1 FP8 rows, 2 FP8 tile rows (the index
    of ``mla.ops.cache_format`` in ``mla.quant.CACHE_FORMATS``)."""
    from .. import cache_format
    from ...quant import CACHE_FORMATS

    return CACHE_FORMATS.index(cache_format(kv_cache))


# Ops with a Triton kernel are re-exported here as they land; the rest fall back to the reference.
# One line per op, so each kernel file swaps in its own line.
from .decode import mla_decode  # noqa: E402,F401
from .prefill import prefill_attention  # noqa: E402,F401
from .merge import merge_attention  # noqa: E402,F401
from .rope_append import rope_append  # noqa: E402,F401
from .gather import gather_latent  # noqa: E402,F401
from .fp8_gemm import quantize_act_1x128, fp8_linear, fp8_bmm  # noqa: E402,F401
