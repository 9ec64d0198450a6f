"""Compile a decode kernel for sm_90a without a GPU and count what matters in its SASS:
registers, spills, shared memory, and the shared-memory, shuffle, conversion and MMA
instructions (a layout conversion that is not free shows up as extra STS/LDS/SHFL).

    PYTHONPATH=src python3 tools/compile_sm90.py {fp8,fp8tile,seesaw,seesaw-fp8,seesaw-fp8tile,narrow,sparse,
                                                  sparse-f32,sparse-fp8,sparse-fp8tile,
                                                  portable,portable-page16,portable-fp8,portable-tile,portable-fp32,
                                                  portable-persistent}
        [--block-b 32] [--partials bf16]

Each kernel is compiled from the module as it is (no source edits), with the constexprs a
launch at 16 heads (FP8, narrow) or 128 heads (seesaw, its FP8 rows), page 64, would give it
(the portable kernel: 64 query rows, page 64 or, for -page16 and the tile and fp32 rows, a
page the key tile does not divide).
The counts are the whole kernel's: a warp-specialized kernel's partitions follow one another
in the SASS, each after its USETMAXREG.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon  # noqa: F401  (registers the Gluon frontend)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

BLOCK_B = 32       # default of --block-b: the split plan's vector width (a batch of 17-32 sequences)
PARTIALS = "bf16"  # default of --partials: the FP8 kernel's and the seesaw's partials (as launched: out's dtype)
KEEP = ("LDS", "STS", "LDSM", "STSM", "SHFL", "PRMT", "F2FP", "HGMMA", "QGMMA", "LDL", "STL", "BAR", "SEL", "I2F", "F2F")


def sass_counts(kernel) -> tuple[str, Counter]:
    """(cuobjdump's resource line: registers, stack, shared; the counts of the KEEP opcodes)."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])

        def dump(flag):
            return subprocess.run([os.path.join(tools, "cuobjdump"), flag, cubin], capture_output=True, text=True,
                                  check=True).stdout
        sass, res = dump("-sass"), dump("-res-usage")
    ops = Counter(m.group(1) for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.\S*)?",
                                                  sass, re.M))
    usage = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res))
    return usage, Counter({k: v for k, v in ops.items() if k in KEEP})


def compile_gluon(fn, signature: dict, constexprs: dict, aligned=(), num_warps: int = 4, maxnreg: int | None = None):
    """fn compiled as a launch would: ``aligned`` names the arguments a launch would see
    divisible by 16 (pointers from torch, strides of contiguous tensors), which Triton
    specializes on (vectorized loads and stores depend on it)."""
    names = list(fn.arg_names)
    sig = {n: signature.get(n, "constexpr") for n in names}
    cx = {(names.index(k),): v for k, v in constexprs.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    opts = dict(num_warps=num_warps)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(GluonASTSource(fn, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=opts)


_INTS = ["stride_qb", "stride_qi", "stride_qh", "stride_bt", "bt_width", "stride_os", "stride_ob", "stride_oi", "stride_oh",
         "stride_ls", "stride_lb", "stride_li", "H", "S_Q", "B", "block_size", "num_splits",
         "eq_splits"]
_ALIGNED = ["Q", "BT", "SEQLENS", "O", "LSE", "INFO", "stride_qb", "stride_qi", "stride_qh", "stride_bt", "stride_os",
            "stride_ob", "stride_oi", "stride_oh", "stride_ls", "stride_lb", "block_size"]


def fp8_kernel(m=None, tile: bool = False, block_b: int = BLOCK_B, partials: str = PARTIALS):
    """the FP8 Gluon kernel (or that of another module with the same kernel, e.g. from another tree),
    over FP8 rows or (tile) FP8 tile rows."""
    if m is None:
        from mla.ops.decode.gluon import fp8 as m
    fp8_l = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)
    desc = f"tensordesc<fp8e4nv[64, 64],{fp8_l!r}>"
    pe, sc = desc, desc
    if tile:
        pe = f"tensordesc<bf16[64, 64],{gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)!r}>"
        sc = f"tensordesc<fp32[64, 4],{gl.NVMMASharedLayout.get_default_for([64, 4], gl.float32)!r}>"
    sig = {"Q": "*bf16", "kv_desc": desc, "pe_desc": pe, "sc_desc": sc, "BT": "*i32", "SEQLENS": "*i32",
           "O": "*" + partials, "LSE": "*fp32", "INFO": "*i32", "qk_scale": "fp32", "v_scale": "fp32",
           **{k: "i32" for k in _INTS}}
    cx = {"CAUSAL": True, "TILE": tile, "ROW_GROUPS": 1, "P_SM": gl.NVMMASharedLayout.get_default_for([64, 16], gl.float16),
          "Q8_SM": gl.NVMMASharedLayout.get_default_for([32, 64], gl.float8e4nv),
          "QPE_SM": gl.NVMMASharedLayout.get_default_for([32, 64], gl.bfloat16), "BLOCK_B": block_b, "num_warps": 4}
    return compile_gluon(m._fp8_kernel, sig, cx, _ALIGNED, maxnreg=168)   # 16 heads, 16 rows, page 64


def _bf16_sig(extra: dict, o_type: str) -> dict:
    bf16_l = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    desc = f"tensordesc<bf16[64, 64],{bf16_l!r}>"
    return {"Q": "*bf16", "kv_desc": desc, "pe_desc": desc, "sc_desc": desc, "BT": "*i32", "SEQLENS": "*i32",
            "O": o_type, "LSE": "*fp32", "INFO": "*i32", "qk_scale": "fp32", "v_scale": "fp32",
            **{k: "i32" for k in _INTS}, **extra}


def seesaw_kernel(m=None, block_b: int = BLOCK_B, partials: str = PARTIALS, direct: bool = False):
    """the seesaw Gluon kernel (or that of another module with the same kernel, e.g. from another tree) on
    bf16 rows, 64-key tiles, 128 heads, the partials of --partials (bf16: by TMA, as launched); direct:
    a sequence's only program writes the output (``split_plan.planned_results(direct=True)``)."""
    if m is None:
        from mla.ops.decode.gluon import seesaw as m
    bf16_l = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    o_type = "*" + partials
    sig = _bf16_sig({"o_desc": f"tensordesc<bf16[64, 64],{bf16_l!r}>"}, o_type)
    # 16-bit partials go out by TMA (launch_gluon), float32 ones from registers
    cx = {"CAUSAL": True, "KV_FMT": 0, "dtype": gl.bfloat16, "SM_L": bf16_l, "P_SM": bf16_l, "TMA_OUT": o_type != "*fp32",
          "BLOCK_B": block_b, "num_warps": 4, **({"DIRECT": True} if direct else {})}
    return compile_gluon(m._seesaw_kernel, sig, cx, _ALIGNED, maxnreg=168)


def seesaw_fp8_kernel(m=None, tile: bool = False, block_b: int = BLOCK_B):
    """the seesaw (or that of another module with the same kernel) on FP8 rows (tile: FP8 tile
    rows), 32-key tiles, 128 heads, bf16 queries: fp16 MMAs for e4m3 rows (float32 partials
    from registers, as launched), bf16 for tile rows."""
    if m is None:
        from mla.ops.decode.gluon import seesaw as m
    f8 = f"tensordesc<fp8e4nv[32, 64],{gl.NVMMASharedLayout.get_default_for([32, 64], gl.float8e4nv)!r}>"
    pe = sc = f8
    if tile:
        pe = f"tensordesc<bf16[32, 64],{gl.NVMMASharedLayout.get_default_for([32, 64], gl.bfloat16)!r}>"
        sc = f"tensordesc<fp32[32, 4],{gl.NVMMASharedLayout.get_default_for([32, 4], gl.float32)!r}>"
    gdt = gl.float16      # FP8 rows, tile rows too, widen into fp16 (seesaw.launch)
    sig = _bf16_sig({"o_desc": f8}, "*fp32")
    sig.update({"kv_desc": f8, "pe_desc": pe, "sc_desc": sc})
    cx = {"CAUSAL": True, "KV_FMT": 2 if tile else 1, "dtype": gdt,
          "SM_L": gl.NVMMASharedLayout.get_default_for([32, 64], gdt),
          "P_SM": gl.NVMMASharedLayout.get_default_for([64, 32], gdt), "TMA_OUT": False, "BLOCK_B": block_b,
          "num_warps": 4}
    return compile_gluon(m._seesaw_kernel, sig, cx, _ALIGNED, maxnreg=168)


def narrow_kernel(m=None, block_b: int = BLOCK_B):
    """the narrow Gluon kernel (or that of another module with the same kernel, e.g. from
    variant) on bf16 rows, 16 query rows, a ring of two tiles."""
    if m is None:
        from mla.ops.decode.gluon import narrow as m
    cx = {"R": 16, "CAUSAL": True, "KV_FMT": 0, "NST": 2, "dtype": gl.bfloat16,
          "SM_L": gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16),
          "P_SM": gl.NVMMASharedLayout.get_default_for([64, 16], gl.bfloat16), "BLOCK_B": block_b, "num_warps": 4}
    return compile_gluon(m._narrow_kernel, _bf16_sig({}, "*fp32"), cx, _ALIGNED, maxnreg=168)     # float32 partials


def sparse_kernel(m=None, partials: str = PARTIALS, BN: int = 64, kv: str = "bf16"):
    """the sparse Gluon kernel (the seesaw over gathered rows), 128 heads, BN-key tiles, on rows
    of kv ("bf16"; "fp8" per-tensor and "tile" FP8 tile rows: 32-key tiles, the producer);
    bf16 partials: one split, out by TMA; fp32: float32 partials from registers."""
    if m is None:
        from mla.ops.decode.gluon import sparse as m
    fmt = {"bf16": 0, "fp8": 1, "tile": 2}[kv]
    gdt = gl.float16 if fmt != 0 else gl.bfloat16
    o_l = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    ints = ["stride_qn", "stride_qh", "stride_row", "stride_pe", "stride_sc", "stride_in", "stride_os", "stride_on",
            "stride_oh", "stride_ls", "stride_ln", "H", "num_slots", "topk", "chunk", "num_splits", "has_sink"]
    rows = {0: ("*bf16", "*bf16", "*bf16"), 1: ("*fp8e4nv",) * 3, 2: ("*fp8e4nv", "*bf16", "*fp32")}[fmt]
    sig = {"Q": "*bf16", "KV": rows[0], "PE": rows[1], "SC": rows[2], "IDX": "*i32", "SINK": "*fp32",
           "O": "*" + partials, "LSE": "*fp32", "o_desc": f"tensordesc<bf16[64, 64],{o_l!r}>", "qk_scale": "fp32",
           "v_scale": "fp32", **{k: "i32" for k in ints}}
    cx = {"BN": BN, "dtype": gdt, "SM_L": gl.NVMMASharedLayout.get_default_for([BN, 64], gdt),
          "P_SM": gl.NVMMASharedLayout.get_default_for([64, BN], gdt), "TMA_OUT": partials != "fp32" and fmt != 1,
          "KV_FMT": fmt, "num_warps": 4}
    aligned = ["Q", "KV", "PE", "SC", "IDX", "O", "LSE", "stride_qn", "stride_qh", "stride_row", "stride_pe",
               "stride_sc", "stride_in", "stride_os", "stride_on", "stride_oh", "stride_ls", "stride_ln"]
    if fmt == 2:    # 656-byte rows: strides of 656 bytes, 328 bf16, 164 float32 (4 divides them, 16 does not)
        aligned = [a for a in aligned if a not in ("stride_pe", "stride_sc")]
    return compile_gluon(m._sparse_kernel, sig, cx, aligned, maxnreg=168)


class AbsentKernel(LookupError):
    """The tree being compiled has no such kernel (it predates it): ``ptx_diff.py`` reports it,
    it does not compare it."""


def portable_kernel(m=None, kv: str = "bf16", page_tile: bool = True, persistent: bool = False):
    """the portable Triton kernel (or that of another module with the same kernel) on bf16 queries
    over rows of kv ("bf16", "fp8" per-tensor, "tile" FP8 tile rows; "fp32": float32 queries and
    rows), 64-row and 64-key tiles, 8 warps; page_tile: pages a multiple of the key tile;
    persistent: on the persistent schedule (``split_plan.schedule``)."""
    from triton.compiler import ASTSource

    if m is None:
        from mla.ops.decode import portable as m
    fn = m._decode_split_kernel
    names = list(fn.arg_names)
    ints = ["stride_qb", "stride_qi", "stride_qh", "stride_kv_blk", "stride_kv_row", "stride_bt", "stride_os",
            "stride_ob", "stride_oi", "stride_oh", "stride_ls", "stride_lb", "stride_li", "H", "S_Q", "B", "DV", "DR",
            "block_size", "num_blocks", "max_len", "num_splits", "eq_splits"]
    q, rows = {"bf16": ("bf16", "bf16"), "fp8": ("bf16", "fp8e4nv"), "tile": ("bf16", "u8"),
               "fp32": ("fp32", "fp32")}[kv]
    sig = {n: "constexpr" for n in names}
    sig.update({k: "i32" for k in ints if k in names})      # a tree from before eq_splits lacks it
    sig.update({"Q": "*" + q, "KV": "*" + rows, "BT": "*i32", "SEQLENS": "*i32", "O": "*fp32", "LSE": "*fp32",
                "INFO": "*i32", "qk_scale": "fp32", "v_scale": "fp32"})
    cx = dict(CAUSAL=True, IEEE=kv == "fp32", PAGE_TILE=page_tile, KV_FMT={"fp8": 1, "tile": 2}.get(kv, 0),
              KEEP_NAN=False, BLOCK_M=64, BLOCK_N=64, BLOCK_DV=512, BLOCK_DR=64, BLOCK_B=BLOCK_B)
    if persistent:
        if "PERSISTENT" not in names:
            raise AbsentKernel("this tree's portable kernel has no persistent schedule")
        cx["PERSISTENT"] = True
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in cx.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=2))


# every kernel by name, as launched (the names of the command line and of tools/ptx_diff.py)
KERNELS = {
    "fp8": lambda a: fp8_kernel(block_b=a.block_b, partials=a.partials),
    "fp8tile": lambda a: fp8_kernel(tile=True, block_b=a.block_b, partials=a.partials),
    "seesaw": lambda a: seesaw_kernel(block_b=a.block_b, partials=a.partials),
    "seesaw-f32": lambda a: seesaw_kernel(block_b=a.block_b, partials="fp32"),     # float32 partials, from registers
    "seesaw-direct": lambda a: seesaw_kernel(block_b=a.block_b, direct=True),
    "seesaw-fp8": lambda a: seesaw_fp8_kernel(block_b=a.block_b),
    "seesaw-fp8tile": lambda a: seesaw_fp8_kernel(tile=True, block_b=a.block_b),
    "narrow": lambda a: narrow_kernel(block_b=a.block_b),
    "sparse": lambda a: sparse_kernel(partials=a.partials),
    "sparse-f32": lambda a: sparse_kernel(partials="fp32", BN=32),                 # splits, 32-key tiles
    "sparse-fp8": lambda a: sparse_kernel(partials=a.partials, BN=32, kv="fp8"),
    "sparse-fp8tile": lambda a: sparse_kernel(partials=a.partials, BN=32, kv="tile"),
    "portable": lambda a: portable_kernel(),
    "portable-page16": lambda a: portable_kernel(page_tile=False),
    "portable-fp8": lambda a: portable_kernel(kv="fp8"),
    "portable-tile": lambda a: portable_kernel(kv="tile", page_tile=False),
    "portable-fp32": lambda a: portable_kernel(kv="fp32", page_tile=False),
    "portable-persistent": lambda a: portable_kernel(persistent=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=list(KERNELS))
    p.add_argument("--block-b", type=int, default=BLOCK_B, help="the plan's vector width (decode.block_b(B))")
    p.add_argument("--partials", default=PARTIALS, choices=["bf16", "fp32"], help="the partial outputs' dtype")
    a = p.parse_args()
    k = KERNELS[a.kernel](a)
    usage, ops = sass_counts(k)
    print(f"shared {k.metadata.shared} B; {usage}")
    print(dict(sorted(ops.items())))


if __name__ == "__main__":
    main()
