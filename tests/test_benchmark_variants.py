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
