"""Two or more source trees of mla against each other on ``mla bench decode``, in one call.

    git archive main src | tar -x -C build/main        # here, before the device call
    git archive my-branch src | tar -x -C build/mine
    python3 tools/ab_decode.py build/main/src build/mine/src -- --heads 128 --batch 32 128

Each tree runs ``mla bench decode --no-peers`` (the arguments after ``--``) in its own process,
the trees taking turns for ``--rounds`` rounds (default 2: A B A B), so that clock drift over
the run falls on every tree alike; each tree keeps its fastest time per shape. Prints one row a
shape: the times, and each tree's time over the first tree's. The dispatched op
("mla.ops") is compared unless ``--provider`` names another row of the bench.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def tree_env(src: Path) -> dict:
    """This process's environment with the source tree src first on PYTHONPATH."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve())] + rest)
    return env


def run_tree(src: Path, bench_args: list[str], csv_path: Path) -> int:
    """One ``mla bench decode`` of tree src into csv_path; its exit status. A tree that fails
    (a kernel that faults, say) keeps what its CSV holds (the bench writes it after every shape)
    and the other trees go on."""
    cmd = [sys.executable, "-m", "mla.cli", "bench", "decode", "--no-peers", "--csv", str(csv_path), *bench_args]
    return subprocess.run(cmd, env=tree_env(src), stdout=subprocess.DEVNULL).returncode


def read_times(csv_path: Path, provider: str) -> dict:
    if not csv_path.is_file():
        return {}
    with open(csv_path) as f:
        return {(r["H"], r["B"], r["L"], r["s_q"], r["kv"]): float(r["us"])
                for r in csv.DictReader(f) if r["provider"] == provider and r["us"]}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="+", type=Path, help="src folders (each holding the package mla)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--provider", default="mla.ops")
    args = p.parse_args(own)
    for t in args.trees:
        if not (t / "mla" / "__init__.py").is_file():
            raise ValueError(f"trees: expected a folder holding mla/__init__.py, got {t}")
    best: list[dict] = [{} for _ in args.trees]
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for i, tree in enumerate(args.trees):
                out = Path(tmp) / f"{i}_{rnd}.csv"
                rc = run_tree(tree, bench_args, out)
                if rc:
                    print(f"tree {i} ({tree}), round {rnd}: exit status {rc}; kept the shapes it wrote",
                          file=sys.stderr, flush=True)
                for k, us in read_times(out, args.provider).items():
                    best[i][k] = min(us, best[i].get(k, math.inf))
    names = [str(t) for t in args.trees]
    heads = " ".join(f"{'us ' + str(i):>9}" for i in range(len(names)))
    over = " ".join(f"{i}/0".rjust(6) for i in range(1, len(names)))
    print(f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kv':>8} {heads} {over}")
    ratios = [[] for _ in names]
    for k in dict.fromkeys(k for b in best for k in b):      # every shape any tree timed, in order
        ts = [b.get(k, math.nan) for b in best]
        for i in range(1, len(ts)):
            ratios[i].append(ts[i] / ts[0])
        print(f"{k[0]:>4} {k[1]:>4} {k[2]:>6} {k[3]:>3} {k[4]:>8} " + " ".join(f"{t:9.1f}" for t in ts) + " "
              + " ".join(f"{ts[i] / ts[0]:6.3f}" for i in range(1, len(ts))))
    for i in range(1, len(names)):
        ok = [r for r in ratios[i] if r == r]
        gm = math.exp(sum(math.log(r) for r in ok) / len(ok)) if ok else math.nan
        print(f"tree {i} ({names[i]}) / tree 0 ({names[0]}): geometric mean {gm:.3f} over {len(ok)} shapes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
