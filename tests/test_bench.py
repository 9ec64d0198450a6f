"""``mla bench`` and the ``mla`` command where no GPU is needed: the formulas and ceilings every
table divides by, the tables themselves, the options, and what each command says without CUDA."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mla
from mla import bench
from mla import quant
from mla.bench import decode, report, roofline, sparse, sparse_cases, sparse_checks, sparse_providers, timing
from mla.bench import decode_providers as prov
from mla.bench.decode_providers import decode_variant
from mla.bench import layer_grid, layer_peer, layer_step
from mla.testing import random_state_dict
from mla.weights import quantize_checkpoint_fp8
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


def test_decode_bytes_and_flops_count_the_keys_there_are():
    # a mixed batch, H 16, B 2, max len 1000, 1500 keys together: the rows read are the 1500, not B * L
    assert decode.decode_bytes(16, 2, 1000, 1, keys=1500) == 1500 * 1152 + 69_632
    assert decode.decode_bytes(16, 2, 1000, 1, "fp8_tile", keys=1500) == 1500 * 656 + 69_632
    assert decode.decode_flops(16, 2, 1000, 1, keys=1500) == 2 * 16 * 1500 * 1088
    assert decode.decode_bytes(16, 2, 1000, 1, keys=2000) == decode.decode_bytes(16, 2, 1000, 1)
    # one long: B 32, one 16k and 31 of 1k at 128 heads
    K = 16384 + 31 * 1024
    m = decode.decode_metrics(128, 32, 16384, 1, 40.0, keys=K)
    assert m["TBps"] == pytest.approx((K * 1152 + 32 * 128 * 1088 * 2) / 40e-6 / 1e12)
    assert m["TFLOPs"] == pytest.approx(2 * 128 * K * 1088 / 40e-6 / 1e12)
    assert m["roof"] == pytest.approx(roofline.roofline_us(K * 1152 + 32 * 128 * 1088 * 2, 2 * 128 * K * 1088) / 40)


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


def test_mixed_grid_defaults_to_issue_34s():
    args = parse("decode", "--mixed")
    assert args.mixed == [] and decode.decode_grid(parse("decode"))[0] == (16, 1, 1024, 1)
    grid = decode.mixed_grid(args)
    assert len(grid) == 2 * 2 * 2 * 3              # heads 16 128, B 32 128, L 4k 16k, three mixes, s_q 1
    assert grid[:4] == [(16, 32, 4096, 1, "equal"), (16, 32, 4096, 1, "uniform"), (16, 32, 4096, 1, "one-long"),
                        (16, 32, 16384, 1, "equal")]
    assert {s[3] for s in grid} == {1} and {s[0] for s in grid} == {16, 128}
    decode.validate(args)


def test_mixed_grid_takes_the_options():
    args = parse("decode", "--mixed", "one-long", "uniform", "--heads", "128", "--s-q", "2", "--batch", "8",
                 "--kv-len", "1024", "--kv", "bf16", "fp8")
    assert decode.mixed_grid(args) == [(128, 8, 1024, 2, "one-long"), (128, 8, 1024, 2, "uniform")]
    assert args.kv == ["bf16", "fp8"]
    decode.validate(args)


def test_mix_lengths():
    assert decode.mix_lengths("equal", 4, 4096) == [4096] * 4
    one = decode.mix_lengths("one-long", 32, 16384)
    assert one[16] == 16384 and one.count(1024) == 31 and sum(one) == 16384 + 31 * 1024
    assert decode.mix_lengths("one-long", 3, 20, s_q=2) == [2, 20, 2]       # L // 16 = 1, but a sequence holds s_q
    u = decode.mix_lengths("uniform", 128, 4096)
    assert len(u) == 128 and min(u) >= 1 and max(u) <= 4096 and len(set(u)) > 100
    assert u == decode.mix_lengths("uniform", 128, 4096)                     # seeded
    assert u != decode.mix_lengths("uniform", 128, 4096, seed=1)
    assert min(decode.mix_lengths("uniform", 256, 8, s_q=3)) == 3
    with pytest.raises(ValueError, match="one of"):
        decode.mix_lengths("skewed", 4, 64)


@pytest.mark.parametrize("argv, message", [
    (("--mixed", "skewed"), "invalid choice"), (("--mixed", "--kv-len", "1", "--s-q", "2"), "at least 2"),
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
    assert decode_variant("f-x2", cfg).flat and not cfg.flat
    assert decode_variant("p", cfg).persistent and not decode_variant("f-p", cfg).flat
    for bad in ("w", "z3", "g2", "f1", "p2", "w4--n32"):
        with pytest.raises(ValueError):
            decode_variant(bad, cfg)


# ------------------------------------------------------------------ tables

def row(provider, us, tbps, tflops, roof, kernel="", H=16, B=32, L=4096):
    return dict(H=H, B=B, L=L, s_q=1, kv="bf16", provider=provider, kernel=kernel, us=us, TBps=tbps, TFLOPs=tflops,
                roof=roof, rel_err=1e-3, config="c")


def test_summary_reports_the_dispatched_op_its_kernel_and_its_ratios_to_the_peers():
    rows = [row("mla.ops", 50.0, 3.11, 93.0, 0.72, "narrow"), row("triton:default", 80.0, 1.94, 58.0, 0.45, "portable"),
            row("flashinfer-fa3", 40.0, 3.88, 116.0, 0.90), row("flashmla", 62.5, 2.49, 74.0, 0.58),
            row("naive-torch", 200.0, 0.78, 23.0, 0.18)]
    lines = report.decode_summary(rows).splitlines()
    assert len(lines) == 2
    cells = lines[1].split()
    # H B L s_q kv | op kernel best variant fa3 flashmla naive | op/fa3 op/fmla best/fa3 | TB/s TF/s roof (of the op)
    assert cells[:5] == ["16", "32", "4096", "1", "bf16"]
    assert cells[5:12] == ["50.0", "narrow", "80.0", "triton:default", "40.0", "62.5", "200.0"]
    assert cells[12:15] == ["1.25", "0.80", "2.00"]
    assert cells[15:] == ["3.11", "93", "72%"]
    # without FlashMLA its cells read "-"
    cells = report.decode_summary([r for r in rows if r["provider"] != "flashmla"]).splitlines()[1].split()
    assert cells[10] == "-" and cells[13] == "-"


def test_summary_without_the_op_falls_back_to_the_fastest_named_kernel():
    rows = [row("triton:default", 80.0, 1.94, 58.0, 0.45, "portable"), row("gluon:seesaw", 60.0, 2.59, 77.0, 0.60)]
    cells = report.decode_summary(rows).splitlines()[1].split()
    assert cells[5:8] == ["-", "-", "60.0"] and cells[8] == "gluon:seesaw"
    assert cells[-3:] == ["2.59", "77", "60%"]


def test_table_has_a_kernel_column_and_the_csv_keeps_it(tmp_path):
    rows = [row("mla.ops", 50.0, 3.11, 93.0, 0.72, "portable"), row("flashinfer-fa3", 40.0, 3.88, 116.0, 0.90),
            dict(H=16, B=32, L=4096, s_q=1, kv="bf16", provider="gluon:seesaw", kernel="seesaw", error="ValueError: x"),
            row("flashmla", 25.0, 6.2, 186.0, 1.0),
            dict(H=16, B=32, L=4096, s_q=1, kv="bf16", provider="naive-torch", note="n/a: equal lengths only")]
    report.add_ratios(rows)
    lines = report.decode_table(rows).splitlines()
    assert lines[0].split()[5:8] == ["provider", "kernel", "us"] and lines[0].split()[11:13] == ["/fa3", "/fmla"]
    assert lines[2].split()[5:8] == ["mla.ops", "portable", "50.0"] and lines[2].split()[11:13] == ["1.25", "2.00"]
    assert lines[3].split()[5:7] == ["flashinfer-fa3", "-"]
    assert lines[4].split()[5:8] == ["gluon:seesaw", "seesaw", "ERROR"]
    assert lines[5].split()[11:13] == ["0.62", "1.00"]
    assert lines[6].split()[5:] == ["naive-torch", "-", "n/a:", "equal", "lengths", "only"]
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
    assert e.value.code == 0 and all(op in out for op in ("decode", "prefill", "layer", "sparse"))


@no_cuda
def test_demo_on_cuda_without_cuda_says_so_in_one_line():
    r = run_mla("demo", "--device", "cuda")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "CUDA is not available" in r.stderr


@no_cuda
@pytest.mark.parametrize("op", ["decode", "prefill", "layer", "sparse"])
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


def test_a_mixed_case_holds_the_blocks_its_lengths_fill():
    lengths = [100, 1, 64, 0, 30]
    c = bench.decode_case(3, 5, 100, 1, 16, device="cpu", lengths=lengths)
    assert c["kv"].shape == (7 + 1 + 4 + 0 + 2, 16, 576) and c["table"].shape == (5, 7)
    assert c["seqlens"].tolist() == lengths and c["lengths"] == lengths and c["keys"] == 195
    used = [c["table"][b, :n].tolist() for b, n in enumerate([7, 1, 4, 0, 2])]
    assert sorted(sum(used, [])) == list(range(14))                             # every block once, shuffled
    assert all((c["table"][b, n:] == 0).all() for b, n in enumerate([7, 1, 4, 0, 2]))   # past the end: block 0
    with pytest.raises(ValueError, match="lengths"):
        bench.decode_case(3, 2, 100, 1, 16, device="cpu", lengths=[101, 3])


def test_equal_lengths_give_the_grids_case_unchanged():
    # tools/bitcheck_decode.py compares trees on decode_case's values: the same draws, table perm.view(B, P)
    c = bench.decode_case(4, 3, 130, 2, 64, seed=5, device="cpu")
    g = torch.Generator().manual_seed(5 + 7919 * 4 + 131 * 3 + 130 + 17 * 2)
    kv = torch.randn(9, 64, 576, dtype=torch.bfloat16, generator=g)
    q = torch.randn(3, 2, 4, 576, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(9, generator=g).to(torch.int32).view(3, 3)
    assert torch.equal(c["kv"], kv) and torch.equal(c["q"], q) and torch.equal(c["table"], table)
    assert c["seqlens"].tolist() == [130] * 3 and c["keys"] == 390
    m = bench.decode_case(4, 3, 130, 2, 64, seed=5, device="cpu", lengths=[130] * 3)
    assert all(torch.equal(m[k], c[k]) for k in ("kv", "q", "table", "seqlens"))


def fake_flash_mla(fill=True):
    """A stand-in for FlashMLA's module (9241ae3's dense interface) that records each call and
    answers with mla's reference on the cache it is given."""
    from mla.ops import reference

    calls = []

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits,
                               softmax_scale=None, causal=False):
        calls.append(dict(k_cache=k_cache.shape, table=block_table, seqlens=cache_seqlens, head_dim_v=head_dim_v,
                          meta=meta, num_splits=num_splits, scale=softmax_scale, causal=causal))
        meta.have_initialized = fill
        out, lse = reference.mla_decode(q, k_cache[:, :, 0], block_table, cache_seqlens, head_dim_v, softmax_scale,
                                        causal)
        return out, lse.transpose(1, 2)
    fm = SimpleNamespace(get_mla_metadata=lambda *a: (SimpleNamespace(have_initialized=False), None),
                         flash_mla_with_kvcache=flash_mla_with_kvcache)
    return fm, calls


def test_flashmla_provider_plans_once_outside_the_timed_calls():
    from mla.ops import reference

    fm, calls = fake_flash_mla()
    c = bench.decode_case(3, 4, 300, 2, 64, device="cpu", lengths=decode.mix_lengths("uniform", 4, 300, 2))
    t = prov.flashmla_provider(fm)(c)
    assert len(calls) == 1 and calls[0]["meta"].have_initialized     # the metadata, filled in make
    out = t.call(c["kv"])
    assert len(calls) == 2 and calls[1]["meta"] is calls[0]["meta"]    # the timed call reuses it
    a = calls[1]
    assert a["k_cache"] == (c["kv"].shape[0], 64, 1, 576) and a["head_dim_v"] == 512 and a["num_splits"] is None
    assert a["table"] is c["table"] and a["seqlens"] is c["seqlens"] and a["scale"] == c["scale"] and a["causal"]
    ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], 512, c["scale"], True)[0]
    assert out.shape == (4, 2, 3, 512) and torch.equal(out, ref)
    fm, calls = fake_flash_mla(fill=False)
    with pytest.raises(RuntimeError, match="unfilled"):
        prov.flashmla_provider(fm)(c)


@pytest.mark.parametrize("kv_format, r, dr, page, why", [
    ("fp8", 512, 64, 64, "bf16 rows only"), ("fp8_tile", 512, 64, 64, "bf16 rows only"),
    ("bf16", 256, 32, 64, "r 512, rope 64"), ("bf16", 512, 64, 16, "blocks of 64 rows, not 16")])
def test_flashmla_refuses_what_its_dense_decode_does_not_take(kv_format, r, dr, page, why):
    assert prov.flashmla_refusal("bf16", 512, 64, 64) is None
    assert why in prov.flashmla_refusal(kv_format, r, dr, page)
    c = bench.decode_case(3, 2, 64, 1, page, kv_format=kv_format, r=r, dr=dr, device="cpu")
    fm, calls = fake_flash_mla()
    with pytest.raises(prov.NotApplicable, match=why):
        prov.flashmla_provider(fm)(c)
    assert calls == []


def test_flashmla_is_a_peer_only_where_it_imports(monkeypatch, capsys):
    def missing():
        raise ImportError("No module named 'flash_mla'")
    monkeypatch.setattr(sparse_providers, "load_flash_mla", missing)
    provs = decode.providers(parse("decode"))
    assert "flashmla" not in provs and {"mla.ops", "triton:default", "naive-torch"} <= set(provs)
    err = capsys.readouterr().err
    assert "flashmla skipped: flash_mla is not importable (ImportError: No module named 'flash_mla')" in err
    monkeypatch.setattr(sparse_providers, "load_flash_mla", lambda: fake_flash_mla()[0])
    assert "flashmla" in decode.providers(parse("decode"))
    assert "flashmla" not in decode.providers(parse("decode", "--no-peers"))


def test_measure_on_a_mixed_cpu_case(monkeypatch):
    # the timer needs CUDA graphs: a stand-in here; the checks, the refusals and the metrics run as on the GPU
    monkeypatch.setattr(decode, "graph_time_us", lambda calls: 100.0)
    lengths = decode.mix_lengths("one-long", 4, 256)
    c = dict(bench.decode_case(3, 4, 256, 1, 64, device="cpu", lengths=lengths), mix="one-long")

    def wrong():   # reads every sequence to L: the check against the reference must catch it
        def make(c):
            return prov.Timed(lambda kv: bench.decode_case(3, 4, 256, 1, 64, device="cpu")["q"][..., :512], "wrong")
        return make
    provs = {"mla.ops": prov.op_provider(), "flashmla": prov.flashmla_provider(fake_flash_mla()[0]),
             "naive-torch": prov.naive_provider(), "wrong": wrong()}
    rows = decode.measure(c, provs, 64)
    by = {r["provider"]: r for r in rows}
    assert all(r["mix"] == "one-long" and r["keys"] == 256 + 3 * 16 for r in rows)
    assert by["mla.ops"]["rel_err"] < 1e-6 and by["mla.ops"]["us"] == 100.0
    assert by["mla.ops"]["TBps"] == pytest.approx(decode.decode_bytes(3, 4, 256, 1, keys=304) / 100e-6 / 1e12)
    assert by["flashmla"]["us"] == 100.0 and by["flashmla"]["config"] == "dense, bf16"
    assert by["naive-torch"]["note"].startswith("n/a: naive PyTorch") and "us" not in by["naive-torch"]
    assert by["wrong"]["error"].startswith("wrong result: rel_err") and "us" not in by["wrong"]
    report.add_ratios(rows)
    assert by["mla.ops"]["ratio_flashmla"] == 1.0
    table = report.decode_table(rows).splitlines()
    assert table[0].split()[5:9] == ["mix", "K", "provider", "kernel"]
    assert table[2].split()[5:8] == ["one-long", "304", "mla.ops"]
    cells = report.decode_summary(rows).splitlines()[1].split()
    assert cells[5:8] == ["one-long", "304", "100.0"] and cells[12] == "100.0" and cells[15] == "1.00"


# ------------------------------------------------------------------ mla bench sparse

def test_sparse_bytes_and_flops_by_hand():
    # H 128, B 32, s_q 1, top-2048: 2048 rows a query (656 B FP8, 1152 B bf16), q in (576) and out (512) bf16
    assert sparse.sparse_decode_bytes(128, 32, 1, 2048, "fp8_tile") == 32 * 2048 * 656 + 32 * 128 * 1088 * 2 \
        == 51_904_512
    assert sparse.sparse_decode_bytes(128, 32, 1, 2048, "bf16") == 84_410_368
    assert sparse.sparse_decode_flops(128, 32, 1, 2048) == 2 * 32 * 128 * 2048 * 1088 == 18_253_611_008
    assert sparse.sparse_decode_bytes(64, 4, 2, 256) == 4 * 2 * 256 * 1152 + 4 * 2 * 64 * 1088 * 2
    # prefill, 128 heads, 4096 queries over 32768 rows: every row once, int32 indices, q in, out
    assert sparse.sparse_prefill_flops(128, 4096, 2048) == 2_336_462_209_024
    assert sparse.sparse_prefill_bytes(128, 4096, 32768, 2048) == 32768 * 1152 + 4096 * 2048 * 4 + 4096 * 128 * 1088 * 2
    # indexer, B 32 over 32768 bf16 keys of 128, 64 heads; float32 weights and logits, int32 slots
    assert sparse.indexer_bytes("logits", 32, 32768, 64, 128, 2048) == 273_162_240
    assert sparse.indexer_bytes("topk", 32, 32768, 64, 128, 2048) == 32 * 32768 * 4 + 32 * 2048 * 4
    assert sparse.indexer_bytes("both", 32, 32768, 64, 128, 2048) == 269_230_080
    assert sparse.indexer_flops("logits", 32, 32768, 64, 128) == 2 * 32 * 64 * 32768 * 128
    assert sparse.indexer_flops("topk", 32, 32768, 64, 128) == 0
    # DeepSeek's FP8 key rows: 132 bytes a key instead of 256
    assert sparse.indexer_bytes("logits", 32, 32768, 64, 128, 2048, "fp8_ue8m0") == 273_162_240 - 32 * 32768 * 124


def test_sparse_metrics_match_flashmlas_measured_figure():
    # FlashMLA, 128 heads, B 32, s_q 1, FP8 rows: 68.4 us is 267 TFLOP/s (peers.md); compute-bound at 23.1 us
    m = sparse._metrics(68.4, sparse.sparse_decode_bytes(128, 32, 1, 2048, "fp8_tile"),
                        sparse.sparse_decode_flops(128, 32, 1, 2048))
    assert m["TFLOPs"] == pytest.approx(266.9, abs=0.1) and m["TBps"] == pytest.approx(0.759, abs=1e-3)
    assert m["roof"] == pytest.approx(23.1 / 68.4, abs=1e-3)


def test_sparse_options_default_to_issue_32s_grid():
    g = sparse.grid(parse("sparse"))
    assert g.sections == ("decode", "prefill", "indexer", "step") and g.peers and g.index_keys == ("bf16", "fp8_ue8m0")
    assert (g.heads, g.batch, g.s_q, g.topk, g.context, g.page, g.kv) == (
        (16, 64, 128), (32, 128), (1, 2), 2048, 32768, 64, ("bf16", "fp8_tile"))
    assert (g.prefill_heads, g.prefill_queries, g.prefill_kv, g.index_heads, g.index_dim) == ((64, 128), 4096, 32768,
                                                                                                64, 128)
    sparse.validate(parse("sparse"))


def test_sparse_quick_shrinks_only_what_is_not_given():
    g = sparse.grid(parse("sparse", "--quick", "--topk", "256", "--heads", "64"))
    assert (g.topk, g.heads, g.context, g.batch, g.prefill_queries) == (256, (64,), 4096, (4,), 512)
    g = sparse.grid(parse("sparse", "--section", "indexer", "prefill", "indexer", "--no-peers", "--kv", "fp8_tile"))
    assert g.sections == ("indexer", "prefill") and not g.peers and g.kv == ("fp8_tile",)
    assert sparse.grid(parse("sparse", "--index-keys", "fp8_ue8m0")).index_keys == ("fp8_ue8m0",)
    assert sparse.grid(parse("sparse", "--kv", "fp8")).kv == ("fp8",)


@pytest.mark.parametrize("argv, message", [
    (("--topk", "0"), "positive"), (("--section", "dense"), "invalid choice"), (("--kv", "int8"), "invalid choice"),
    (("--topk", "5000", "--context", "4096"), "at most --context (4096)"),
    (("--section", "prefill", "--topk", "40000"), "at most --prefill-kv (32768)"),
])
def test_bad_sparse_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["sparse", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@no_cuda
def test_bench_sparse_without_peers_or_cuda_says_so_in_one_line():
    r = run_mla("bench", "sparse", "--quick", "--no-peers")
    assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith("mla bench sparse: needs a CUDA GPU")
    assert r.stderr.count("\n") == 1


def test_random_positions_are_distinct_and_in_range():
    pos = sparse_cases.random_positions(50, 300, 64, torch.Generator().manual_seed(0))
    assert pos.shape == (50, 64) and pos.min() >= 0 and pos.max() < 300
    assert all(len(set(row)) == 64 for row in pos.tolist())
    assert not (pos.sort(-1).values == pos).all()     # random order, as a top-k by score gives them


def test_slots_go_through_the_shuffled_block_table():
    table = torch.tensor([[5, 2, 7], [0, 6, 1]], dtype=torch.int32)
    pos = torch.tensor([[[0, 17, 35]], [[16, 3, 47]]])
    got = sparse_cases.slots(pos, table, 16)
    assert got.dtype == torch.int32 and got.tolist() == [[[80, 33, 115]], [[96, 3, 31]]]   # 5*16+0, 2*16+1, ...


def test_holes_sit_at_the_tail_of_every_seventh_query():
    idx = sparse_cases.punch_holes(torch.arange(2 * 10 * 12, dtype=torch.int32).view(2, 10, 12))
    rows = idx.view(-1, 12)
    holed = [q for q in range(20) if (rows[q] == -1).any()]
    assert holed == [6, 13]
    assert (rows[6, -5:] == -1).all() and (rows[6, :-5] >= 0).all()


def test_decode_cache_on_cpu():
    cache = sparse_cases.decode_cache(4, 100, 16, 2, 32, "fp8_tile", device="cpu")
    kv, table, idx = cache["kv"], cache["table"], cache["indices"]
    assert kv.shape == (4 * 7, 16, 656) and kv.dtype == torch.uint8 and table.shape == (4, 7)
    assert sorted(table.flatten().tolist()) == list(range(28))          # every block once, shuffled
    assert idx.shape == (4, 2, 32) and ((idx >= -1) & (idx < 28 * 16)).all()
    assert (idx == -1).sum() == sparse_cases.HOLES and (idx[3, 0, -5:] == -1).all()   # query 6 of the 8
    rows = quant.dequantize_rows(kv.view(-1, 656), "fp8_tile", 512)
    named = torch.zeros(28 * 16, dtype=torch.bool)
    named[idx[idx >= 0].long()] = True
    assert rows[named].isfinite().all() and rows[~named].isnan().all()  # a stray read shows as NaN
    for b in range(4):   # each query's slots lie in its own sequence's blocks, below the context
        for s in idx[b].flatten().tolist():
            if s >= 0:
                assert s // 16 in table[b].tolist() and table[b].tolist().index(s // 16) * 16 + s % 16 < 100
    c = sparse_cases.decode_case(cache, 5, 1)
    assert c["q"].shape == (4, 1, 5, 576) and torch.equal(c["indices"], idx[:, :1])
    # per-tensor FP8 rows (scale 1): the same positions, e4m3 rows of 576
    fp8 = sparse_cases.decode_cache(4, 100, 16, 2, 32, "fp8", device="cpu")
    assert fp8["kv"].shape == (28, 16, 576) and fp8["kv"].dtype == torch.float8_e4m3fn
    assert torch.equal(fp8["indices"], idx)
    named_rows = fp8["kv"].view(-1, 576)[named].float()      # the same bf16 rows, each in e4m3 (3 fraction bits)
    assert ((named_rows - rows[named]).abs() <= 0.125 * rows[named].abs() + 2 ** -9).all()
    assert fp8["kv"].view(-1, 576)[~named].float().isnan().all()


def test_prefill_and_indexer_cases_on_cpu():
    c = sparse_cases.prefill_case(4, 20, 50, 16, device="cpu")
    assert c["q"].shape == (20, 4, 576) and c["kv"].shape == (50, 1, 576) and c["indices"].shape == (20, 1, 16)
    assert (c["indices"][6, 0, -5:] == -1).all() and c["indices"].max() < 50
    c = sparse_cases.indexer_case(3, 100, 4, 16, 16, device="cpu")
    assert c["q"].shape == (3, 4, 16) and c["keys"].shape == (21, 16, 16) and c["weights"].dtype == torch.float32
    assert c["cu_seqlens_q"].tolist() == [0, 1, 2, 3] and c["seqlens"].tolist() == [100] * 3


def test_sparse_compare():
    out, lse = torch.randn(2, 3, 8), torch.randn(2, 3)
    lse[1, 2] = float("-inf")
    assert sparse_checks.compare(out, lse, out, lse)["check"] == "ok"
    assert sparse_checks.compare(out * 1.01, lse, out, lse)["check"] == "FAIL"
    bad = out.clone()
    bad[0, 0, 0] = float("nan")
    assert math.isnan(sparse_checks.compare(bad, lse, out, lse)["rel_err"])
    moved = lse.clone()
    moved[1, 2] = 0.0
    assert math.isnan(sparse_checks.compare(out, moved, out, lse)["lse_err"])
    assert sparse_checks.compare(out, lse / math.log(2), out, lse)["check"] == "FAIL: lse in base 2"


def test_sparse_compare_topk():
    from mla.ops import reference

    c = sparse_cases.indexer_case(3, 100, 4, 16, 16, device="cpu")
    logits = torch.randn(3, 100)                                        # all below 10
    logits[1, [3, 4, 5]] = 20.0
    logits[1, [7, 9]] = 10.0                # a tie for the last place of query 1: the reference takes key 7
    ref = reference.topk_indices(logits, 4, c["table"], c["cu_seqlens_q"], 16)
    slot = lambda key: sparse_cases.slots(torch.tensor([[key]]), c["table"][1:2], 16)[0, 0]  # noqa: E731
    assert ref[1, 3] == slot(7)
    keys = sparse_checks.slot_keys(c["table"], 16, 100, 21 * 16)
    assert sparse_checks.compare_topk(ref[:, [3, 1, 0, 2]], ref, logits, keys) == dict(check="ok",
                                                                                        detail="same sets 100.0%")
    other = ref.clone()
    other[1, 3] = slot(9)                   # the other tied key: the same scores, another set
    assert sparse_checks.compare_topk(other, ref, logits, keys) == dict(check="ok", detail="same sets 66.7%")
    twice = ref.clone()
    twice[0, 1] = twice[0, 0]
    assert sparse_checks.compare_topk(twice, ref, logits, keys)["check"] == "FAIL"
    foreign = ref.clone()
    foreign[0, 0] = ref[2, 0]          # a slot of sequence 2 for query 0
    assert sparse_checks.compare_topk(foreign, ref, logits, keys)["check"] == "FAIL"


def test_sparse_compare_logits():
    ref = torch.randn(2, 10)
    ref[1, 8:] = float("-inf")
    assert sparse_checks.compare_logits(ref * (1 + 1e-7), ref)["check"] == "ok"
    assert sparse_checks.compare_logits(ref * (1 + 1e-4), ref)["check"] == "FAIL"
    assert sparse_checks.compare_logits(ref.nan_to_num(neginf=-1e30), ref)["check"] == "FAIL"


def test_flashmla_refusals():
    refusal = sparse_providers.flashmla_refusal
    assert refusal("decode", 128, 2048, "fp8_tile") is None and refusal("decode", 64, 512, "fp8_tile") is None
    assert refusal("decode", 128, 2048, "bf16") == "FlashMLA's sparse decode reads FP8 656-byte rows only"
    assert "64 or 128 heads, not 16" in refusal("decode", 16, 2048, "fp8_tile")
    assert "multiple of 64, not 100" in refusal("decode", 128, 100, "fp8_tile")
    assert refusal("fwd", 64, 2048, "bf16") is None
    assert "multiple of 128, not 192" in refusal("fwd", 128, 192, "bf16")
    assert refusal("fwd", 128, 2048, "fp8_tile") == "FlashMLA's sparse prefill kernel reads bf16 rows only"


def test_sparse_providers_without_flashmla():
    assert sparse_providers.flash_mla_or_reason(False) is None
    if importlib.util.find_spec("flash_mla") is None:
        assert "not importable" in sparse_providers.flash_mla_or_reason(True)
    assert list(sparse_providers.decode_providers(None)) == ["mla.ops"]
    provs = sparse_providers.prefill_providers("flash_mla is not importable (x)")
    assert list(provs) == ["mla.ops", "flashmla"]
    with pytest.raises(sparse_providers.NotApplicable, match="not importable"):
        provs["flashmla"]({})


def test_mla_providers_on_cpu_cases():
    from mla.ops import reference

    cache = sparse_cases.decode_cache(2, 64, 16, 2, 16, "fp8_tile", device="cpu")
    c = sparse_cases.decode_case(cache, 3, 2)
    t = sparse_providers.mla_decode_provider()(c)
    out, lse = t.result(t.call(c["kv"]))
    want = reference.sparse_mla_decode(c["q"], c["kv"], c["indices"], 512, c["scale"])
    assert sparse_checks.compare(out, lse, *want) == dict(rel_err=0.0, lse_err=0.0, check="ok")
    c = sparse_cases.prefill_case(3, 10, 40, 8, device="cpu")
    t = sparse_providers.mla_prefill_provider()(c)
    out, lse = t.result(t.call(c["kv"]))
    assert sparse_checks.compare(out, lse, *reference.sparse_prefill_attention(c["q"], c["kv"], c["indices"],
                                                                               c["scale"], 512))["check"] == "ok"


def test_flashmla_results_in_mla_conventions():
    # FlashMLA's decode lse comes [B, H, s_q] with +inf for a query with no index; its prefill lse [s_q, H], +inf too
    lse = torch.tensor([[[0.5, float("inf")], [1.5, float("inf")], [2.5, float("inf")]]])      # B 1, H 3, s_q 2
    fm = SimpleNamespace(get_mla_metadata=lambda: (object(), None),
                         flash_mla_with_kvcache=lambda *a, **k: (torch.zeros(1, 2, 3, 512), lse),
                         flash_mla_sparse_fwd=lambda *a: (torch.zeros(2, 3, 512), None, lse[0].T))
    c = dict(H=64, kv_format="fp8_tile", topk=64, kv=torch.zeros(1, 64, 656, dtype=torch.uint8), q=None, indices=None,
             scale=0.1)
    t = sparse_providers.flashmla_decode_provider(fm)(c)
    out, got = t.result(t.call(c["kv"]))
    assert got.shape == (1, 2, 3) and got[0, 0].tolist() == [0.5, 1.5, 2.5] and got[0, 1].isneginf().all()
    t = sparse_providers.flashmla_prefill_provider(fm)(dict(c, topk=128, kv=None))
    out, got = t.result(t.call(None))
    assert got.shape == (2, 3) and got[1].isneginf().all()


def test_fixed_lines_and_peer_ratio():
    cols = [("H", 4, "d"), ("provider", 9, "<"), ("check", 5, "<"), ("us", 7, ".1f"), ("mla/flashmla", 12, ".2f")]
    head, rule = report.fixed_header(cols).splitlines()
    assert head.split() == ["H", "provider", "check", "us", "mla/flashmla"] and set(rule) == {"-"}
    rows = [dict(H=128, provider="mla.ops", check="ok", us=80.0), dict(H=128, provider="flashmla", check="ok", us=64.0)]
    sparse.add_peer_ratio(rows)
    assert rows[0]["mla/flashmla"] == 1.25 and "mla/flashmla" not in rows[1]
    assert report.fixed_line(rows[0], cols, "check").split() == ["128", "mla.ops", "ok", "80.0", "1.25"]
    assert report.fixed_line(rows[1], cols, "check").split()[-1] == "-"
    na = dict(H=16, provider="flashmla", check="n/a", note="n/a: 64 or 128 heads")
    assert report.fixed_line(na, cols, "check") == "  16 flashmla  n/a: 64 or 128 heads"


def test_indexer_budget_against_the_128_head_decode():
    rows = [dict(section="decode", H=128, B=32, s_q=1, kv="fp8_tile", provider="mla.ops", us=80.0),
            dict(section="decode", H=128, B=32, s_q=2, kv="fp8_tile", provider="mla.ops", us=150.0),
            dict(section="decode", H=64, B=32, s_q=1, kv="fp8_tile", provider="mla.ops", us=50.0),
            dict(section="decode", H=128, B=32, s_q=1, kv="fp8_tile", provider="flashmla", us=64.0),
            dict(section="indexer", B=32, step="logits", us=12.0), dict(section="indexer", B=32, step="topk", us=8.0),
            dict(section="indexer", B=128, step="logits", us=40.0), dict(section="indexer", B=128, step="topk", us=9.0)]
    b32, b128 = sparse.indexer_budget(rows, (32, 128))
    assert sparse.indexer_budget(rows, (32,), ("fp8_ue8m0",))[0]["text"].endswith("not timed")
    assert b32["us"] == 20.0 and b32["of_mla.ops_fp8_tile"] == 0.25 and b32["of_flashmla_fp8_tile"] == 20 / 64
    assert "25% of mla.ops fp8_tile (80.0 us)" in b32["text"] and "target <= 25%" in b32["text"]
    assert b128["us"] == 49.0 and "n/a" in b128["text"]


# ------------------------------------------------------------------ mla bench layer: the decode step

def test_layer_step_options_default_to_issue_33s_grid():
    g = layer_grid.step_grid(parse("layer"))
    assert (g.heads, g.batch, g.context) == ((16, 128), (1, 8, 32, 128), (1024, 4096, 16384))
    assert (g.weights, g.kv, g.layers, g.profile, g.peer) == (("bf16",), ("bf16",), 4, 0, True)
    args = parse("layer", "--phase", "decode", "--quick")
    assert args.phase == "decode" and layer_grid.step_grid(args).batch == (1, 32)
    assert layer_grid.step_grid(args).context == (4096,) and layer_grid.step_grid(args).heads == (16, 128)


def test_layer_step_options_select_subsets():
    g = layer_grid.step_grid(parse("layer", "--quick", "--batch", "8", "128", "8", "--context", "1k", "16K", "2048",
                                   "--heads", "128", "--weights", "fp8", "bf16", "--kv", "fp8_tile", "fp8", "fp8",
                                   "--layers", "1", "--profile", "--no-peer"))
    assert (g.batch, g.context, g.heads) == ((8, 128), (1024, 16384, 2048), (128,))   # --quick fills only the rest
    assert (g.weights, g.kv, g.layers, g.profile, g.peer) == (("fp8", "bf16"), ("fp8_tile", "fp8"), 1, 10, False)
    assert layer_grid.step_grid(parse("layer", "--profile", "3")).profile == 3
    assert layer_grid.context_tokens(" 4K ") == 4096 and layer_grid.context_tokens("2") == 2


@pytest.mark.parametrize("argv, message", [
    (("--context", "1"), "token count >= 2"), (("--context", "4kk"), "positive integer"),
    (("--kv", "int4"), "invalid choice"), (("--weights", "fp4"), "invalid choice"),
    (("--layers", "0"), "positive integer"), (("--profile", "0"), "positive integer"), (("--batch", "x"), "positive"),
    (("--context", "4k", "200k"), "at most 163840 tokens"),
])
def test_bad_layer_options_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["layer", *argv])
    err = capsys.readouterr().err
    assert (e.value.code, message in err, "Traceback" in err) == (2, True, False), err


def test_layer_step_floor_by_hand():
    # DeepSeek-V3, 128 heads, bf16: q_a + kv_a 2112 x 7168, q_b 24576 x 1536, kv_b 32768 x 512, o 7168 x 16384
    layer = mla.MLA(mla.MLAConfig.preset("deepseek-v3"), dtype=torch.bfloat16, device="meta")
    elements = 2112 * 7168 + 24576 * 1536 + 32768 * 512 + 7168 * 16384
    assert elements == 187_105_280
    # the matrices, the two latent norms (1536 + 512 bf16) and the RoPE frequencies (32 float32)
    assert layer_grid.weight_bytes(layer) == 2 * elements + 2 * 2048 + 4 * 32 == 374_214_784
    assert layer_grid.projection_flops(layer, 32) == (2 * 32 * elements, 0)
    # B 32: 87.4 us of reading weights against 15.2 us of GEMM; + 30 us of decode kernel
    assert layer_grid.floor_us(374_214_784, 2 * 32 * elements, 0, 30.0) == pytest.approx(374_214_784 / 4.28e6 + 30)
    # compute-bound: 7.9 GFLOP bf16 (10 us) + 15.8 GFLOP FP8 at twice the peak (10 us) against 4.28 MB (1 us)
    assert layer_grid.FP8_GEMM_FLOPS_PER_S == 2 * roofline.GEMM_FLOPS_PER_S
    assert layer_grid.floor_us(4.28e6, 7.9e9, 15.8e9, 5.0) == pytest.approx(25.0)
    assert layer_grid.floor_us(4.28e7, 7.9e9, 0, 0.0) == pytest.approx(10.0)


def test_layer_step_floor_of_fp8_weights():
    cfg = mla.MLAConfig.preset("tiny")      # D 256, H 4, q_lora 64, r 64, dn 32, dr 16, dv 32
    sd = quantize_checkpoint_fp8(random_state_dict(cfg, torch.Generator().manual_seed(0)))
    layer = layer_step.build_layer(cfg, sd, "fp8", device="cpu")
    assert layer.w_q_b.dtype == layer.w_o.dtype == torch.float8_e4m3fn and layer.w_a.dtype == torch.bfloat16
    bf16, fp8 = (64 + 80) * 256 + 4 * 64 * 64, 4 * 48 * 64 + 256 * 128   # fused q_a/kv_a, kv_b | q_b, o
    scales = 4 * (2 * 1 + 2 * 1)            # one float32 per 128 x 128 block of q_b (192 x 64) and o (256 x 128)
    assert layer_grid.weight_bytes(layer) == 2 * bf16 + fp8 + scales + 2 * (64 + 64) + 4 * 8
    assert layer_grid.projection_flops(layer, 3) == (2 * 3 * bf16, 2 * 3 * fp8)


def test_layer_step_memory_by_hand():
    cfg = mla.MLAConfig.preset("deepseek-v3")
    # B 2 x 100 tokens: 2 pages of 64 a sequence; rows of 1152, 576 and 656 bytes
    assert layer_grid.cache_bytes(cfg, "bf16", 2, 100) == 2 * 2 * 64 * 1152
    assert layer_grid.cache_bytes(cfg, "fp8", 2, 100, layers=4) == 4 * 2 * 2 * 64 * 576
    assert layer_grid.cache_bytes(cfg, "fp8_tile", 2, 100) == 2 * 2 * 64 * 656
    # a 2.4 GB cache: no rotated copy; a 4-layer cache of 1 MB a layer: 240 copies of one layer
    big = layer_grid.cache_bytes(cfg, "bf16", 128, 16384)
    assert layer_grid.row_bytes_needed(cfg, "bf16", 128, 16384) == big + layer_grid.HEADROOM
    one = layer_grid.cache_bytes(cfg, "bf16", 1, 1024)
    assert layer_grid.row_bytes_needed(cfg, "bf16", 1, 1024, 4) == 4 * one + 63 * one + layer_grid.HEADROOM
    fill = 12 * 1024 * 576       # the quantization's temporaries of the 1024 rows
    assert layer_grid.row_bytes_needed(cfg, "fp8", 1, 1024) == 64 * one // 2 + fill + layer_grid.HEADROOM


def test_layer_step_fills_every_format_through_the_block_table():
    cfg = mla.MLAConfig.preset("tiny").replace(kv_lora_rank=128)     # tile rows: a multiple of 128
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 40, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g).to(torch.bfloat16)
    for kv, (dtype, scaling) in layer_grid.KV_FORMATS.items():
        cache = mla.PagedLatentCache(cfg, num_layers=2, num_blocks=40, block_size=16, dtype=dtype, fp8_scaling=scaling)
        cache.prepare([("pad", 20)])          # the sequences' blocks do not start at 0
        cache.prepare([(b, 40) for b in range(3)])
        layer_step.fill_latents(cache, cache.prepare([(b, 1) for b in range(3)]).block_table, latents, chunk_rows=50)
        fmt = cache.format
        for b in range(3):
            rows = cache.kv[1, cache.blocks(b)].reshape(-1, cache.kv.shape[-1])[:40]
            got = rows.float() if fmt == "plain" else quant.dequantize_rows(rows, fmt, cfg.kv_lora_rank)
            tol = 0 if fmt == "plain" else 0.07      # e4m3: 3 mantissa bits
            assert (got - latents[b].float()).abs().max() <= tol * latents[b].float().abs().max(), kv
        assert cache.kv[:, cache.blocks("pad")].float().abs().sum() == 0


def test_layer_step_profile_table_from_events():
    from torch.autograd import DeviceType

    def ev(key, count, us, device=DeviceType.CUDA):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us, device_type=device)
    events = [ev("gemm", 40, 600.0), ev("decode", 20, 300.0), ev("Memcpy DtoD", 60, 60.0), ev("rms", 40, 40.0),
              ev("cudaGraphLaunch", 20, 1000.0, DeviceType.CPU), ev("idle", 20, 0.0)]
    rows = layer_grid.top_kernels(events, 20, 2)
    assert [r["kernel"] for r in rows] == ["gemm", "decode", "(2 others)"]
    assert [r["us"] for r in rows] == [30.0, 15.0, 5.0] and [r["calls"] for r in rows] == [2.0, 1.0, 5.0]
    assert [r["share"] for r in rows] == [0.6, 0.3, pytest.approx(0.1)]
    assert layer_grid.top_kernels([], 20, 5) == []


def test_transformers_config_of_deepseek_v3():
    for cfg in (mla.MLAConfig.preset("deepseek-v3").replace(num_heads=16), mla.MLAConfig.preset("tiny")):
        hf = layer_peer.hf_config(cfg)
        assert hf.num_attention_heads == hf.num_key_value_heads == cfg.num_heads and hf.rope_interleave
        assert hf._attn_implementation == "sdpa" and mla.MLAConfig.from_hf(hf) == cfg
    # kv_b_proj's output [B, L, H, 256], the keys [B, H, L, 192], the values [B, H, L, 128], the cache
    assert layer_peer.step_bytes(mla.MLAConfig.preset("deepseek-v3"), 2, 100) == 2 * 2 * 100 * (
        128 * (256 + 192 + 128) + 576)


def _peer_case(cfg, B, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = random_state_dict(cfg, g)
    layer = layer_step.build_layer(cfg, sd, device="cpu")
    latents = torch.randn(B, L - 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g).to(torch.bfloat16)
    x = torch.randn(B, cfg.hidden_size, generator=g).to(torch.bfloat16)
    cache = mla.PagedLatentCache(cfg, num_blocks=B * 4, block_size=16, dtype=torch.bfloat16)
    cache.prepare([(b, L - 1) for b in range(B)])
    batch = cache.prepare([(b, 1) for b in range(B)])
    layer_step.fill_latents(cache, batch.block_table, latents)
    return sd, latents, x, layer(x, batch)


def test_transformers_peer_on_the_same_rows_agrees_with_mla(monkeypatch):
    cfg = mla.MLAConfig.preset("tiny")
    sd, latents, x, want = _peer_case(cfg, 3, 50)
    module, hf = layer_peer.attention(cfg, sd, "cpu")
    step = layer_peer.StaticStep(hf, x, latents, cfg.rope_interleave)
    assert step.mask.shape == (3, 1, 1, 50) and step.mask.dtype == torch.bool
    assert step.cache.layers[0].keys.shape == (3, 1, 50, cfg.kv_lora_rank)
    out = step(module)
    assert out.shape == (3, 1, cfg.hidden_size) and int(step.position) == 50     # the call wrote token 49
    assert step(module).equal(out)                 # the write position goes back to 49 each call
    assert bench.rel_err(out.view(3, -1), want.float()) < layer_peer.TOL / 3
    monkeypatch.setattr(timing, "eager_time_us", lambda fn: (fn(), 123.0)[1])
    row = layer_peer.time_peer(module, None, step, want)
    assert row["eager_us"] == 123.0 and row["rel_err"] < layer_peer.TOL / 3 and "graph_us" not in row
    # k_pe in mla's interleaved layout where transformers' is expected: the check refuses the peer
    wrong = layer_peer.StaticStep(hf, x, latents, interleave=False)
    with pytest.raises(RuntimeError, match="off mla's eager step"):
        layer_peer.time_peer(module, None, wrong, want)


def test_layer_step_rows_on_cpu_with_stand_in_timers(monkeypatch, capsys):
    monkeypatch.setattr(layer_step, "eager_time_us", lambda fn: (fn(), 100.0)[1])
    monkeypatch.setattr(layer_step, "graph_time_us", lambda calls: ([c() for c in calls], 40.0)[1])
    monkeypatch.setattr(layer_step, "rotated_copies", lambda kv: [kv])
    monkeypatch.setattr(timing, "eager_time_us", lambda fn: (fn(), 300.0)[1])
    g = layer_grid.StepGrid(heads=(1,), batch=(2,), context=(70,), weights=("bf16", "fp8"), kv=("bf16", "fp8_tile"),
                            layers=2, profile=0, peer=True)
    emitted = []
    rows = layer_step.run_step(g, lambda rs: emitted.append(len(rs)), device="cpu")
    assert emitted == [6] and [(r["weights"], r["kv"], r["layers"], r["provider"]) for r in rows] == [
        ("bf16", "bf16", 1, "mla"), ("fp8", "bf16", 1, "mla"), ("bf16", "fp8_tile", 1, "mla"),
        ("fp8", "fp8_tile", 1, "mla"), ("bf16", "bf16", 2, "mla"), ("bf16", "bf16", 1, "transformers")]
    assert not [r for r in rows if "error" in r or "note" in r]
    one, two, hf = rows[0], rows[4], rows[5]
    assert one["rel_err"] == 0.0 and hf["rel_err"] < layer_peer.TOL / 3    # DeepSeek-V3's dims, one head
    assert (one["eager_us"], one["graph_us"], one["replay_us"], one["kernel_us"]) == (100.0, 100.0, 40.0, 40.0)
    assert (two["eager_us"], two["replay_us"]) == (50.0, 20.0)            # per layer of the two
    assert one["floor_us"] == two["floor_us"] == hf["floor_us"] > rows[1]["floor_us"] > 40.0   # FP8 weights: fewer
    assert one["eager/fl"] == pytest.approx(100.0 / one["floor_us"])
    assert one["hf/eager"] == 3.0 and two["hf/eager"] == 6.0 and "hf/graph" not in one    # not compiled on CPU
    out = capsys.readouterr().out
    assert "transformers 5." in out and out.count("\n   1    2     70 ") == 6


def test_layer_step_rows_note_what_did_not_run(capsys):
    row = dict(H=16, provider="mla")

    def fails(e):
        def fn():
            raise e
        return fn
    assert layer_step._attempt(row, lambda: (dict(eager_us=1.0), "x")) == (dict(row, eager_us=1.0), "x")
    got, extra = layer_step._attempt(row, fails(ValueError("num_blocks: 9 blocks need 1 GiB on cuda")))
    assert got["note"].startswith("skipped: num_blocks:") and extra is None and "error" not in got
    assert layer_step._attempt(row, fails(torch.OutOfMemoryError("CUDA out of memory")))[0]["note"].startswith(
        "skipped: out of memory")
    got, _ = layer_step._attempt(row, fails(ValueError("batch: stale")))
    assert got["error"] == "ValueError: batch: stale" and "note" not in got
    assert "Traceback" in capsys.readouterr().err       # an error shows its traceback; a skip does not
    cfg = mla.MLAConfig.preset("deepseek-v3")
    x, latents = torch.zeros(128, 1), torch.zeros(128, 16383, 1)
    hf = layer_step._peer_row((None, None, None), cfg, dict(H=128, B=128, L=16384), x, latents, None, None)
    assert hf["provider"] == "transformers" and hf["note"].startswith("skipped: a step expands the whole cache")


def test_layer_step_profile_falls_back_to_the_eager_step(monkeypatch):
    seen = {"graph": [dict(kernel="Memcpy DtoD", calls=8.0, us=4.0, share=1.0)],
            "eager": [dict(kernel="gemm", calls=3.0, us=60.0, share=0.75), dict(kernel="decode", calls=1.0, us=20.0,
                                                                                 share=0.25)]}
    monkeypatch.setattr(layer_step, "_profile", lambda fn, steps, top: seen[fn()])
    lines = layer_step.profile_lines(lambda: "graph", lambda: "eager", "H16 B1", 5, least_us=50.0)
    assert "the eager step (the profiler did not see inside the graph): 80.0 us" in lines[0]
    assert lines[2].split() == ["60.0", "75.0%", "3.0", "gemm"] and len(lines) == 4
    lines = layer_step.profile_lines(lambda: "graph", lambda: "eager", "H16 B1", 5, least_us=6.0)
    assert "the graphed step: 4.0 us" in lines[0] and lines[2].split() == ["4.0", "100.0%", "8.0", "Memcpy", "DtoD"]


# ------------------------------------------------------------------ mla bench sparse --section step

@pytest.mark.parametrize("keys", ["bf16", "fp8_ue8m0"])
def test_sparse_step_fills_index_keys_through_the_block_table(keys):
    from mla.bench import sparse_step

    cfg = sparse_step.v32_config(1, 16, 4, 64)
    assert cfg.has_indexer and cfg.num_heads == 1 and cfg.kv_lora_rank == 512 and not cfg.index_rope_interleave
    cache = mla.PagedLatentCache(cfg, num_blocks=12, block_size=16, dtype=torch.bfloat16,
                                 index_format=None if keys == "bf16" else keys)
    cache.prepare([("pad", 20)])
    cache.prepare([(b, 40) for b in range(2)])
    table = cache.prepare([(b, 1) for b in range(2)]).block_table
    sparse_step.fill_index_keys(cache, table, 40, torch.Generator().manual_seed(0))
    flat = cache.index_keys(0).view(-1, cache.index_keys(0).shape[-1])
    for b in range(2):
        slots = table[b, torch.arange(40) // 16].long() * 16 + torch.arange(40) % 16
        got = flat[slots].float() if keys == "bf16" else quant.dequantize_index(flat[slots], 64)
        assert torch.isfinite(got).all() and (got.abs().sum(-1) > 0).all()
        assert flat[slots[-1] + 1:slots[-1] + 8].float().abs().sum() == 0     # the open block's rest untouched
    assert cache.index_keys(0)[cache.blocks("pad")].float().abs().sum() == 0


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8_tile"])
def test_sparse_step_row_on_cpu_with_stand_in_timers(monkeypatch, kv):
    from mla.bench import sparse_step

    times = iter([300.0, 100.0])
    monkeypatch.setattr(sparse_step, "_replay_checked", lambda step, want: (next(times), bench.rel_err(
        step().float(), want.float())))
    monkeypatch.setattr(sparse_step, "kernel_times_us", lambda fn: (fn(), {"_logits_kernel": 9.0, "gemm": 20.0})[1])
    made = []
    real = mla.PagedLatentCache
    monkeypatch.setattr(mla, "PagedLatentCache", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    row, lines = sparse_step.step_shape(1, 2, 70, 16, 4, 64, "bf16", 16, device="cpu", kv=kv)
    assert [c.format for c in made] == [{"bf16": "plain"}.get(kv, kv)] * 2     # the dense and the sparse layer's
    assert (row["dense_us"], row["sparse_us"], row["speedup"]) == (300.0, 100.0, 3.0)
    assert row["check"] == "ok" and row["rel_err"] == 0.0
    assert (row["H"], row["B"], row["L"], row["kv"]) == (1, 2, 70, kv)
    assert lines == ["      sparse step's kernels (us, eager): gemm 20.0, _logits_kernel 9.0"]


# ------------------------------------------------------------------ benchmarks/serve.py

def test_serve_benchmark_tiny_run_reports_each_run(tmp_path):
    """The serving benchmark's CPU smoke run: every request served, the steps split into eager
    and whole-step ones, the eager forwards' tokens (every prompt token, and the decode tokens
    that rode along in mixed steps), and the
    profiled eager forward's tables."""
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"
    done = subprocess.run([sys.executable, str(script), "--tiny", "--requests", "12", "--poisson", "0",
                           "--profile-step", "1", "--static-batches", "4", "--graphs", "on", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    import json
    report = json.loads(out.read_text())
    run = report["all_at_once"]
    assert run["output_tokens"] == report["trace"]["output_tokens"]
    trace = report["trace"]    # every prompt token, and the decode tokens of mixed steps
    assert trace["prompt_tokens"] <= run["eager"]["tokens"] < trace["prompt_tokens"] + trace["output_tokens"]
    assert run["eager"]["steps"] + run["graphed_steps"] == run["steps"] and run["graphed_steps"] > 0
    assert run["profile"].startswith("eager step 1:") and "aten::" in run["profile"]
    assert not any(k.startswith("poisson") for k in report) and report["static"][0]["batch"] == 4
    assert report["all_at_once_sync"] is not None and "all_at_once_async" not in report   # CPU: no streams
    for key in ("ttft", "tpot", "itl"):
        lat = run[key]
        assert 0 < lat["p50"] <= lat["p99"] and lat["mean"] > 0
    assert run["requests_per_s"] > 0 and run["latencies_over"] == 12
