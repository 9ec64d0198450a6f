"""GPU benchmarks of mla on the default grids; extra arguments go to ``mla bench decode``.

    PYTHONPATH=src python3 benchmarks/gpu.py [--variants default,warps] [--csv out.csv]
"""
import sys

from mla.bench import main

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
