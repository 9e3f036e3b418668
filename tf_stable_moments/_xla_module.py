"""The XLA kernel inside a TensorFlow XLA computation as one XlaCallModule operation.

Inside ``tf.function(jit_compile=True)`` (and Keras's ``jit_compile`` steps) the kernel
of moments_core/_kernel.py was built from TensorFlow operations (`_ops.XLA`), some two
thousand graph nodes that TensorFlow's XLA bridge converts to HLO again at every call
site: 11 s of a ResNet50's first ``jit_compile`` step (53 BatchNormalization layers).
Here the same kernel, on JAX operations (jax_kernel/_ops.py), is exported once per
variant (dtype, parts, axis, ddof, mean_lo, exact-only switch) with symbolic shapes
(``jax.export``: StableHLO, the format XlaCallModule reads), and every call site holds
one XlaCallModule node with that module.  TensorFlow's XLA refines the module to the
call's shapes and compiles it with the rest of the computation: no JAX at run time, no
custom call, no host round trip; a SavedModel holding it needs TensorFlow only.

The module is the same certified kernel (the same code, and the same float32-pair
choice as the TensorFlow operations: `_kernel.f32_pairs()`), so its results are the
correctly rounded ones, the bits of every other implementation.  It is lowered for
every platform XLA serves (the kernel's operations lower alike on all of them), so
the op compiles wherever TensorFlow places the computation.

Symbolic dimensions are at least 1 (jax.export's rule): a slice length or a number of
slices unknown while tracing takes the module only where it is nonzero at run time
(a tf.cond; the results of empty inputs are section 8's constants).
"""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _tfxla

from jax_kernel import _ops as _jax_ops
from moments_core import _kernel
from moments_core._formats import FORMATS

__all__ = ["kernel_outputs", "step_outputs"]

# Every platform XlaCallModule may be compiled for (TensorFlow's names, lower case).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_lock = threading.Lock()


@functools.cache
def _exported(dtype, parts, axis, ddof, lo, exact_only, f32):
    """jax.export.Exported of the kernel on `parts` arrays [rows, cols] of `dtype` (a
    name), for symbolic rows and cols: (means per part, var, [mean_lo per part],
    undecided) as `_moments._kernel_outputs` returns them."""
    fmt = FORMATS[dtype]
    work = jnp.dtype(dtype)

    def kernel(*p):
        means, var, undecided = _kernel.slice_moments(
            _jax_ops, list(p), axis, ddof, fmt, None, exact_only, None, f32
        )
        out = [m.astype(work) for m in means] + [var.astype(work)]
        if lo:
            lows = [_kernel.mean_lo(_jax_ops, x, axis, m, var, ddof, fmt) for x, m in zip(p, means)]
            out += [m.astype(work) for m in lows]
        return (*out, undecided.astype(jnp.int64))

    shape = jax.export.symbolic_shape("rows, cols")
    args = [jax.ShapeDtypeStruct(shape, work)] * parts
    with jax.enable_x64(True):
        return jax.export.export(jax.jit(kernel), platforms=PLATFORMS)(*args)


def _symbolic(axis):
    """(parts' shape, a kept-length array's shape) in one symbolic scope."""
    rows, cols = jax.export.symbolic_shape("rows, cols")
    return (rows, cols), ((cols,) if axis == 0 else (rows,))


@functools.cache
def _exported_step(step, dtype, parts, axis, ddof, exact_only, f32, has_n, sums):
    """jax.export.Exported of one XLA computation of `_moments._slice_moments_xla`, for
    symbolic shapes: "fast" (the fast path: means, var, todo, undecided, 1/n, sums),
    "exact" (the exact path on the slices todo marks) or "lows" (mean_lo).  Inputs: the
    parts, the count n where has_n, then the step's own (`sums`: the dtypes of the fast
    path's sums)."""
    fmt = FORMATS[dtype]
    work = jnp.dtype(dtype)
    whole, kept = _symbolic(axis)
    f64 = jnp.float64
    specs = [jax.ShapeDtypeStruct(whole, work)] * parts
    if has_n:
        specs.append(jax.ShapeDtypeStruct((), jnp.int64))
    vectors = {
        "fast": [],
        "exact": [jnp.bool_] + [f64] * (parts + 1) + [jnp.dtype(d) for d in sums],
        "lows": [f64] * (parts + 1),
    }[step]
    specs += [jax.ShapeDtypeStruct(kept, d) for d in vectors]
    if step == "lows":
        specs.append(jax.ShapeDtypeStruct((), f64))

    def computation(*args):
        p, rest = list(args[:parts]), args[parts:]
        count, rest = (rest[0], rest[1:]) if has_n else (None, rest)
        if step == "fast":
            means, var, todo, out = _kernel.fast_moments(
                _jax_ops, p, axis, ddof, fmt, count, exact_only, None, f32
            )
            size = _jax_ops.shape(p[0], axis) if count is None else count
            rn = _kernel.counts(_jax_ops, size, 0).rn[0]
            undecided = jnp.sum(todo.astype(jnp.int64))
            return (*means, var, todo, undecided, rn, *out)
        if step == "exact":
            todo, means, var, out = (
                rest[0],
                list(rest[1 : parts + 1]),
                rest[parts + 1],
                rest[parts + 2 :],
            )
            means, var = _kernel.exact_fix(
                _jax_ops, p, axis, ddof, fmt, count, todo, means, var, list(out)
            )
            return (*means, var)
        means, var, rn = rest[:parts], rest[parts], rest[parts + 1]
        return tuple(
            _kernel.mean_lo(_jax_ops, x, axis, m, var, ddof, fmt, count, rn=rn)
            for x, m in zip(p, means)
        )

    with jax.enable_x64(True):
        return jax.export.export(jax.jit(computation), platforms=PLATFORMS)(*specs)


def step_outputs(step, parts, count, vectors, scalars, axis, ddof, exact_only, sums=()):
    """One XLA computation of `_moments._slice_moments_xla` as an XlaCallModule op (inside
    its jit_compile function): `step` on the parts, the count (or None), kept-length
    `vectors` and `scalars`.  A length or slice count that is 0 at run time takes
    section 8's results (the fast path: NaN, nothing open; mean_lo 0)."""
    dtype, k = parts[0].dtype, len(parts)
    with _lock:
        exported = _exported_step(
            step,
            dtype.name,
            k,
            axis,
            ddof,
            exact_only,
            _kernel.f32_pairs(),
            count is not None,
            tuple(s.name for s in sums),
        )
    counts = [] if count is None else [count]
    kept = parts[0].shape[1 - axis]
    dims = tf.shape(parts[0])
    size = dims[1 - axis]
    extra = tf.maximum(1 - dims, 0)

    def call():
        padded = [tf.pad(p, tf.stack([[0, extra[0]], [0, extra[1]]])) for p in parts]
        wide = [tf.pad(v, [[0, extra[1 - axis]]]) for v in vectors]
        out = _call([*padded, *counts, *wide, *scalars], exported, kept)
        return tuple(o if o.shape.rank == 0 else o[:size] for o in out)

    def empty():
        nan = tf.fill([size], tf.constant(float("nan"), tf.float64))
        if step == "lows":
            return (tf.zeros_like(nan),) * k
        no = tf.zeros([size], tf.bool)
        rest = [no if s == tf.bool else tf.zeros_like(nan) for s in _fast_sums(exported, k)]
        one = tf.constant(1.0, tf.float64)
        return (nan,) * (k + 1) + (no, tf.constant(0, tf.int64), one, *rest)

    if step == "exact":  # runs only where a slice is open: never on empty data
        return _call([*parts, *counts, *vectors, *scalars], exported, kept)
    return tf.cond(tf.reduce_all(dims > 0), call, empty)


def _fast_sums(exported, parts):
    """The dtypes of the fast path's sums (its outputs after means, var, todo,
    undecided and 1/n)."""
    return [tf.as_dtype(np.dtype(a.dtype)) for a in exported.out_avals[parts + 4 :]]


def _call(parts, exported, kept):
    """The XlaCallModule op of `exported` on the parts; outputs of length kept."""
    shapes = [tf.TensorShape([kept] * len(a.shape)) for a in exported.out_avals]
    out = _tfxla.call_module(
        list(parts),
        version=exported.calling_convention_version,
        module=exported.mlir_module_serialized,
        Tout=[tf.as_dtype(np.dtype(a.dtype)) for a in exported.out_avals],
        Sout=shapes,
        platforms=tuple(p.upper() for p in exported.platforms),
        disabled_checks=tuple(str(c) for c in exported.disabled_safety_checks),
        function_list=[],
        has_token_input_output=False,
    )
    return tuple(out)


def _empty(parts, lo, size):
    """The results for no elements or no slices (section 8): means and variance NaN,
    mean_lo 0 (as the kernel gives them), 0 undecided."""
    k = len(parts)
    nan = tf.fill([size], tf.constant(float("nan"), parts[0].dtype))
    lows = (tf.zeros_like(nan),) * k if lo else ()
    return (nan,) * (k + 1) + lows + (tf.constant(0, tf.int64),)


def kernel_outputs(parts, axis, ddof, lo, exact_only):
    """`_moments._kernel_outputs` of 2-D parts (none of whose static dimensions is 0)
    inside an XLA computation, as one XlaCallModule op."""
    dtype = parts[0].dtype
    with _lock:
        exported = _exported(
            dtype.name, len(parts), axis, ddof, lo, exact_only, _kernel.f32_pairs()
        )
    kept = parts[0].shape[1 - axis]
    if parts[0].shape.is_fully_defined():
        return _call(parts, exported, kept)
    # XLA refines the module to the shapes it compiles for, in both branches of the
    # cond: the module gets at least one row and column (a zero-padded dimension,
    # whose results the other branch replaces).
    dims = tf.shape(parts[0])
    extra = tf.maximum(1 - dims, 0)
    size = dims[1 - axis]

    def call():
        padded = [tf.pad(p, tf.stack([[0, extra[0]], [0, extra[1]]])) for p in parts]
        return tuple(o if o.shape.rank == 0 else o[:size] for o in _call(padded, exported, kept))

    return tf.cond(tf.reduce_all(dims > 0), call, lambda: _empty(parts, lo, size))
