"""Every code example in README.md and docs/ runs, so none can rot.

A fenced block's info string says how it runs:

- ``python``: executed on CPU, in order, the blocks of one file sharing one namespace (a later
  block continues an earlier one, as a reader does);
- ``python gpu``: the same, where CUDA is available (skipped without it);
- ``python torchrun=N``: one script run under ``torchrun --nproc_per_node N`` on CPU (gloo);
- ``python client``: a client of a running ``mla serve``, not run here: tests/test_serving_http.py
  starts the server and makes the same calls;
- anything else (``bash``, plain fences, ``text``) is shown, not run.

Relative links (``[text](path)``) and the repository paths they name must exist.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def blocks(path: Path, kind: str) -> list[str]:
    """The code of the blocks of ``path`` whose info string is ``kind``, in file order."""
    return [code for info, code in FENCE.findall(path.read_text()) if info.strip() == kind]


def _ids(paths):
    return [str(p.relative_to(ROOT)) for p in paths]


def _run(path: Path, kind: str) -> None:
    code = blocks(path, kind)
    if not code:
        pytest.skip(f"no {kind!r} blocks")
    namespace = {"__name__": f"doc:{path.name}"}
    for i, block in enumerate(code):
        try:
            exec(compile(block, f"{path.name}[{kind} block {i}]", "exec"), namespace)
        except Exception as e:   # name the block: the traceback's file is the block, not a file on disk
            raise AssertionError(f"{path.relative_to(ROOT)}: {kind} block {i} failed: {e!r}\n{block}") from e


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_python_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)      # a block that writes files writes them here
    _run(path, "python")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_gpu_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(path, "python gpu")


def _torchrun_blocks():
    out = []
    for path in DOCS:
        for info, code in FENCE.findall(path.read_text()):
            m = re.fullmatch(r"python torchrun=(\d+)", info.strip())
            if m:
                out.append(pytest.param(path, int(m.group(1)), code, id=f"{path.name}-{len(out)}"))
    return out


@pytest.mark.parametrize("path,nproc,code", _torchrun_blocks())
def test_torchrun_blocks_run(path, nproc, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--standalone", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{path.name}: torchrun block failed\n{proc.stdout}\n{proc.stderr}"


def test_every_python_block_is_run():
    """A block tagged with a typo (``pyhton``, ``python cpu``) would silently never run."""
    known = re.compile(r"(python( gpu| client| torchrun=\d+)?|bash|text|)")
    for path in DOCS:
        for info, _ in FENCE.findall(path.read_text()):
            assert known.fullmatch(info.strip()), f"{path.relative_to(ROOT)}: unknown fence info {info!r}"


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_links_exist(path):
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: link to missing {target}"
