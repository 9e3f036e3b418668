"""Run the public moments in every execution mode; results as numpy arrays."""

import contextlib
import os

import jax
import numpy as np
import tensorflow as tf

import jax_kernel
import tf_stable_moments

MODES = (
    "tf_eager",
    "tf_eager_no_xla",
    "tf_function",
    "tf_function_no_xla",
    "tf_jit_compile",
    "tf_unknown_shape",
    "tf_unknown_shape_no_xla",
    "jax_jit",
    "jax_eager",
)

_functions = {}


@contextlib.contextmanager
def xla(enabled):
    old = os.environ.get("TF_STABLE_MOMENTS_XLA")
    os.environ["TF_STABLE_MOMENTS_XLA"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TF_STABLE_MOMENTS_XLA")
        else:
            os.environ["TF_STABLE_MOMENTS_XLA"] = old


def _tf_function(mode, rank, dtype, axes, ddof):
    key = (mode, rank, dtype, axes, ddof)
    if key not in _functions:

        def fn(x):
            return tf_stable_moments.moments(x, list(axes), ddof=ddof)

        if mode.startswith("tf_unknown_shape"):
            spec = [tf.TensorSpec([None] * rank, tf.as_dtype(dtype))]
            _functions[key] = tf.function(fn, input_signature=spec)
        else:
            _functions[key] = tf.function(fn, jit_compile=mode == "tf_jit_compile")
    return _functions[key]


def run(mode, x, axes, ddof=0):
    """(mean, var) of x over axes in `mode`, as numpy arrays."""
    axes = tuple(axes)
    with xla(not mode.endswith("no_xla")):
        if mode.startswith("tf_eager"):
            out = tf_stable_moments.moments(tf.constant(x), list(axes), ddof=ddof)
        elif mode.startswith("tf_"):
            out = _tf_function(mode, x.ndim, x.dtype, axes, ddof)(tf.constant(x))
        elif mode == "jax_jit":
            out = jax_kernel.moments(x, axes, ddof=ddof)
        elif mode == "jax_eager":
            with jax.disable_jit():
                out = jax_kernel.moments(x, axes, ddof=ddof)
        else:
            raise ValueError(mode)
    return tuple(o.numpy() if hasattr(o, "numpy") else np.asarray(o) for o in out)


def bits(a):
    """The bit patterns of a (complex: both parts), for bitwise comparison."""
    a = np.asarray(a)
    flat = a.reshape(-1).view(
        {2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[a.dtype.itemsize]
    )
    return flat.reshape(a.shape) if a.ndim and not np.iscomplexobj(a) else flat
