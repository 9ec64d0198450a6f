"""The ``mla`` console script: ``mla demo`` (the README's main job) and ``mla bench ...``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mla", description="Multi-head Latent Attention toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="a serving trace on a small DeepSeek-shaped model, checked step by step",
                   add_help=False)
    sub.add_parser("bench", help="GPU benchmarks: mla bench decode|prefill --help", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    from .bench import main as bench_main
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
