"""The dispatched decode op of two source trees, bit for bit, on the same inputs, in one call:
the check behind a refactor or a rescheduling that claims "the same arithmetic".

    git archive main src | tar -x -C build/main        # here, before the device call
    python3 tools/bitcheck_decode.py build/main/src src [--kv bf16 fp8 fp8_tile]

Each tree runs ``mla.ops.mla_decode`` in its own process on cases that reach every Hopper kernel
(batch 1 to 32, 7 / 16 / 128 heads, s_q 1 and 2, random lengths, a query with 14 octaves of
range so that small values and FP8 subnormals occur), and saves out and lse; then one line a
case: identical, or the largest difference. Exit status 1 when any differs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab_decode import tree_env  # noqa: E402

# (H, B, L, s_q): small batches (portable / narrow), B 32 (split kernels), odd heads, MTP rows
CASES = ((16, 1, 3000, 1), (16, 8, 1000, 1), (16, 32, 4096, 1), (16, 4, 3000, 2), (7, 3, 777, 1),
         (128, 2, 2000, 1), (128, 4, 1500, 2))
R = 512   # the latent width (head_dim_v) of decode_case's default shapes, in every tree compared


def save_outputs(path: str, kv_formats: list[str]) -> None:
    from mla import bench, ops

    res = {}
    for fmt in kv_formats:
        for H, B, L, s_q in CASES:
            c = bench.decode_case(H, B, L, s_q, 64, kv_format=fmt)
            g = torch.Generator(device="cuda").manual_seed(5)
            seqlens = torch.randint(s_q, L + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
            octaves = torch.randint(0, 14, c["q"].shape, device="cuda", generator=g).float()
            q = c["q"] * torch.exp2(-octaves).to(c["q"].dtype)
            out, lse = ops.mla_decode(q, c["kv"], c["table"], seqlens, R, c["scale"], True)
            res[(fmt, H, B, L, s_q)] = (out.cpu(), lse.cpu())
    torch.save(res, path)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="*", help="two src directories (the first is the reference)")
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8", "fp8_tile"], choices=["bf16", "fp8", "fp8_tile"])
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)   # the worker's mode
    args = p.parse_args(argv)
    if args.save:
        save_outputs(args.save, args.kv)
        return 0
    if len(args.trees) != 2:
        p.error("expected two source trees")
    work = Path(tempfile.mkdtemp())
    saved = []
    for i, src in enumerate(args.trees):
        saved.append(work / f"tree{i}.pt")
        subprocess.run([sys.executable, __file__, "--save", str(saved[-1]), "--kv", *args.kv], env=tree_env(src),
                       check=True)
    differ = compare(*(torch.load(f) for f in saved))
    return 1 if differ else 0


def compare(a: dict, b: dict) -> int:
    """Print one line a case and output of a against b (saved by ``save_outputs``); return how many
    differ in any bit (NaN against the same NaN bits is identical)."""
    differ = 0
    for key in a:
        for name, x, y in (("out", a[key][0], b[key][0]), ("lse", a[key][1], b[key][1])):
            same = x.shape == y.shape and x.dtype == y.dtype and torch.equal(_bits(x), _bits(y))
            differ += not same
            detail = "identical" if same else f"DIFFERENT, max |a - b| {(x.float() - y.float()).abs().max().item():.3e}"
            print(f"{key[0]:>8} H {key[1]:>3} B {key[2]:>2} L {key[3]:>5} s_q {key[4]} {name}: {detail}")
    print("all identical" if differ == 0 else f"{differ} of {2 * len(a)} differ")
    return differ


if __name__ == "__main__":
    raise SystemExit(main())
