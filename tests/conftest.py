"""Shared test set-up."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))   # tests import hf_util


def pytest_addoption(parser):
    parser.addoption("--fuzz-steps", type=int, default=150,
                     help="random operations per case of tests/test_cache_fuzz.py (CI: the default; "
                          "a long run: e.g. --fuzz-steps 20000)")
