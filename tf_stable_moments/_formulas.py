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


def compute_dtype(dtype):
    """The dtype a layer computes its statistics and output in: float32 at least
    (float16 and bfloat16 inputs are upcast, as in Keras), float64 kept.  (Keras's
    `result_type` on its JAX backend turns float64 into float32, even with 64-bit types
    enabled: float64 layers would compute in float32 there and in float64 on
    TensorFlow, two different results.)"""
    import keras

    name = keras.backend.standardize_dtype(dtype)
    return "float64" if name == "float64" else keras.backend.result_type(name, "float32")
