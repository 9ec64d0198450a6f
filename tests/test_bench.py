"""``mla bench`` and the ``mla`` command where no GPU is needed: the formulas and ceilings every
table divides by, the tables themselves, the options, and what each command says without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla
from mla import bench
from mla.bench import decode, report, roofline, timing
from mla.bench.decode_providers import decode_variant
from mla.ops.decode.portable import DecodeConfig

SRC = Path(__file__).resolve().parents[1] / "src"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the messages of a machine without CUDA")


def run_mla(*args: str) -> subprocess.CompletedProcess:
    """``python -m mla args`` in a fresh process, on this checkout's sources."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mla", *args], capture_output=True, text=True, env=env, timeout=120)


# ------------------------------------------------------------------ formulas and ceilings

def test_roofline_is_the_slower_of_bytes_and_flops():
    assert roofline.COPY_BYTES_PER_S == 4.28e12 and roofline.GEMM_FLOPS_PER_S == 790e12
    assert roofline.roofline_us(4.28e12) == pytest.approx(1e6)                # 1 s of copying
    assert roofline.roofline_us(4.28e6, 790e6) == pytest.approx(1.0)          # both 1 us
    assert roofline.roofline_us(4.28e6, 7.9e9) == pytest.approx(10.0)         # compute-bound
    assert roofline.roofline_us(4.28e7, 7.9e8) == pytest.approx(10.0)         # memory-bound
    assert roofline.fraction(20.0, 4.28e7) == pytest.approx(0.5)


def test_decode_bytes_and_flops_by_hand():
    # DeepSeek-V3, H 16, B 2, L 1000, s_q 1: rows of 576 bf16 values; q in (576) and out (512)
    assert decode.decode_bytes(16, 2, 1000, 1) == 2 * 1000 * 1152 + 2 * 16 * 1088 * 2 == 2_373_632
    assert decode.decode_flops(16, 2, 1000, 1) == 2 * 2 * 16 * 1000 * 1088 == 69_632_000
    # FP8 rows: 576 bytes; tile rows: 512 e4m3 + 4 float32 scales + 64 bf16 rope = 656
    assert decode.decode_bytes(16, 2, 1000, 1, "fp8") == 2 * 1000 * 576 + 69_632
    assert decode.decode_bytes(16, 2, 1000, 1, "fp8_tile") == 2 * 1000 * 656 + 69_632
    # another family: r 256, dr 32, H 8, B 1, L 64, s_q 2 -> d 288, row 576 B, q + out 288 + 256
    assert decode.decode_bytes(8, 1, 64, 2, "bf16", 256, 32) == 64 * 576 + 2 * 8 * 544 * 2
    assert decode.decode_flops(8, 1, 64, 2, 256, 32) == 2 * 2 * 8 * 64 * 544
    assert decode.row_bytes("fp8_tile", 256, 32) == 256 + 8 + 64


def test_decode_metrics_against_the_roofline():
    # H 128, B 32, L 4096, s_q 1: 159.9 MB -> 37.4 us of copying; 36.5 GFLOP -> 46.2 us of GEMM
    nbytes, flops = 32 * 4096 * 1152 + 32 * 128 * 1088 * 2, 2 * 32 * 128 * 4096 * 1088
    m = decode.decode_metrics(128, 32, 4096, 1, 70.0)
    assert m["TBps"] == pytest.approx(nbytes / 70e-6 / 1e12)
    assert m["TFLOPs"] == pytest.approx(flops / 70e-6 / 1e12)
    assert m["roof"] == pytest.approx(46.2 / 70, abs=1e-3)       # compute-bound at 128 heads
    # H 16: 152.1 MB -> 35.5 us against 5.8 us of GEMM: bound by the bytes
    assert decode.decode_metrics(16, 32, 4096, 1, 70.0)["roof"] == pytest.approx(35.5 / 70, abs=1e-3)


def test_copies_past_l2():
    assert timing.L2_ROTATE_BYTES == 240 << 20
    assert timing.copies_past_l2(240 << 20) == 1
    assert timing.copies_past_l2(100 << 20) == 3
    assert timing.copies_past_l2(1 << 20) == 64 and timing.copies_past_l2(1 << 20, most=8) == 8
    kv = torch.arange(4 * 8 * 3, dtype=torch.float32).view(4, 8, 3)
    copies = timing.rotated_copies(kv, most=5)
    assert len(copies) == 5 and copies[0] is kv
    for c in copies[1:]:   # the same blocks, permuted
        assert sorted(c[:, 0, 0].tolist()) == kv[:, 0, 0].tolist()


def test_fixed_iteration_mode_runs_the_same_count():
    calls = []
    us = timing.eager_time_us(lambda: calls.append(1), iters=7, sync=False)
    assert len(calls) == timing.WARMUP + 7 and us >= 0


def test_public_names():
    for name in ("decode_case", "graph_time_us", "rotated_copies", "eager_time_us", "op_provider",
                 "flashinfer_provider", "rel_err", "roofline_us", "main"):
        assert callable(getattr(bench, name)), name
    assert bench.rel_err(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(1.0)
    assert bench.rel_err(torch.tensor([float("nan")]), torch.tensor([1.0])) != bench.rel_err(
        torch.tensor([float("nan")]), torch.tensor([1.0]))   # NaN


# ------------------------------------------------------------------ options

def parse(*argv):
    p, _ = bench.parsers()
    return p.parse_args(list(argv))


def test_decode_options_default_to_deepseek_v3():
    args = parse("decode")
    assert (args.kv_lora, args.rope, args.kv, args.page) == (512, 64, ["bf16"], 64)
    assert decode.decode_grid(args)[:2] == [(16, 1, 1024, 1), (16, 1, 4096, 1)]
    assert len(decode.decode_grid(args)) == 9 + 18    # 16 heads s_q 1; 128 heads s_q 1 and 2
    decode.validate(args)


def test_decode_options_for_another_family():
    args = parse("decode", "--kv-lora", "256", "--rope", "32", "--heads", "8", "--batch", "4", "--kv-len", "100",
                 "--s-q", "1", "3", "--kv", "bf16", "fp8_tile", "--variants", "default,w4-n32,gluon:narrow")
    assert (args.kv_lora, args.rope) == (256, 32)
    assert decode.decode_grid(args) == [(8, 4, 100, 1), (8, 4, 100, 3)]
    decode.validate(args)


@pytest.mark.parametrize("argv, message", [
    (("--kv-lora", "0"), "positive"), (("--rope", "x"), "positive"), (("--heads", "-1"), "positive"),
    (("--kv", "int4"), "invalid choice"), (("--variants", "w4-q2"), "--variants"),
    (("--variants", "gluon:nope"), "unknown kernel"), (("--kv", "fp8_tile", "--kv-lora", "320"), "multiple of 128"),
])
def test_bad_decode_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["decode", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decode_variants():
    cfg = DecodeConfig(block_m=64, num_splits=4)
    assert decode_variant("default", cfg) is cfg
    v = decode_variant("w4-n32-m16-s3-x2-g", cfg)
    assert (v.num_warps, v.block_n, v.block_m, v.num_stages, v.num_splits, v.page_tile) == (4, 32, 16, 3, 8, False)
    assert decode_variant("h8", cfg).num_splits == 1
    for bad in ("w", "z3", "g2", "w4--n32"):
        with pytest.raises(ValueError):
            decode_variant(bad, cfg)


# ------------------------------------------------------------------ tables

def row(provider, us, tbps, tflops, roof, kernel="", H=16, B=32, L=4096):
    return dict(H=H, B=B, L=L, s_q=1, kv="bf16", provider=provider, kernel=kernel, us=us, TBps=tbps, TFLOPs=tflops,
                roof=roof, rel_err=1e-3, config="c")


def test_summary_reports_the_dispatched_op_its_kernel_and_its_ratio_to_fa3():
    rows = [row("mla.ops", 50.0, 3.11, 93.0, 0.72, "narrow"), row("triton:default", 80.0, 1.94, 58.0, 0.45, "portable"),
            row("flashinfer-fa3", 40.0, 3.88, 116.0, 0.90), row("naive-torch", 200.0, 0.78, 23.0, 0.18)]
    lines = report.decode_summary(rows).splitlines()
    assert len(lines) == 2
    cells = lines[1].split()
    # H B L s_q kv | op kernel best variant fa3 naive | op/fa3 best/fa3 | TB/s TF/s roof (of the op)
    assert cells[:5] == ["16", "32", "4096", "1", "bf16"]
    assert cells[5:11] == ["50.0", "narrow", "80.0", "triton:default", "40.0", "200.0"]
    assert cells[11:13] == ["1.25", "2.00"]
    assert cells[13:] == ["3.11", "93", "72%"]


def test_summary_without_the_op_falls_back_to_the_fastest_named_kernel():
    rows = [row("triton:default", 80.0, 1.94, 58.0, 0.45, "portable"), row("gluon:seesaw", 60.0, 2.59, 77.0, 0.60)]
    cells = report.decode_summary(rows).splitlines()[1].split()
    assert cells[5:8] == ["-", "-", "60.0"] and cells[8] == "gluon:seesaw"
    assert cells[-3:] == ["2.59", "77", "60%"]


def test_table_has_a_kernel_column_and_the_csv_keeps_it(tmp_path):
    rows = [row("mla.ops", 50.0, 3.11, 93.0, 0.72, "portable"), row("flashinfer-fa3", 40.0, 3.88, 116.0, 0.90),
            dict(H=16, B=32, L=4096, s_q=1, kv="bf16", provider="gluon:seesaw", kernel="seesaw", error="ValueError: x")]
    report.add_ratios(rows)
    lines = report.decode_table(rows).splitlines()
    assert lines[0].split()[5:8] == ["provider", "kernel", "us"]
    assert lines[2].split()[5:8] == ["mla.ops", "portable", "50.0"] and "1.25" in lines[2]
    assert lines[3].split()[5:7] == ["flashinfer-fa3", "-"]
    assert lines[4].split()[5:8] == ["gluon:seesaw", "seesaw", "ERROR"]
    report.write_csv(rows, tmp_path / "d.csv")
    head, first = (tmp_path / "d.csv").read_text().splitlines()[:2]
    assert "kernel" in head.split(",") and "portable" in first.split(",")


# ------------------------------------------------------------------ the command

def test_version():
    r = run_mla("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"mla {mla.__version__}"


def test_python_m_mla_help():
    r = run_mla("--help")
    assert r.returncode == 0 and "usage: mla" in r.stdout and "bench" in r.stdout and "--version" in r.stdout


def test_bench_help_lists_the_benchmarks(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(op in out for op in ("decode", "prefill", "layer"))


@no_cuda
def test_demo_on_cuda_without_cuda_says_so_in_one_line():
    r = run_mla("demo", "--device", "cuda")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "CUDA is not available" in r.stderr


@no_cuda
@pytest.mark.parametrize("op", ["decode", "prefill", "layer"])
def test_bench_without_cuda_says_so_on_stderr(op):
    r = run_mla("bench", op)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"mla bench {op}: needs a CUDA GPU")


def test_bench_bad_arguments_exit_2_before_looking_for_a_gpu():
    r = run_mla("bench", "decode", "--variants", "gluon:nope")
    assert r.returncode == 2 and r.stdout == "" and "unknown kernel" in r.stderr and "Traceback" not in r.stderr
    r = run_mla("bench")
    assert r.returncode == 2 and "usage: mla bench" in r.stderr


# ------------------------------------------------------------------ providers (the CPU paths)

@pytest.mark.parametrize("kv_format, r, dr", [("bf16", 512, 64), ("bf16", 256, 32), ("fp8", 256, 32),
                                              ("fp8_tile", 128, 64)])
def test_op_and_naive_providers_on_a_cpu_case(kv_format, r, dr):
    from mla.bench.decode_providers import naive_provider
    from mla.ops import reference

    c = bench.decode_case(3, 2, 100, 2, 16, kv_format=kv_format, r=r, dr=dr, device="cpu")
    assert c["q"].shape == (2, 2, 3, r + dr) and c["kv"].shape == (14, 16, decode.row_bytes(kv_format, r, dr)
                                                                  // (2 if kv_format == "bf16" else 1))
    ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], r, c["scale"], True)[0].float()
    op = bench.op_provider()(c)
    assert op.kernel == "portable"     # what choose_kernel picks off the GPU, and for any dims but 512/64 on it
    assert bench.rel_err(op.call(c["kv"]), ref) < 1e-6          # the reference itself on CPU
    naive = naive_provider()(c)
    assert naive.kernel == "" and bench.rel_err(naive.call(c["kv"]), ref) < 2e-2
