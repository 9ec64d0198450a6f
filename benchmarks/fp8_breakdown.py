"""Where the FP8 narrow decode kernel's time goes (docs/PERF.md, "Decode: narrow kernel").

    PYTHONPATH=src python3 benchmarks/fp8_breakdown.py

Builds two variants of ``mla/ops/triton/decode_gluon_narrow.py`` by editing its source text
(compile-time switches the library does not carry), imports them from a temporary directory
and times them beside the kernel as shipped, 16 heads, DeepSeek-V3 rows, method of
``mla bench decode`` (CUDA graph over rotated caches):
  no widening    each warpgroup waits for its FP8 staging tiles and releases them, then runs
                 the MMAs and the softmax on whatever its bf16 tile holds (output wrong)
  widening only  the tiles are widened, the MMAs and the softmax are skipped (output wrong)
The edits assert that the text they replace is there, so a change to the kernel shows here.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from variants import KERNELS, absolute_imports, edit as _edit, load_module, time_launchers  # noqa: E402

from mla import bench  # noqa: E402

SRC = KERNELS / "decode_gluon_narrow.py"


def variant_source(mode: str) -> str:
    """The kernel's source with the widening ("no_widen") or the MMAs ("widen_only") taken out."""
    src = absolute_imports(SRC.read_text())
    lines = src.split("\n")
    if mode == "no_widen":
        # the two _widen calls and the tail zeroing -> wait for the staging tiles, release them
        i = next(k for k, l in enumerate(lines) if l.strip().startswith("_widen(st8, ready, 2 * j,"))
        j = next(k for k in range(i, len(lines)) if lines[k].strip() == "mbarrier.arrive(turn.index(WG), count=1)")
        pad = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        lines[i:j] = [pad + "_release(st8, ready, 2 * j)", pad + "if n0 + 32 < end:", pad + "    _release(st8, ready, 2 * j + 1)"]
        src = "\n".join(lines)
        src = _edit(src, "@gluon.jit\ndef _narrow_wg(", '''@gluon.jit
def _release(st8, ready, j):
    k8, pe8, sc8, free8 = st8
    NST: gl.constexpr = k8.shape[0]
    mbarrier.wait(ready.index((j % NST) * 9), (j // NST) & 1)
    gl.thread_barrier()
    mbarrier.arrive(free8.index(j % NST), count=1)


@gluon.jit
def _narrow_wg(''')
    elif mode == "widen_only":
        # everything from S^T to the O^T MMA's wait goes under a compile-time False
        i = next(k for k, l in enumerate(lines) if l.strip() == "s = gl.zeros([64, R], gl.float32, A_L)")
        j = next(k for k in range(i, len(lines)) if "acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))" in lines[k])
        pad = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        lines[i:j + 1] = [pad + "if KV_FMT == 0:"] + ["    " + l for l in lines[i:j + 1]]
        src = "\n".join(lines)
    else:
        raise ValueError(mode)
    return src


def load_variant(mode: str, workdir: Path):
    return load_module(variant_source(mode), f"narrow_{mode}", workdir)


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("fp8_breakdown: needs a CUDA GPU")
    from mla.ops.triton import decode_gluon_narrow as shipped

    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"shipped": shipped, **{m: load_variant(m, Path(tmp)) for m in ("no_widen", "widen_only")}}
        print(f"{'B':>4} {'L':>6} {'kv':>8} " + " ".join(f"{k + ' us':>14}" for k in kernels) + "  err (shipped)")
        for B, L in [(128, 16384), (32, 16384)]:
            for kvf in ("bf16", "fp8", "fp8_tile"):
                c = bench.decode_case(16, B, L, 1, 64, kv_format=kvf)

                def launch(kv, mod, c=c):
                    return mod.launch_narrow(c["q"], kv, c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
                # bf16 rows: the shipped kernel only (the variants edit the FP8 path)
                launchers = {name: (lambda kv, mod=mod: launch(kv, mod))
                             for name, mod in kernels.items() if kvf != "bf16" or name == "shipped"}
                times, err = time_launchers(c, launchers)
                print(f"{B:>4} {L:>6} {kvf:>8} " + " ".join(f"{times.get(k, float('nan')):14.1f}" for k in kernels)
                      + f"  {err:.1e}", flush=True)
                del c, launchers
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
