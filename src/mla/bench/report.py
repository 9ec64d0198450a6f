"""What ``mla bench`` prints and writes: the tables, CSV, and the decode chart (no GPU needed)."""
from __future__ import annotations

import csv
import sys

__all__ = ["write_csv", "print_rows", "fixed_header", "fixed_line", "add_ratios", "decode_table", "decode_summary",
           "decode_plot"]


def write_csv(rows: list[dict], path: str) -> None:
    """Every row (dicts with any keys) to a CSV file, columns sorted by name."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def print_rows(rows: list[dict], cols: list[str]) -> None:
    """rows as a table of the columns cols, each as wide as its widest cell."""
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))


def _cell(value, width: int, spec: str) -> str:
    if value is None:
        value = "-"
    if isinstance(value, str):
        return value.ljust(width) if spec == "<" else value.rjust(width)
    return format(value, spec).rjust(width)


def fixed_header(cols: list[tuple[str, int, str]]) -> str:
    """The header of ``fixed_line``'s table, and a rule under it."""
    text = " ".join(_cell(k, w, "<" if s == "<" else "") for k, w, s in cols)
    return text + "\n" + "-" * len(text)


def fixed_line(row: dict, cols: list[tuple[str, int, str]], stop: str | None = None) -> str:
    """One row in fixed columns, for tables printed a row at a time (a run cut short keeps its
    lines). cols: (key, width, format spec; "<" for left-aligned text); a missing value is "-".
    A row with a ``note`` or an ``error``: the columns before ``stop``, then that text."""
    if stop is not None and ("note" in row or "error" in row):
        cols = cols[:[c[0] for c in cols].index(stop)]
        return " ".join(_cell(row.get(k), w, s) for k, w, s in cols) + " " + row.get("note", row.get("error", ""))
    return " ".join(_cell(row.get(k), w, s) for k, w, s in cols)


def _key(r):
    return r["H"], r["B"], r["L"], r["s_q"], r.get("kv", "bf16")


def add_ratios(rows: list[dict]) -> None:
    """``ratio_fa3`` on every timed decode row: its time over FlashInfer fa3's on the same shape."""
    peer = {_key(r): r.get("us") for r in rows if r["provider"] == "flashinfer-fa3"}
    for r in rows:
        p = peer.get(_key(r))
        if p and r.get("us"):
            r["ratio_fa3"] = r["us"] / p


def decode_table(rows: list[dict]) -> str:
    """One line per (shape, provider); ``kernel``: our kernel that ran ("-" for a peer)."""
    shape = "{H:>4} {B:>4} {L:>6} {s_q:>3} {kv:>8}  {provider:<16} {kernel:<9}"
    head = (shape.format(H="H", B="B", L="L", s_q="s_q", kv="kv", provider="provider", kernel="kernel")
            + f" {'us':>9} {'TB/s':>6} {'TF/s':>6} {'roof':>5} {'/fa3':>6} {'err':>8}  config")
    out = [head, "-" * len(head)]
    for r in rows:
        cells = shape.format(**{**r, "kernel": r.get("kernel") or "-"})
        if "error" in r:
            out.append(f"{cells} ERROR {r['error']}")
            continue
        ratio = f"{r['ratio_fa3']:6.2f}" if "ratio_fa3" in r else f"{'-':>6}"
        out.append(f"{cells} {r['us']:9.1f} {r['TBps']:6.2f} {r['TFLOPs']:6.0f} {r['roof']:5.0%} {ratio} "
                   f"{r['rel_err']:8.1e}  {r['config']}")
    return "\n".join(out)


def decode_summary(rows: list[dict]) -> str:
    """One line per shape: the public op as dispatched and the kernel it ran, the fastest kernel
    timed by name, the peers; TB/s, TFLOP/s and roofline fraction of the op (of the fastest
    named kernel without it)."""
    head = (f"{'H':>4} {'B':>4} {'L':>6} {'s_q':>3} {'kv':>8} {'mla.ops':>8} {'kernel':<8} {'best':>8} "
            f"{'variant':<15} {'fa3':>8} {'naive':>8} {'op/fa3':>7} {'best/fa3':>8} {'TB/s':>5} {'TF/s':>5} "
            f"{'roof':>5}")
    out = [head]
    for k in dict.fromkeys(_key(r) for r in rows):
        rs = [r for r in rows if _key(r) == k and "us" in r]
        by = {r["provider"]: r for r in rs}
        named = [r for r in rs if r["provider"].startswith(("triton:", "gluon:"))]
        best = min(named, key=lambda r: r["us"]) if named else None
        d, f, n = by.get("mla.ops"), by.get("flashinfer-fa3"), by.get("naive-torch")
        fmt = lambda r: f"{r['us']:8.1f}" if r else f"{'-':>8}"  # noqa: E731
        rat = lambda r: f"{r['us'] / f['us']:.2f}" if r and f else "-"  # noqa: E731
        m = d or best
        out.append(f"{k[0]:>4} {k[1]:>4} {k[2]:>6} {k[3]:>3} {k[4]:>8} {fmt(d)} {(d or {}).get('kernel') or '-':<8} "
                   f"{fmt(best)} {(best['provider'] if best else '-'):<15} {fmt(f)} {fmt(n)} {rat(d):>7} "
                   f"{rat(best):>8} " + (f"{m['TBps']:5.2f} {m['TFLOPs']:5.0f} {m['roof']:5.0%}" if m else ""))
    return "\n".join(out)


def decode_plot(rows: list[dict], path: str) -> None:
    """The roofline fraction of every provider on every shape, as grouped bars in a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--png: matplotlib is not installed; no chart written", file=sys.stderr)
        return
    shapes = sorted({(r["H"], r["s_q"], r["B"], r["L"]) for r in rows})
    labels = [f"H{h} sq{s}\nB{b} L{l // 1024}k" for h, s, b, l in shapes]
    fig, ax = plt.subplots(figsize=(max(8, len(shapes) * 0.6), 4))
    provs = sorted({r["provider"] for r in rows})
    width = 0.8 / len(provs)
    for j, p in enumerate(provs):
        by = {(r["H"], r["s_q"], r["B"], r["L"]): r.get("roof", 0) for r in rows if r["provider"] == p}
        ax.bar([i + j * width for i in range(len(shapes))], [100 * by.get(s, 0) for s in shapes], width, label=p)
    ax.set_xticks([i + 0.4 for i in range(len(shapes))], labels, fontsize=6)
    ax.set_ylabel("% of roofline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
