"""The decode benchmark's summary table (pure formatting: runs without a GPU)."""
from __future__ import annotations

from mla import bench


def row(provider, us, tbps, tflops, roof, H=16, B=32, L=4096):
    return dict(H=H, B=B, L=L, s_q=1, kv="bf16", provider=provider, us=us, TBps=tbps, TFLOPs=tflops, roof=roof)


def test_summary_reports_the_dispatched_op_and_its_ratio_to_fa3():
    rows = [row("mla.ops", 50.0, 3.11, 93.0, 0.72), row("triton:default", 80.0, 1.94, 58.0, 0.45),
            row("flashinfer-fa3", 40.0, 3.88, 116.0, 0.90), row("naive-torch", 200.0, 0.78, 23.0, 0.18)]
    lines = bench.decode_summary(rows).splitlines()
    assert len(lines) == 2
    cells = lines[1].split()
    # H B L s_q kv | op best variant fa3 naive | op/fa3 best/fa3 | TB/s TF/s roof (of the op)
    assert cells[:5] == ["16", "32", "4096", "1", "bf16"]
    assert cells[5:10] == ["50.0", "80.0", "triton:default", "40.0", "200.0"]
    assert cells[10:12] == ["1.25", "2.00"]
    assert cells[12:] == ["3.11", "93", "72%"]


def test_summary_without_the_op_falls_back_to_the_fastest_named_kernel():
    rows = [row("triton:default", 80.0, 1.94, 58.0, 0.45), row("gluon:seesaw", 60.0, 2.59, 77.0, 0.60)]
    cells = bench.decode_summary(rows).splitlines()[1].split()
    assert cells[6:8] == ["60.0", "gluon:seesaw"]
    assert cells[-3:] == ["2.59", "77", "60%"]
