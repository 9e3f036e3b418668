"""Run the public moments in every execution mode; results as numpy arrays."""

import contextlib
import os

import jax
import numpy as np
import tensorflow as tf

import jax_kernel
import tf_stable_moments

# Every implementation of the contract, in every way users run it.  The native
# kernel serves eager mode, graphs outside XLA and (as XLA custom calls) a user's
# jit_compile computation on the CPU; "_xla" modes switch it off
# (TF_STABLE_MOMENTS_NATIVE=0) to run the pure-XLA kernel that accelerators use,
# "_plain" modes switch XLA off too (the fallback of plain TensorFlow operations).
MODES = (
    "tf_eager",
    "tf_function",
    "tf_unknown_shape",
    "tf_jit_compile",
    "tf_jit_compile_xla",
    "tf_eager_xla",
    "tf_eager_plain",
    "tf_function_plain",
    "jax_jit",
    "jax_eager",
    "jax_jit_xla",
)
# The modes that compile the XLA kernel per new shape (seconds each on 2 cores): tests
# over many shapes run them on a few representative shapes.  (tf_jit_compile compiles
# per shape too, but only the custom call and a few operations around it.)
XLA_MODES = ("tf_jit_compile_xla", "tf_eager_xla", "jax_jit_xla")
CHEAP_MODES = tuple(m for m in MODES if m not in XLA_MODES)
# tf_function_plain runs the very computation of tf_eager_plain (the same eager
# operations, inside a tf.py_function; about a second per call on 2 cores): the tests
# over every data set and rounding fixture run it as tf_eager_plain only; the API,
# gradient and special-value tests run both.
SLICE_MODES = tuple(m for m in CHEAP_MODES if m != "tf_function_plain")

_functions = {}


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old


def xla(enabled):
    return _env("TF_STABLE_MOMENTS_XLA", "1" if enabled else "0")


def native(enabled):
    return _env("TF_STABLE_MOMENTS_NATIVE", "1" if enabled else "0")


def _tf_function(mode, rank, dtype, axes, ddof):
    key = (mode, rank, dtype, axes, ddof)
    if key not in _functions:

        def fn(x):
            return tf_stable_moments.moments(x, list(axes), ddof=ddof)

        if mode.startswith("tf_unknown_shape"):
            spec = [tf.TensorSpec([None] * rank, tf.as_dtype(dtype))]
            _functions[key] = tf.function(fn, input_signature=spec)
        else:
            _functions[key] = tf.function(fn, jit_compile=mode.startswith("tf_jit_compile"))
    return _functions[key]


def run(mode, x, axes, ddof=0):
    """(mean, var) of x over axes in `mode`, as numpy arrays."""
    axes = tuple(axes)
    plain = mode.endswith("_plain")
    with xla(not plain), native(not (plain or mode.endswith("_xla"))):
        if mode.startswith("tf_eager"):
            out = tf_stable_moments.moments(tf.constant(x), list(axes), ddof=ddof)
        elif mode.startswith("tf_"):
            out = _tf_function(mode, x.ndim, x.dtype, axes, ddof)(tf.constant(x))
        elif mode.startswith("jax_jit"):
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


def assert_oracle(out, want, labels=None):
    """Every slice bitwise equal to the oracle; labels (one per slice) name the wrong ones."""
    for got, exact, what in zip(out, want, ("mean", "var")):
        assert got.dtype == exact.dtype, (what, got.dtype, exact.dtype)
        wrong = np.flatnonzero(bits(got.ravel()) != bits(exact.ravel()))
        per = 2 if np.iscomplexobj(got) else 1  # bits() gives both parts of a complex
        where = "" if labels is None else f" in {sorted({labels[i // per] for i in wrong})}"
        assert wrong.size == 0, (
            f"{what}: {wrong.size} slices not correctly rounded{where}, e.g. "
            f"{got.ravel()[wrong[:3]]} vs exact {exact.ravel()[wrong[:3]]}"
        )


def stacked_oracle(names, oracle):
    """(mean, var) of stacked rows from the oracle of each named entry (`names`: the
    entry of each row, rows of one entry consecutive), flat, in row order."""
    want = [oracle(name) for name in dict.fromkeys(names)]
    return tuple(np.concatenate([np.ravel(w[i]) for w in want]) for i in (0, 1))
