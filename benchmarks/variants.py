"""Kernel variants made by editing a module's source text, for the breakdown scripts
(fp8_breakdown.py, seesaw_breakdown.py): compile-time changes the library does not carry, such
as leaving out one stage to time the rest (docs/PERF.md)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mla import bench

KERNELS = Path(bench.__file__).resolve().parent / "ops" / "triton"


def edit(src: str, old: str, new: str) -> str:
    """src with old (which must occur exactly once: a change to the kernel shows here) -> new."""
    if src.count(old) != 1:
        raise RuntimeError(f"variant edit: expected once, found {src.count(old)}: {old.strip()[:60]!r}")
    return src.replace(old, new)


def absolute_imports(src: str) -> str:
    """The module's relative imports made absolute, so that a copy imports from elsewhere."""
    for rel in ("decode_gluon_narrow", "decode_gluon", "decode"):
        src = src.replace(f"from .{rel} import", f"from mla.ops.triton.{rel} import")
    if "from . import " not in src:
        raise RuntimeError("variant edit: expected the module's 'from . import' line")
    return src.replace("from . import ", "from mla.ops.triton import ")


def parse_shapes(items: list[str], fields: str) -> list[tuple[int, ...]]:
    """Command-line shapes "16,1,4096" -> (16, 1, 4096), each with one integer per name in
    fields (e.g. "H,B,L")."""
    n = len(fields.split(","))
    shapes = [tuple(int(x) for x in s.split(",")) for s in items]
    if any(len(s) != n for s in shapes):
        raise ValueError(f"shapes: expected {fields} ({n} integers each), got {items}")
    return shapes


def load_module(src: str, name: str, workdir: Path):
    path = Path(workdir) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_launchers(c: dict, launchers: dict, checked="shipped") -> tuple[dict, float | None]:
    """Each launcher (kv -> out) timed by ``mla bench decode``'s method over rotated copies of
    the cache of case c (``bench.decode_case``), and the relative error of ``checked``'s output
    against the reference (None, and no reference computed, when checked is None)."""
    from mla.ops import reference

    copies = bench.rotated_copies(c["kv"])
    err = None
    if checked is not None:
        ref = reference.mla_decode(c["q"], c["kv"], c["table"], c["seqlens"], bench.DL, c["scale"], True)[0]
        err = bench._rel_err(launchers[checked](c["kv"]), ref.float())
    times = {name: bench.graph_time_us([lambda kv=kv, f=f: f(kv) for kv in copies]) for name, f in launchers.items()}
    return times, err
