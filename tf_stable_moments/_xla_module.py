"""The XLA kernel in TensorFlow as XlaCallModule operations.

Inside ``tf.function(jit_compile=True)`` (and Keras's ``jit_compile`` steps) the kernel
of moments_core/_kernel.py was built from TensorFlow operations (`_ops.XLA`), some two
thousand graph nodes that TensorFlow's XLA bridge converts to HLO again at every call
site: 11 s of a ResNet50's first ``jit_compile`` step (53 BatchNormalization layers).
Here the same kernel, on JAX operations (jax_kernel/_ops.py), is exported once per
variant (dtype, parts, axis, ddof, mean_lo, exact-only switch) with symbolic shapes
(``jax.export``: StableHLO, the format XlaCallModule reads), and every call site holds
one XlaCallModule node with that module: the whole kernel inside a user's XLA
computation, and each of the three XLA computations of its own (fast path, exact
path, mean_lo) that eager mode and plain graphs run with the native kernel off.
TensorFlow's XLA refines the module to the call's shapes and compiles it with the rest
of the computation: no JAX at run time, no custom call, no host round trip; a
SavedModel holding it needs TensorFlow only.

The module is the same certified kernel (the same code, and the same float32-pair
choice as the TensorFlow operations: `_kernel.f32_pairs()`), so its results are the
correctly rounded ones, the bits of every other implementation.  It is lowered for
every platform XLA serves (the kernel's operations lower alike on all of them), so
the op compiles wherever TensorFlow places the computation.

The exported modules are kept in the per-user cache of the native libraries
(``TF_STABLE_MOMENTS_CACHE``), one folder per text of the kernel's sources and JAX
version: a later process reads a variant back (about 1 ms) instead of tracing and
lowering the kernel again (0.4-0.8 s a variant on this 2-core machine).

Symbolic dimensions are at least 1 (jax.export's rule), and XLA refines the module to
the shapes it compiles for in both branches of a tf.cond: where a dimension is unknown
while tracing, the module gets its inputs padded to at least one row and column, and
a tf.cond takes section 8's results instead where the slice length or the number of
slices is 0 at run time.
"""

import functools
import glob
import hashlib
import os
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _tfxla

from jax_kernel import _ops as _jax_ops
from moments_core import _kernel
from moments_core._formats import FORMATS
from moments_core.native import build as _build

__all__ = ["outputs"]

# Every platform XlaCallModule may be compiled for (TensorFlow's names, lower case).
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

_lock = threading.Lock()

# The kernel's sources: an exported module is a function of these, the variant and the
# JAX that exported it (`_cache_path`).
_PACKAGES = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCES = ("moments_core/*.py", "jax_kernel/_ops.py", "tf_stable_moments/_xla_module.py")


@functools.cache
def _sources_digest():
    """SHA-256 of the kernel's source files and of the JAX versions that export it."""
    digest = hashlib.sha256(f"jax {jax.__version__} {jax.lib.__version__}".encode())
    for pattern in _SOURCES:
        for path in sorted(glob.glob(os.path.join(_PACKAGES, pattern))):
            digest.update(os.path.relpath(path, _PACKAGES).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _cache_path(variant):
    """The module cache's file for `variant` (`_exported`'s arguments): the per-user
    directory of the native libraries (`TF_STABLE_MOMENTS_CACHE`), one folder per
    source text and JAX version, so that a changed kernel never loads an older module."""
    folder = _build.cache_dir(f"modules-{_sources_digest()[:16]}")
    name = hashlib.sha256(repr((variant, PLATFORMS)).encode()).hexdigest()[:24]
    return os.path.join(folder, f"{name}.jax_exported")


def _load(path):
    """The Exported stored at path, or None (missing, unreadable, or not one)."""
    try:
        with open(path, "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
    except Exception:  # noqa: BLE001 (any damage: export again)
        return None
    return exported if tuple(exported.platforms) == PLATFORMS else None


def _store(path, exported):
    """Write the serialized module atomically (a temporary file renamed into place, so a
    reader sees a whole file or none); a cache that cannot be written is skipped."""
    data = exported.serialize()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _exported(*variant):
    """`_export` of the variant, read from the module cache when a process before this
    one exported it (tracing and lowering the kernel cost 0.4-0.8 s a variant here,
    reading it back about 1 ms), else exported and stored there."""
    path = _cache_path(variant)
    exported = _load(path)
    if exported is None:
        exported = _export(*variant)
        _store(path, exported)
    return exported


def _export(step, dtype, parts, axis, ddof, lo, exact_only, f32, has_n, sums):
    """jax.export.Exported of one computation of the kernel on `parts` arrays [rows, cols]
    of `dtype` (a name), for symbolic rows and cols:

      "kernel": the whole kernel: means per part, var, [mean_lo per part with lo],
        undecided, as `_kernel.kernel_outputs` returns them (JAX's XLA kernel too);
      "fast", "exact", "lows": the three computations of `_moments._slice_moments_xla`:
        the fast path (means, var, todo, undecided, 1/n, sums), the exact path on the
        slices todo marks (means, var), mean_lo (per part).

    Inputs: the parts, the count n where has_n, then the step's own: kept-length arrays
    (exact: todo, means, var, the fast path's sums of dtypes `sums`; lows: means, var)
    and scalars (lows: 1/n)."""
    fmt = FORMATS[dtype]
    work = jnp.dtype(dtype)
    rows, cols = jax.export.symbolic_shape("rows, cols")
    kept = (cols,) if axis == 0 else (rows,)
    f64 = jnp.float64
    specs = [jax.ShapeDtypeStruct((rows, cols), work)] * parts
    if has_n:
        specs.append(jax.ShapeDtypeStruct((), jnp.int64))
    vectors = {
        "kernel": [],
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
        if step == "kernel":
            return _kernel.kernel_outputs(_jax_ops, p, axis, ddof, fmt, count, lo, exact_only, f32)
        if step == "fast":
            means, var, todo, out = _kernel.fast_moments(
                _jax_ops, p, axis, ddof, fmt, count, exact_only, None, f32
            )
            # 1/n for mean_lo ("lows"), from the reciprocals the fast path computes anyway.
            size = _jax_ops.shape(p[0], axis) if count is None else count
            rn = _kernel.counts(_jax_ops, size, 0).rn[0]
            return (*means, var, todo, jnp.sum(todo.astype(jnp.int64)), rn, *out)
        if step == "exact":
            todo, means, var = rest[0], list(rest[1 : parts + 1]), rest[parts + 1]
            sums = list(rest[parts + 2 :])
            means, var = _kernel.exact_fix(
                _jax_ops, p, axis, ddof, fmt, count, todo, means, var, sums
            )
            return (*means, var)
        means, var, rn = rest[:parts], rest[parts], rest[parts + 1]
        return tuple(
            _kernel.mean_lo(_jax_ops, x, axis, m, var, ddof, fmt, count, rn=rn)
            for x, m in zip(p, means)
        )

    with jax.enable_x64(True):
        return jax.export.export(jax.jit(computation), platforms=PLATFORMS)(*specs)


def _call(args, exported, kept):
    """The XlaCallModule op of `exported` on args; kept-length outputs of length kept."""
    out = _tfxla.call_module(
        list(args),
        version=exported.calling_convention_version,
        module=exported.mlir_module_serialized,
        Tout=[tf.as_dtype(np.dtype(a.dtype)) for a in exported.out_avals],
        Sout=[tf.TensorShape([kept] * len(a.shape)) for a in exported.out_avals],
        platforms=tuple(p.upper() for p in exported.platforms),
        disabled_checks=tuple(str(c) for c in exported.disabled_safety_checks),
        function_list=[],
        has_token_input_output=False,
    )
    return tuple(out)


def _empty(exported, parts, size, step):
    """The results for no elements or no slices (section 8), as the kernel gives them:
    means and variance NaN, mean_lo 0, nothing open (todo False, the sums 0), 1/n 1."""
    out = []
    for i, a in enumerate(exported.out_avals):
        dtype = tf.as_dtype(np.dtype(a.dtype))
        if not a.shape:  # undecided, or 1/n
            out.append(tf.constant(1.0 if dtype.is_floating else 0, dtype))
        elif i <= parts and step != "lows":  # the means and the variance
            out.append(tf.fill([size], tf.constant(float("nan"), dtype)))
        else:
            out.append(tf.zeros([size], dtype))
    return tuple(out)


def outputs(step, parts, axis, ddof, exact_only, count=None, vectors=(), scalars=(), lo=False):
    """`step` of `_exported` as one XlaCallModule op on the 2-D parts (none of whose
    static dimensions is 0), the count (or None), kept-length `vectors` and `scalars`."""
    k = len(parts)
    sums = tuple(v.dtype.name for v in vectors[k + 2 :]) if step == "exact" else ()
    with _lock:
        exported = _exported(
            step,
            parts[0].dtype.name,
            k,
            axis,
            ddof,
            lo,
            exact_only,
            _kernel.f32_pairs(),
            count is not None,
            sums,
        )
    counts = [] if count is None else [count]
    kept = parts[0].shape[1 - axis]
    # The exact path runs only where a slice is open: never on empty data.
    if step == "exact" or parts[0].shape.is_fully_defined():
        return _call([*parts, *counts, *vectors, *scalars], exported, kept)
    dims = tf.shape(parts[0])
    size = dims[1 - axis]
    extra = tf.maximum(1 - dims, 0)

    def call():
        padded = [tf.pad(p, tf.stack([[0, extra[0]], [0, extra[1]]])) for p in parts]
        wide = [tf.pad(v, [[0, extra[1 - axis]]]) for v in vectors]
        out = _call([*padded, *counts, *wide, *scalars], exported, kept)
        return tuple(o if o.shape.rank == 0 else o[:size] for o in out)

    return tf.cond(tf.reduce_all(dims > 0), call, lambda: _empty(exported, k, size, step))
