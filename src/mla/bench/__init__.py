"""``mla bench``: the library's kernels and layer on one GPU, checked, timed, beside the peers.

    mla bench decode  [options]    absorbed MLA decode over a paged latent cache   (decode.py)
    mla bench prefill [options]    prefill attention and the memory-bound prefill ops (prefill.py)
    mla bench layer   [options]    the whole layer: context phase, decode step     (layer.py)
    mla bench sparse  [options]    sparse decode, sparse prefill and the indexer   (sparse.py)

Every benchmark times with ``timing`` (one timer) against the ceilings of ``roofline``, and
prints with ``report``. Exit status: 0 when it ran, 1 when it cannot run here (no CUDA GPU) or
a step failed, 2 for bad arguments (argparse's usage message); errors go to stderr.
"""
from __future__ import annotations

import argparse
import sys

from . import decode, layer, prefill, sparse
from .decode import decode_bytes, decode_case, decode_flops, decode_metrics, row_bytes
from .decode_providers import flashinfer_provider, naive_provider, op_provider, rel_err, triton_provider
from .roofline import COPY_BYTES_PER_S, GEMM_FLOPS_PER_S, roofline_us
from .timing import eager_time_us, graph_time_us, rotated_copies

__all__ = ["main", "decode_case", "decode_bytes", "decode_flops", "decode_metrics", "row_bytes", "op_provider",
           "triton_provider", "flashinfer_provider", "naive_provider", "rel_err", "graph_time_us",
           "eager_time_us", "rotated_copies", "roofline_us", "COPY_BYTES_PER_S", "GEMM_FLOPS_PER_S"]

OPS = {"decode": decode, "prefill": prefill, "layer": layer, "sparse": sparse}


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``mla bench``'s parser and the parser of each benchmark, by name."""
    p = argparse.ArgumentParser(prog="mla bench", description="Kernel and layer benchmarks on one CUDA GPU.")
    sub = p.add_subparsers(dest="op", required=True, metavar="{" + ",".join(OPS) + "}")
    subs = {}
    for name, mod in OPS.items():
        doc = mod.__doc__.split("\n\n")   # title, synopsis (argparse writes its own), details
        title = " ".join(doc[0].split(": ", 1)[-1].split())
        sub_p = sub.add_parser(name, help=title, description=title[:1].upper() + title[1:],
                               epilog="\n\n".join(doc[2:]) or None,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(sub_p)
        subs[name] = sub_p
    return p, subs


def main(argv: list[str] | None = None) -> int:
    """Parse, check what needs no GPU, then run the benchmark; its exit status."""
    p, subs = parsers()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    op = OPS[args.op]
    try:
        op.validate(args)
    except ValueError as e:
        subs[args.op].error(str(e))   # exits 2
    import torch

    if not torch.cuda.is_available():
        print(f"mla bench {args.op}: needs a CUDA GPU, and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__})", file=sys.stderr)
        return 1
    return op.run(args)
