import os
import sys

# the scenarios import their helpers (_storage) and each other as top-level modules
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or large tests")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped on CPU-only machines")
