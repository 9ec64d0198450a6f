"""The decode kernels of two source trees, compiled for sm_90a without a GPU, compared as PTX:
the check, before any device call, that a refactor leaves the machine code as it was.

    git archive main src | tar -x -C build/main        # a tree to compare against
    python3 tools/ptx_diff.py build/main/src src [KERNEL ...]     # default: all of compile_sm90's

Each tree compiles in its own process (line info off) every kernel ``compile_sm90.py`` names,
with the same constexprs; then one line a kernel: identical, or how many PTX lines differ and
the first few. Exit status 1 when any differs. Identical PTX is the same program to ptxas; the
SASS can still differ in register numbering (ptxas sees the source paths), which this ignores.
Where the PTX differs, ``bitcheck_decode.py`` on the GPU says whether the results do.
"""
from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ab_decode import tree_env  # noqa: E402

_DEBUG = (".loc", ".file", "//", "$L__", ".section\t.debug", "\t.b8", "\t.b32", "\t.b64")


def save_ptx(folder: str, names: list[str]) -> None:
    """One tree's side (a process of its own, that tree first on PYTHONPATH): each kernel's PTX,
    without debug lines, into folder."""
    import compile_sm90

    args = argparse.Namespace(block_b=compile_sm90.BLOCK_B, partials=compile_sm90.PARTIALS)
    for name in names:
        try:
            ptx = compile_sm90.KERNELS[name](args).asm["ptx"]
        except compile_sm90.AbsentKernel:
            continue            # no file: main says which tree lacks it
        keep = [line for line in ptx.splitlines() if not line.strip().startswith(_DEBUG)]
        Path(folder, name + ".ptx").write_text("\n".join(keep))


def main(argv=None) -> int:
    import compile_sm90

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs=2, help="two src directories (the first is the reference)")
    p.add_argument("kernels", nargs="*", default=list(compile_sm90.KERNELS), help="compile_sm90's kernel names")
    args = p.parse_args(argv)
    unknown = set(args.kernels) - set(compile_sm90.KERNELS)
    if unknown:
        p.error(f"unknown kernels {sorted(unknown)}; expected some of {list(compile_sm90.KERNELS)}")
    work = Path(tempfile.mkdtemp())
    for i, src in enumerate(args.trees):
        (work / str(i)).mkdir()
        env = dict(tree_env(src), TRITON_DISABLE_LINE_INFO="1", TRITON_CACHE_DIR=str(work / f"cache{i}"))
        code = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); " \
               f"import ptx_diff; ptx_diff.save_ptx({str(work / str(i))!r}, {args.kernels!r})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
    differ = 0
    for name in args.kernels:
        files = [work / str(i) / f"{name}.ptx" for i in (0, 1)]
        if not all(f.exists() for f in files):
            print(f"{name:16} not in " + " or ".join(t for t, f in zip(args.trees, files) if not f.exists()))
            continue
        a, b = (f.read_text().splitlines() for f in files)
        diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if d[:1] in "+-" and d[:3] not in ("+++", "---")]
        differ += bool(diff)
        print(f"{name:16} " + ("identical" if not diff else f"differs in {len(diff)} lines"))
        for line in diff[:6]:
            print("    " + line.strip())
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
