"""transformers' own model tests of every MLA family mla serves, unpatched and then with every
model they build on ``mla.hf.patch`` (the plugin ``mla_suite_plugin.py`` beside this file).

    python tools/hf_suite/run.py HF_SRC [--family deepseek_v3 ...] [--workers 2] [--out build/hf_suite]

HF_SRC: a transformers source checkout at the tag of the installed transformers (v5.17.0): its
tests/models/<family>/test_modeling_<family>.py run from its root, as transformers' CI runs them
(its conftest.py and tests/ package). For each file the table gives the tests that pass, that are
refused by one of mla's named refusals (docs/hf.md) and that fail, unpatched and patched; then
every test that passes unpatched and neither passes nor is refused patched, with its error.
Exit status 1 when there is any such test.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "src"))

from mla.families import FAMILIES  # noqa: E402  (the model types mla reads, one test folder each)


def test_files(hf_src: Path, families: list[str] | None) -> list[Path]:
    """tests/models/<family>/test_modeling_<family>.py for each family mla reads that HF_SRC has."""
    names = families or sorted({t.removesuffix("_text") for t in FAMILIES})
    files = [hf_src / "tests" / "models" / n / f"test_modeling_{n}.py" for n in names]
    missing = [f.parent.name for f in files if not f.exists()
               and importlib.util.find_spec(f"transformers.models.{f.parent.name}") is not None]
    if missing:
        print(f"no test file in {hf_src} for: {', '.join(missing)}")
    return [f for f in files if f.exists()]


def run_pytest(hf_src: Path, test_file: Path, patched: bool, report: Path, workers: int, extra: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "no:cacheprovider", "-W", "ignore",
           "-p", "mla_suite_plugin", "--mla-report", str(report), *(["--mla-patch"] if patched else []),
           *(["-n", str(workers)] if workers > 1 else []), *extra, str(test_file.relative_to(hf_src))]
    report.unlink(missing_ok=True)
    subprocess.run(cmd, cwd=hf_src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report for {test_file} ({'patched' if patched else 'unpatched'}): "
                         f"run it by hand from {hf_src}: {' '.join(cmd)}")


def read(report: Path) -> dict[str, dict]:
    return {d["test"]: d for d in map(json.loads, report.read_text().splitlines())}


def counts(results: dict[str, dict]) -> str:
    c = collections.Counter(d["outcome"] for d in results.values())
    return f"{c['passed']:4d} {c['refused']:4d} {c['failed']:4d}   ({c['skipped']} skipped)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_src", type=Path)
    ap.add_argument("--family", nargs="*", help="test folders to run (default: every family mla reads)")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: no xdist)")
    ap.add_argument("--out", type=Path, default=REPO / "build" / "hf_suite", help="the JSON-lines reports")
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (-k ...)")
    args = ap.parse_args()
    hf_src = args.hf_src.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, regressions, refusals = [], [], collections.Counter()
    for f in test_files(hf_src, args.family):
        t0 = time.time()
        results = []
        for patched in (False, True):
            report = args.out / f"{f.parent.name}.{'patched' if patched else 'unpatched'}.jsonl"
            run_pytest(hf_src, f, patched, report, args.workers, args.pytest_args)
            results.append(read(report))
        plain, patched = results
        rows.append((f.parent.name, counts(plain), counts(patched)))
        for test, d in sorted(patched.items()):
            if d["outcome"] == "refused":
                refusals[d["message"]] += 1
            elif plain.get(test, {}).get("outcome") == "passed" and d["outcome"] != "passed":
                regressions.append((test, d["outcome"], d["message"]))
        print(f"{f.parent.name}: {time.time() - t0:.0f} s", flush=True)
    print(f"\n{'test file':16s} {'unpatched: pass refused failing':34s} patched: pass refused failing")
    for name, plain, patched in rows:
        print(f"{name:16s} {plain:34s} {patched}")
    print("\nrefused, patched (tests, message):")
    for message, n in refusals.most_common():
        print(f"{n:5d}  {message}")
    print(f"\npassing unpatched, not patched: {len(regressions)}")
    for test, outcome, message in regressions:
        print(f"  {test}: {outcome}: {message}")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
