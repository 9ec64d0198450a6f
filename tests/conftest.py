"""Shared test set-up."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # tests import hf_util


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """On a machine with a GPU and numpy >= 2.4 (the H200's image), mla refuses Triton launches on
    CPU tensors up front (``mla.ops._jit.INTERPRETER_BROKEN``: Triton 3.6's interpreter fails
    there, triton-lang/triton#9171, and breaks later GPU compiles). Those interpreter tests are
    reported as skipped with that reason; any other failure fails. CI has no GPU and pins
    numpy < 2.4, so there the interpreter always runs."""
    outcome = yield
    exc = outcome.excinfo[1] if outcome.excinfo else None
    from mla.ops._jit import INTERPRETER_BROKEN

    # opcheck wraps the refusal in its own OpCheckError: match the message, whatever the type
    if INTERPRETER_BROKEN and exc is not None and "triton-lang/triton#9171" in str(exc):
        outcome.force_exception(pytest.skip.Exception("Triton's interpreter with numpy >= 2.4 on a GPU machine"))


def pytest_addoption(parser):
    parser.addoption("--fuzz-steps", type=int, default=150,
                     help="random operations per case of tests/test_cache_fuzz.py (CI: the default; "
                          "a long run: e.g. --fuzz-steps 20000)")


# The quick subset (``pytest -m quick``, ``make test-gpu-quick``): every test function of the
# kernel tests once, with its first parameter set, so that each kernel, row format and property
# (NaN pages, shuffled tables, zero lengths, odd heads where a function's first case has them)
# runs on one case; the whole suite runs every case.
KERNEL_TESTS = {"test_decode_gluon.py", "test_decode_kernel.py", "test_sparse_gpu.py", "test_sparse.py",
                "test_prefill_ops.py", "test_fp8_gemm.py", "test_fp8.py", "test_rms_norm.py", "test_hostile.py",
                "test_op_validation.py", "test_split_plan.py", "test_compile.py", "test_fp8_attention.py"}


def pytest_collection_modifyitems(config, items):
    seen = set()
    for item in items:
        key = (item.path.name, getattr(item, "originalname", item.name))
        if item.path.name in KERNEL_TESTS and key not in seen:
            seen.add(key)
            item.add_marker(pytest.mark.quick)
