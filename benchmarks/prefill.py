"""Prefill-side ops and the layer's context phase on the GPU (``mla bench prefill``).

    PYTHONPATH=src python3 benchmarks/prefill.py [--quick] [--csv FILE]
"""
import sys

from mla.bench import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
