import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

# tests/_*.py are scripts that the tests run in subprocesses (they set XLA_FLAGS or
# KERAS_BACKEND for their own process at import): --doctest-modules must not import them.
collect_ignore_glob = ["_*.py"]
