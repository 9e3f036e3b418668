"""The output formulas (docs/algorithm.md section 14) of a Keras backend, without
importing the other framework: tf_stable_moments/_output.py on TensorFlow,
jax_kernel/_output.py on JAX."""

import functools
import importlib
from types import SimpleNamespace

NAMES = ("rsqrt", "div", "recip", "times", "affine", "blend", "scale_shift")


@functools.cache
def formulas(backend):
    """The namespace (rsqrt, div, recip, times, affine, blend, scale_shift) of a Keras
    backend's tensors ('tensorflow' or 'jax')."""
    name = "tf_stable_moments._output" if backend == "tensorflow" else "jax_kernel._output"
    module = importlib.import_module(name)
    return SimpleNamespace(**{n: getattr(module, n) for n in NAMES})
