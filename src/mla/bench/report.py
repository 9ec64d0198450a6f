"""What ``mla bench`` prints and writes: the tables, CSV, and the decode chart (no GPU needed)."""
from __future__ import annotations

import csv
import sys

__all__ = ["write_csv", "print_rows", "fixed_header", "fixed_line", "add_ratios", "decode_table", "decode_summary",
           "decode_plot", "PEER_RATIOS"]


def write_csv(rows: list[dict], path: str) -> None:
    """Every row (dicts with any keys) to a CSV file, columns sorted by name."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)


def error_text(e: Exception) -> str:
    """A failed provider's row: the exception's type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def emit(shape: list[dict], rows: list[dict], cols, stop: str, csv: str | None) -> None:
    """Print one shape's rows now (a run cut short keeps them) and keep them for the CSV."""
    print("\n".join(fixed_line(r, cols, stop) for r in shape), flush=True)
    rows += shape
    if csv:
        write_csv(rows, csv)


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
    return r["H"], r["B"], r["L"], r["s_q"], r.get("kv", "bf16"), r.get("mix")


# the ratio columns of the decode tables: each row's time over the peer's on the same case
PEER_RATIOS = {"ratio_fa3": "flashinfer-fa3", "ratio_flashmla": "flashmla"}


def add_ratios(rows: list[dict]) -> None:
    """``ratio_fa3`` and ``ratio_flashmla`` on every timed decode row: its time over FlashInfer
    fa3's and over FlashMLA's on the same case (shape, cache format and length mix)."""
    for ratio, name in PEER_RATIOS.items():
        peer = {_key(r): r.get("us") for r in rows if r["provider"] == name}
        for r in rows:
            p = peer.get(_key(r))
            if p and r.get("us"):
                r[ratio] = r["us"] / p


def _mixed(rows: list[dict]) -> bool:
    return any("mix" in r for r in rows)


def decode_table(rows: list[dict]) -> str:
    """One line per (case, provider); ``kernel``: our kernel that ran ("-" for a peer); the
    mix and K (the batch's cached keys) where the rows have mixed lengths."""
    mix = " {mix:>8} {keys:>8}" if _mixed(rows) else ""
    shape = "{H:>4} {B:>4} {L:>6} {s_q:>3} {kv:>8}" + mix + "  {provider:<16} {kernel:<9}"
    head = (shape.format(H="H", B="B", L="L", s_q="s_q", kv="kv", mix="mix", keys="K", provider="provider",
                         kernel="kernel")
            + f" {'us':>9} {'TB/s':>6} {'TF/s':>6} {'roof':>5} {'/fa3':>6} {'/fmla':>6} {'err':>8}  config")
    out = [head, "-" * len(head)]
    for r in rows:
        cells = shape.format(**{"mix": "", "keys": "", **r, "kernel": r.get("kernel") or "-"})
        if "error" in r or "note" in r:
            out.append(f"{cells} ERROR {r['error']}" if "error" in r else f"{cells} {r['note']}")
            continue
        ratios = " ".join(f"{r[k]:6.2f}" if k in r else f"{'-':>6}" for k in PEER_RATIOS)
        out.append(f"{cells} {r['us']:9.1f} {r['TBps']:6.2f} {r['TFLOPs']:6.0f} {r['roof']:5.0%} {ratios} "
                   f"{r['rel_err']:8.1e}  {r['config']}")
    return "\n".join(out)


# the summary's columns after the case's: the op, the fastest named kernel, the peers, the ratios, the op's rates
SUMMARY_COLS = [("mla.ops", 8, ".1f"), ("kernel", 8, "<"), ("best", 8, ".1f"), ("variant", 15, "<"),
                ("fa3", 8, ".1f"), ("flashmla", 8, ".1f"), ("naive", 8, ".1f"), ("op/fa3", 7, ".2f"),
                ("op/fmla", 7, ".2f"), ("best/fa3", 8, ".2f"), ("TB/s", 5, ".2f"), ("TF/s", 5, ".0f"),
                ("roof", 5, ".0%")]


def decode_summary(rows: list[dict]) -> str:
    """One line per case: the public op as dispatched and the kernel it ran, the fastest kernel
    timed by name, the peers, the op's time over each peer's (and the fastest kernel's over
    fa3's); TB/s, TFLOP/s and roofline fraction of the op (of the fastest named kernel without
    it). Rows of mixed lengths add the mix and K."""
    cols = [("H", 4, "d"), ("B", 4, "d"), ("L", 6, "d"), ("s_q", 3, "d"), ("kv", 8, "")]
    cols += [("mix", 8, ""), ("K", 8, "d")] if _mixed(rows) else []
    cols += SUMMARY_COLS
    out = [fixed_header(cols).splitlines()[0]]
    for k in dict.fromkeys(_key(r) for r in rows):
        case = [r for r in rows if _key(r) == k]
        rs = [r for r in case if "us" in r]
        by = {r["provider"]: r for r in rs}
        named = [r for r in rs if r["provider"].startswith(("triton:", "gluon:"))]
        best = min(named, key=lambda r: r["us"]) if named else None
        d, f, m = by.get("mla.ops"), by.get("flashinfer-fa3"), by.get("flashmla")
        us = lambda r: r["us"] if r else None  # noqa: E731
        over = lambda a, b: a["us"] / b["us"] if a and b else None  # noqa: E731
        top = d or best or {}
        line = dict(zip(("H", "B", "L", "s_q", "kv", "mix"), k))
        line.update({"K": case[0].get("keys"), "mla.ops": us(d), "kernel": (d or {}).get("kernel") or None,
                     "best": us(best), "variant": best["provider"] if best else None, "fa3": us(f),
                     "flashmla": us(m), "naive": us(by.get("naive-torch")), "op/fa3": over(d, f),
                     "op/fmla": over(d, m), "best/fa3": over(best, f), "TB/s": top.get("TBps"),
                     "TF/s": top.get("TFLOPs"), "roof": top.get("roof")})
        out.append(fixed_line(line, cols))
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
    case = lambda r: (r["H"], r["s_q"], r["B"], r["L"], r.get("mix") or "")  # noqa: E731
    shapes = sorted({case(r) for r in rows})
    labels = [f"H{h} sq{s}\nB{b} L{l // 1024}k {m}" for h, s, b, l, m in shapes]
    fig, ax = plt.subplots(figsize=(max(8, len(shapes) * 0.6), 4))
    provs = sorted({r["provider"] for r in rows})
    width = 0.8 / len(provs)
    for j, p in enumerate(provs):
        by = {case(r): r.get("roof", 0) for r in rows if r["provider"] == p}
        ax.bar([i + j * width for i in range(len(shapes))], [100 * by.get(s, 0) for s in shapes], width, label=p)
    ax.set_xticks([i + 0.4 for i in range(len(shapes))], labels, fontsize=6)
    ax.set_ylabel("% of roofline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
