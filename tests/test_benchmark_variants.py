"""The breakdown scripts build their kernel variants by editing the kernels' source text at
anchors (benchmarks/variants.py); a kernel change that moves an anchor must show here, on CPU,
not in the next device call."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _sources():
    import fixed_cost
    import fp8_breakdown
    import fp8reg_breakdown
    import seesaw_breakdown

    for m in seesaw_breakdown.MODES:
        yield f"seesaw {m}", seesaw_breakdown.variant_source(m)
    for m in fp8reg_breakdown.MODES:
        yield f"fp8reg {m}", fp8reg_breakdown.variant_source(m)
    for m in ("no_widen", "widen_only"):
        yield f"narrow {m}", fp8_breakdown.variant_source(m)
    for m in ("no_tiles", "no_tiles_store"):
        yield f"narrow {m}", fixed_cost.narrow_source(m)


def test_every_variant_builds_and_imports(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    from variants import load_module

    names = []
    for i, (name, src) in enumerate(_sources()):
        assert "from . import" not in src and "from .decode" not in src, name
        mod = load_module(src, f"variant_{i}", tmp_path)
        assert any(k.endswith("_kernel") for k in vars(mod)), name
        names.append(name)
    assert len(names) == len(set(names)) >= 15


def test_bitcheck_compare_tells_one_bit_apart():
    """bitcheck_decode's verdict: the same bits (NaN included) are identical, one ulp is not."""
    import torch
    from bitcheck_decode import compare

    out = torch.randn(2, 1, 3, 8).to(torch.bfloat16)
    out[0, 0, 0, 0] = float("nan")
    lse = torch.randn(2, 1, 3)
    key = ("bf16", 3, 2, 10, 1)
    a = {key: (out, lse)}
    assert compare(a, {key: (out.clone(), lse.clone())}) == 0
    bumped = out.clone()
    bumped.view(torch.int16)[1, 0, 2, 5] += 1
    assert compare(a, {key: (bumped, lse.clone())}) == 1
    nudged = lse.clone()
    nudged.view(torch.int32)[0, 0, 1] += 1
    assert compare(a, {key: (bumped, nudged)}) == 2
    assert compare(a, {key: (out.float(), lse)}) == 1          # another dtype is not the same bits
