def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-process or large tests")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped on CPU-only machines")
