"""The ``mla`` console script (also ``python -m mla``): ``mla demo`` (the README's main job),
``mla serve MODEL`` (an OpenAI-compatible server, mla.hf.serve), ``mla bench ...`` and ``mla --version``.

Exit status: 0 on success, 1 when a command cannot run here (``--device cuda`` without CUDA, a
benchmark without a GPU) or its check fails, 2 for bad arguments; messages go to stderr.
"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mla", description="Multi-head Latent Attention toolkit")
    parser.add_argument("--version", action="version", version=f"mla {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,serve,bench}")
    # each command parses its own options (so ``mla bench decode --help`` is the benchmark's help)
    sub.add_parser("demo", help="a serving trace on a small DeepSeek-shaped model, checked step by step",
                   add_help=False)
    sub.add_parser("serve", help="serve a local MLA model: transformers' OpenAI-compatible server on the latent "
                   "cache (mla serve MODEL --help)", add_help=False)
    sub.add_parser("bench", help="GPU benchmarks: mla bench decode|prefill|layer|sparse --help", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    if args.command == "serve":
        from .hf.serve import main as serve_main
        return serve_main(rest)
    from .bench import main as bench_main
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
