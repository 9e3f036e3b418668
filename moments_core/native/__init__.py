"""The native kernel: moments.h (C++) and its build (build.py); no TF or JAX import."""
