import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

# tests/_*.py are scripts that the tests run in subprocesses (they set XLA_FLAGS or
# KERAS_BACKEND for their own process at import): --doctest-modules must not import them.
collect_ignore_glob = ["_*.py"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "native: a test of the native kernel itself (its ops, FFI and custom calls, or what"
        " only it emits): skipped where TF_STABLE_MOMENTS_NATIVE=0 switches it off, the"
        " setting that runs the accelerators' XLA kernel on the CPU",
    )


def pytest_collection_modifyitems(config, items):
    """With TF_STABLE_MOMENTS_NATIVE=0 the suite runs what an accelerator runs; the tests
    of the native kernel itself cannot (the kernel is off) and are skipped, saying so.
    With the kernel on (the CI) every test runs."""
    from moments_core.native import enabled

    if enabled():
        return
    skip = pytest.mark.skip(reason="TF_STABLE_MOMENTS_NATIVE=0: the native kernel is switched off")
    for item in items:
        if item.get_closest_marker("native") is not None:
            item.add_marker(skip)
