"""Public TensorFlow wrapper: validate, lay out, dispatch, differentiate.

Two implementations of one contract (docs/algorithm.md), each certifying its
results: the native C++ op (moments_core/native/moments.h, `_native`) in eager
mode and in graphs outside XLA, and the kernel of moments_core/_kernel.py on
TensorFlow operations (`_ops.py`) inside XLA (jit_compile) or where the native
op is not available.  Every result is correctly rounded, so the bits do not
depend on which one ran.
"""

import functools
import os
import threading
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import record as _record

from moments_core import _kernel
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof, out_shape
from tf_stable_moments import _native, _ops, _xla_module
from tf_stable_moments._xla_context import in_xla_context

_COMPUTE = {
    tf.float16: tf.float16,
    tf.bfloat16: tf.bfloat16,
    tf.float32: tf.float32,
    tf.float64: tf.float64,
    tf.complex64: tf.float32,
    tf.complex128: tf.float64,
}


def _compute_dtype(dtype):
    """The dtype policy: each real format is its own target format; complex by parts."""
    if dtype not in _COMPUTE:
        raise TypeError(
            "moments: x must have a floating or complex dtype (float16, bfloat16, float32, "
            f"float64, complex64, complex128); got dtype {dtype.name}"
        )
    return _COMPUTE[dtype]


def _canonical_axes(axes, ndim):
    if isinstance(axes, tf.Tensor):
        value = tf.get_static_value(axes)
        if value is None:
            raise ValueError("moments: axes must be known while tracing; got a dynamic tensor")
        axes = value
    return canonical_axes(axes, ndim)


def _check_ddof(ddof):
    return check_ddof(ddof)


def _dims(x):
    static = x.shape.as_list()
    if None not in static:
        return static
    dynamic = tf.shape(x, out_type=tf.int64)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def _reshape(x, shape):
    """tf.reshape, skipped when the static shape already matches (one eager op less)."""
    if not tf.is_tensor(shape) and x.shape.as_list() == list(shape):
        return x
    return tf.reshape(x, shape)


def _product(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def _layout(x, axes):
    """x as a 2-D tensor whose slices run along axis 0 (leading axes) or 1."""
    ndim = x.shape.rank
    kept = [a for a in range(ndim) if a not in axes]
    dims = _dims(x)
    n = _product([dims[a] for a in axes])
    rest = _product([dims[a] for a in kept])
    if axes == tuple(range(len(axes))):
        return _reshape(x, tf.stack([n, rest]) if tf.is_tensor(n * rest) else [n, rest]), 0
    if axes != tuple(range(ndim - len(axes), ndim)):
        x = tf.transpose(x, kept + list(axes))
    return _reshape(x, tf.stack([rest, n]) if tf.is_tensor(n * rest) else [rest, n]), 1


def _out_shape(x, axes, keepdims):
    shape = out_shape(_dims(x), axes, keepdims)
    return tf.stack(shape) if any(tf.is_tensor(d) for d in shape) else shape


def _exact_only():
    """Test switch: TF_STABLE_MOMENTS_EXACT_ONLY=1 sends every slice through the exact path."""
    return os.environ.get("TF_STABLE_MOMENTS_EXACT_ONLY", "0") == "1"


def _kernel_outputs(ops, parts, axis, ddof, n=None, lo=False, exact_only=False):
    """(mean per part, var, [mean_lo], undecided) in the parts' dtype: the kernel itself."""
    fmt = FORMATS[parts[0].dtype.name]
    return _kernel.kernel_outputs(
        ops, list(parts), axis, ddof, fmt, n, lo, exact_only, _kernel.f32_pairs()
    )


# Compiled functions are kept per TensorFlow context (a reset context starts afresh) and
# hold no tensor: nothing built in one graph or context is used in another.
_lock = threading.RLock()  # re-entered: a graph variant traces the steps it calls
_cache = {"context": None, "functions": {}, "exact_shapes": {}}


def _context_cache():
    ctx = _context.context()
    with _lock:
        if _cache["context"] is not ctx:
            _cache.update(context=ctx, functions={}, exact_shapes={})
        return _cache


def _compiled(key, fn, spec, jit_compile=True, noinline=False):
    """A tf.function of the current context (jit_compile by default; None: for calls
    from graphs that XLA compiles, which inlines it), traced once per key: its concrete
    function (the signature is fixed), which eager mode calls in about 0.2 ms where the
    polymorphic function's argument binding takes about 0.45 ms (measured on a blend of
    two 64-vectors; a BatchNormalization step in eager mode makes two such calls).
    noinline: a function that TensorFlow's graph optimizer keeps as one call, not
    inlined at every call site (`_output._compiled`'s portable functions)."""
    functions = _context_cache()["functions"]
    key = (key, jit_compile, noinline)
    with _lock:
        if key not in functions:
            functions[key] = tf.function(
                fn,
                input_signature=spec,
                jit_compile=jit_compile,
                autograph=False,
                experimental_attributes={"_noinline": True} if noinline else None,
            ).get_concrete_function()
        return functions[key]


def _slice_moments_xla(axis, ddof, parts, n=None, lo=False):
    """The kernel as XLA computations of its own, each traced once and compiled per shape:
    the fast path, then (only if a slice is undecided) the exact path, then mean_lo, each
    one XlaCallModule op of the kernel's JAX lowering (`_xla_module.outputs`).

    In a graph the three and the tf.cond between them are one function per variant,
    traced once: a call site adds one call, not a tf.cond with its two branch graphs
    (ResNet50's 53 layers traced those in about 1 s of a tf.function's first step,
    under cProfile)."""
    dtype, k, has_n = parts[0].dtype, len(parts), n is not None
    data = list(parts) + ([tf.cast(n, tf.int64)] if has_n else [])
    if tf.executing_eagerly():
        return _xla_steps(axis, ddof, k, dtype, has_n, lo, data)
    key = ("graph", axis, ddof, k, dtype, has_n, lo, _exact_only())
    steps = functools.partial(_xla_steps, axis, ddof, k, dtype, has_n, lo)
    spec = _data_spec(k, dtype, has_n)
    out = _compiled(key, lambda *args: steps(list(args)), spec, jit_compile=False)(*data)
    return tuple(tf.ensure_shape(o, [None]) for o in out[:-1]) + (out[-1],)


def _data_spec(k, dtype, has_n):
    """The signature of the kernel's data: k parts [rows, cols], then the count n."""
    return [tf.TensorSpec([None, None], dtype)] * k + ([tf.TensorSpec([], tf.int64)] * has_n)


def _xla_steps(axis, ddof, k, dtype, has_n, lo, data):
    """`_slice_moments_xla`'s steps on data (the parts, then n where has_n)."""
    exact_only = _exact_only()
    key = (axis, ddof, k, dtype, has_n)
    spec = _data_spec(k, dtype, has_n)
    results = [tf.TensorSpec([None], tf.float64)] * (k + 1)

    def split(args):
        return list(args[:k]), (args[k] if has_n else None), args[k + has_n :]

    def fast(*args):
        p, count, _ = split(args)
        return _xla_module.outputs("fast", p, axis, ddof, exact_only, count)

    def exact(*args):
        p, count, rest = split(args)
        return _xla_module.outputs("exact", p, axis, ddof, exact_only, count, rest)

    def lows(*args):
        p, count, rest = split(args)
        return _xla_module.outputs(
            "lows", p, axis, ddof, exact_only, count, rest[: k + 1], rest[k + 1 :]
        )

    out = _compiled(("fast", exact_only, *key), fast, spec)(*data)
    means, var, todo, undecided = list(out[:k]), out[k], out[k + 1], out[k + 2]
    rn, sums = out[k + 3], list(out[k + 4 :])
    sums_spec = [tf.TensorSpec([None], s.dtype) for s in sums]

    def fixed():
        # Traced at its first use: eagerly, only when a slice is undecided (tracing the
        # exact path took a fifth of a first eager call: [64, 32, 32, 64], 1.55 s ->
        # 1.20-1.23 s); a graph's tf.cond traces it with the graph.
        exact_fn = _compiled(
            ("exact", *key), exact, spec + [tf.TensorSpec([None], tf.bool)] + results + sums_spec
        )
        return exact_fn(*data, todo, *means, var, *sums)

    if tf.executing_eagerly():
        fixed_out = fixed() if int(undecided) > 0 else (*means, var)
    else:
        fixed_out = tf.cond(undecided > 0, fixed, lambda: (*means, var))
    means, var = list(fixed_out[:k]), fixed_out[k]
    out = [tf.cast(m, dtype) for m in means] + [tf.cast(var, dtype)]
    if lo:
        lo_fn = _compiled(("lo", *key), lows, spec + results + [tf.TensorSpec([], tf.float64)])
        out += [tf.cast(m, dtype) for m in lo_fn(*data, *means, var, rn)]
    return tuple(out) + (undecided,)


def _inline_kernel(parts, axis, ddof, lo):
    """The kernel inside a user's XLA computation: one XlaCallModule op holding the
    kernel's JAX lowering, exported once per variant for any shape (`_xla_module`).
    TensorFlow's XLA bridge converted the kernel's two thousand TensorFlow operations at
    every call site before (a ResNet50's first jit_compile step: 53 call sites, 11 s of
    bridge).  XLA compiles the call for the shapes it is given; the results are the
    certified ones."""
    exact_only = _exact_only()
    if 0 in parts[0].shape.as_list():  # no data or no slices: the trivial static results
        return _kernel_outputs(_ops.XLA, parts, axis, ddof, None, lo, exact_only)
    return _xla_module.outputs("kernel", parts, axis, ddof, exact_only, lo=lo)


# XLA compiles the kernel once per concrete shape, so shapes are bucketed (8
# steps per octave): a dimension unknown while tracing always, and every
# dimension of eager calls once EXACT_SHAPES distinct shapes have been compiled
# for a kernel variant.  Slices are padded with copies of their first element
# (their differences from it are exact zeros; the kernel is told n) and the
# kept axis with zeros (sliced off): the certified results are those of the
# unpadded slices.  Not inside a user's XLA computation: it compiles per shape
# anyway, and its shapes are constants there.
EXACT_SHAPES = 8
# A bucketed kept axis has at least FLOOR_ELEMENTS / n slices (a power of two, at most
# FLOOR_SLICES; n the slice length it runs with, if known while tracing), so that the
# small batches of a LayerNormalization or GroupNormalization whose batch is unknown (a
# served model, Keras's relaxed traces) share one compilation.  Each bucket compiles on
# its own: 0.29-0.50 s for each new batch size of `[None, 64, 128]` over the last axis,
# native kernel off.  The padding slices are zeros, all decided by the fast path.  They
# cost more per call than their elements suggest: batch 1 there (64 slices raised to
# 256) took 1.14x as long per call (paired medians), with 2**16 (512 slices) 1.41x.
FLOOR_ELEMENTS = 2**15
FLOOR_SLICES = 4096


def _kept_floor(n):
    """The fewest slices a bucketed kept axis of slices of length n (an int, or a
    tensor: no floor) runs with: FLOOR_ELEMENTS / n rounded up to a power of two (the
    one-step bucket), at most FLOOR_SLICES."""
    if tf.is_tensor(n):
        return 1
    return min(FLOOR_SLICES, _bucket(-(-FLOOR_ELEMENTS // max(n, 1)), octave_steps=1))


def _bucket(m, octave_steps=8):
    """m (an int or an int64 tensor) rounded up to one of `octave_steps` steps per octave."""
    shift = octave_steps.bit_length()  # m in (2**(t-1), 2**t]: steps of 2**(t - shift)
    if tf.is_tensor(m):
        if tf.executing_eagerly():
            return _bucket_tensor(m, shift)
        # In a graph one function, traced once: a call per site instead of the bit
        # length's dozens of operations (0.5 s of tracing in ResNet50's 53 layers, cProfile).
        spec = [tf.TensorSpec([], tf.int64)]
        fn = _compiled(("bucket", shift), lambda v: _bucket_tensor(v, shift), spec, False)
        return fn(tf.cast(m, tf.int64))
    step = 1 << max(max(m - 1, 0).bit_length() - shift, 0)
    return max(-(-m // step) * step, 1)


def _bucket_tensor(m, shift):
    from moments_core._exact import bit_length

    top = bit_length(_ops.XLA, tf.maximum(m - 1, 0))
    step = tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.maximum(top - shift, 0))
    return tf.maximum((m + step - 1) // step * step, 1)


def _sizes(x, axis, dims):
    """The padded [rows, columns] the kernel runs on, or None for the exact shape."""
    static = x.shape.as_list()
    bucket = [d is None for d in static]
    if None not in static and tf.executing_eagerly():
        seen = _context_cache()["exact_shapes"].setdefault((axis, x.dtype), set())
        with _lock:
            if tuple(static) not in seen and len(seen) >= EXACT_SHAPES:
                bucket = [True, True]
            else:
                seen.add(tuple(static))
    if not any(bucket):
        return None
    sizes = [_bucket(d) if b else d for d, b in zip(dims, bucket)]
    if bucket[1 - axis]:
        floor = _kept_floor(sizes[axis])
        kept = sizes[1 - axis]
        sizes[1 - axis] = tf.maximum(kept, floor) if tf.is_tensor(kept) else max(kept, floor)
    return sizes


def _bucketed(parts, axis):
    """(parts, n, kept): parts padded to _sizes, the count n if slices are padded
    (else None) and the kept length if the kept axis is padded (else None).

    In a graph, parts of a length unknown while tracing are padded by one function per
    static shape, traced once (a call per site instead of some forty operations: 1 s of
    tracing in a ResNet50's step for a new batch size, under cProfile); its count and
    kept length are there exactly where that length is unknown (`_sizes` buckets
    those)."""
    static = parts[0].shape.as_list()
    if tf.executing_eagerly() or None not in static:
        return _bucketed_now(parts, axis)
    k = len(parts)
    key = ("bucketed", axis, k, parts[0].dtype, tuple(static))
    spec = [tf.TensorSpec(static, parts[0].dtype)] * k

    def padded(*p):
        out, n, kept = _bucketed_now(list(p), axis)
        return [*out, *[t for t in (n, kept) if t is not None]]

    out = list(_compiled(key, padded, spec, jit_compile=False)(*parts))
    n = out[k] if static[axis] is None else None
    kept = out[-1] if static[1 - axis] is None else None
    return out[:k], n, kept


def _bucketed_now(parts, axis):
    dims = _dims(parts[0])
    sizes = _sizes(parts[0], axis, dims)
    if sizes is None:
        return parts, None, None
    padded = [_pad(p, axis, dims, sizes) for p in parts]
    n = dims[axis] if _differs(sizes[axis], dims[axis]) else None
    kept = dims[1 - axis] if _differs(sizes[1 - axis], dims[1 - axis]) else None
    return padded, n, kept


def _differs(a, b):
    return tf.is_tensor(a) or tf.is_tensor(b) or a != b


def _pad(x, axis, dims, sizes):
    """x padded to `sizes`: slices with copies of their first element, the kept axis with zeros."""
    if _differs(sizes[axis], dims[axis]):
        first = x[:1] if axis == 0 else x[:, :1]
        extra = tf.cast(sizes[axis] - dims[axis], tf.int32)
        if tf.is_tensor(dims[axis]):  # an empty slice (n = 0) pads with a zero
            one = [[0, 0], [0, 0]]
            one[axis] = [0, 1 - tf.shape(first)[axis]]
            first = tf.pad(first, one)
        elif dims[axis] == 0:
            first = tf.zeros([1, dims[1]] if axis == 0 else [dims[0], 1], x.dtype)
        x = tf.concat([x, tf.tile(first, [extra, 1] if axis == 0 else [1, extra])], axis)
    if _differs(sizes[1 - axis], dims[1 - axis]):
        rows = [[0, 0], [0, 0]]
        rows[1 - axis] = [0, tf.cast(sizes[1 - axis] - dims[1 - axis], tf.int32)]
        x = tf.pad(x, rows)
    return x


# XLA dispatch: None = not tried yet, True = works, False = fell back to plain ops.
_xla_state = {"ok": None}


def _use_xla():
    if os.environ.get("TF_STABLE_MOMENTS_XLA", "1") == "0":
        return False
    return _xla_state["ok"] is not False


_XLA_ERRORS = (
    tf.errors.UnimplementedError,
    tf.errors.NotFoundError,
    tf.errors.InvalidArgumentError,
)


def _xla_runs(dtype):
    """Whether XLA compiles and runs the kernel at all: an eager probe on a 1 x 1 input."""
    try:
        with tf.init_scope():
            _slice_moments_xla(1, 0, [tf.zeros([1, 1], dtype)])
        return True
    except _XLA_ERRORS:
        return False


def _tflite_moments(parts, axis, ddof, lo=False):
    """`_slice_moments` for TensorFlow Lite (`portable("tflite")`): float32 operations that
    TFLite has as builtins, not certified (docs/algorithm.md section 15).  Per part, with
    k a first estimate of the mean (float16 and bfloat16 data in float32):

        k = mean(x);  mean = k + mean(x - k);  mean_lo = mean(x - mean)
        var = sum over the parts of sum((x - mean) - mean_lo)**2, / (n - ddof)

    x - k and x - mean are exact wherever the estimate is within a factor 2 of x
    (Sterbenz), as on data far from zero; each pass leaves only the rounding of its
    float32 sum of small terms.  undecided is 0."""
    dtype = parts[0].dtype
    work = tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype
    n = tf.cast(tf.shape(parts[0])[axis], work)
    means, lows, squares = [], [], 0.0
    for p in parts:
        x = tf.cast(p, work)
        k = tf.reduce_mean(x, axis, keepdims=True)
        mean = k + tf.reduce_mean(x - k, axis, keepdims=True)
        low = tf.reduce_mean(x - mean, axis, keepdims=True)
        squares += tf.reduce_sum(tf.square((x - mean) - low), axis)
        means.append(tf.squeeze(mean, axis))
        lows.append(tf.squeeze(low, axis))
    out = [tf.cast(m, dtype) for m in means] + [tf.cast(squares / (n - ddof), dtype)]
    if lo:
        out += [tf.cast(v, dtype) for v in lows]
    return (*out, tf.constant(0, tf.int64))


def _slice_moments(parts, axis, ddof, lo=False):
    """Kernel call: (mean per part, var, [mean_lo per part], undecided).

    Inside a user's XLA computation the kernel is built into it.  Otherwise it
    runs as an XLA computation of its own when XLA is available.  If the first
    XLA call fails with an error that a missing or unusable XLA gives, a 1 x 1
    probe decides: if the probe fails too, XLA is switched off for the process
    (with a warning) and plain operations run; if it runs, the error belongs to
    this call and is raised.
    """
    if _native.tflite_now():
        return _tflite_moments(parts, axis, ddof, lo)
    if in_xla_context():
        return _inline_kernel(parts, axis, ddof, lo)
    if _use_xla():
        try:
            padded, n, kept = _bucketed(parts, axis)
            out = _slice_moments_xla(axis, ddof, padded, n, lo)
            _xla_state["ok"] = True
            return out if kept is None else tuple(o[:kept] for o in out[:-1]) + (out[-1],)
        except _XLA_ERRORS as err:
            if _xla_state["ok"] or _xla_runs(parts[0].dtype):
                raise
            warnings.warn(
                f"tf_stable_moments: XLA unavailable ({err.__class__.__name__}); using plain ops",
                stacklevel=3,
            )
            _xla_state["ok"] = False
    exact_only = _exact_only()

    def plain(*p):
        return _kernel_outputs(_ops.PLAIN, p, axis, ddof, None, lo, exact_only)

    if not tf.executing_eagerly():
        # Grappler (constant folding, the arithmetic optimizer's AddN and
        # common-factor rewrites) would rewrite a plain graph of the kernel,
        # TwoSum included; run the same operations eagerly instead (a fallback:
        # needs the Python runtime).
        count = (2 if lo else 1) * len(parts) + 1
        out = tf.py_function(plain, parts, Tout=[parts[0].dtype] * (count) + [tf.int64])
        return tuple(tf.ensure_shape(o, [None]) for o in out[:-1]) + (out[-1],)
    return plain(*parts)


def _parts(x):
    """x's real parts in their target format: [x], or [real, imag] of a complex x."""
    work = _compute_dtype(x.dtype)
    parts = [tf.math.real(x), tf.math.imag(x)] if x.dtype.is_complex else [x]
    return [tf.cast(p, work) for p in parts]


def _native_op(x):
    """The native op where it serves this call on x: outside XLA, on the CPU
    (`_native.serves`: never for a device tensor), not under the exact-only switch."""
    if in_xla_context() or _exact_only() or not _native.serves(x):
        return None
    return _native.op()


def _native_input(x, axes, ddof, keepdims=False):
    """(y, attributes) of the native ops for x: y is x itself or x transposed (kept axes
    first), as float32 or float64, with a last dimension 2 for complex data.

    Contiguous reduced axes are the op's range [axis_begin, axis_end) of x itself: no
    reshape before or after (the op reads x as [outer, n, inner(, 2)], the layout of
    moments_core.native.layout).  Otherwise x is first transposed, kept axes first.
    float16/bfloat16 data are read as float32 (exact) and rounded to their own format
    by the op.
    """
    work = _compute_dtype(x.dtype)
    fmt = FORMATS[work.name]
    data = tf.float64 if work == tf.float64 else tf.float32
    ndim = x.shape.rank
    y = x
    contiguous = not axes or axes == tuple(range(axes[0], axes[-1] + 1))
    if contiguous:
        begin, end = (axes[0], axes[-1] + 1) if axes else (0, 0)
    else:
        kept = [a for a in range(ndim) if a not in axes]
        y = tf.transpose(x, kept + list(axes))
        begin, end = len(kept), ndim
    parts = 2 if x.dtype.is_complex else 1
    if parts == 2:
        y = tf.stack([tf.math.real(y), tf.math.imag(y)], -1)
    if y.dtype != data:
        y = tf.cast(y, data)
    attrs = dict(
        ddof=ddof,
        precision=fmt.precision,
        emin=fmt.emin,
        emax=fmt.emax,
        parts=parts,
        axis_begin=begin,
        axis_end=end,
    )
    return y, attrs, keepdims and contiguous


def _native_output(x, mean, work):
    """A mean-like output of the native ops as x's kind of number (complex, float16...)."""
    if x.dtype.is_complex:
        return tf.complex(mean[..., 0], mean[..., 1])
    return mean if mean.dtype == work else tf.cast(mean, work)


def _native_call(op, x, axes, ddof, keepdims=False):
    """(mean, var, undecided) from one native op call, shaped like the kept axes (keepdims:
    with the reduced axes as 1); see `_native_input`."""
    work = _compute_dtype(x.dtype)
    y, attrs, in_op = _native_input(x, axes, ddof, keepdims)
    mean, var, undecided = op(y, keepdims=in_op, **attrs)
    mean = _native_output(x, mean, work)
    if var.dtype != work:
        var = tf.cast(var, work)
    if keepdims and not in_op:
        shape = _out_shape(x, axes, True)
        mean, var = tf.reshape(mean, shape), tf.reshape(var, shape)
    return mean, var, undecided


def _native_stats(op, x, axes, ddof, lo):
    """(mean, mean_lo, var, undecided) from the native ops: StableMoments, and with lo
    StableMeanLo on the same input (a deterministic fixed-point sum: docs section 9)."""
    if not lo:
        mean, var, undecided = _native_call(op, x, axes, ddof)
        return mean, None, var, undecided
    work = _compute_dtype(x.dtype)
    y, attrs, _ = _native_input(x, axes, ddof)
    mean, var, undecided = op(y, **attrs)
    mean_lo = _native.mean_lo_op()(y, mean, var, **attrs)
    var = var if var.dtype == work else tf.cast(var, work)
    return _native_output(x, mean, work), _native_output(x, mean_lo, work), var, undecided


def native_centre(x, axes):
    """(r, var, mean_hi, mean_lo) of the layers' `_centre` (tf_stable_moments/_layer.py, no
    mask) as one native op, StableCentre, whose registered gradient is the layers'; or None
    where it does not serve (inside XLA, the native kernel off or missing, the exact-only
    switch, reduced axes that are not contiguous, a dtype other than float32 and float64).
    Its statistics are those of `stats`, and r = (x - mean_hi) - mean_lo as TensorFlow
    evaluates it: the same bits."""
    op = _native_op(x)
    contiguous = axes and tuple(axes) == tuple(range(axes[0], axes[-1] + 1))
    if op is None or not contiguous or x.dtype not in (tf.float32, tf.float64):
        return None
    fmt = FORMATS[x.dtype.name]
    return tuple(
        _native.centre_op()(
            x,
            precision=fmt.precision,
            emin=fmt.emin,
            emax=fmt.emax,
            axis_begin=axes[0],
            axis_end=axes[-1] + 1,
        )
    )


def _native_xla_stats(x, axes, ddof, lo):
    """(mean, mean_lo, var, undecided) from the native kernels as one custom call inside a
    user's XLA computation, or None where they cannot serve it (the library missing, an
    accelerator visible, the exact-only switch).  Kept axes unknown while tracing (the
    custom call's result shapes are fixed then) run it on chunks of static size in an
    XLA loop (`_native.xla_moments_chunked`).  The results are certified: the bits of
    every other implementation."""
    if _exact_only() or not _native.xla_available():
        return None
    work = _compute_dtype(x.dtype)
    y, attrs, _ = _native_input(x, axes, ddof)
    dims = y.shape.as_list()
    mean_shape = dims[: attrs["axis_begin"]] + dims[attrs["axis_end"] :]
    var_shape = mean_shape[:-1] if attrs["parts"] == 2 else mean_shape
    if None in mean_shape:
        out = _chunked_xla_stats(y, attrs, lo, dims)
        if out is None:
            return None
    else:
        out = _native.xla_moments(y, attrs, lo, mean_shape, var_shape)
    mean, var, undecided = out[0], out[1], out[-1]
    var = var if var.dtype == work else tf.cast(var, work)
    mean_lo = _native_output(x, out[2], work) if lo else None
    return _native_output(x, mean, work), mean_lo, var, undecided


def _chunked_xla_stats(y, attrs, lo, dims):
    """(mean, var, [mean_lo,] undecided) of the custom call on chunks of rows, for kept
    axes unknown while tracing (`_native.xla_moments_chunked`), shaped like the kept
    axes; None where the kept axes after the reduced ones are unknown.  The loop is one
    tf.function per variant, traced once per process, not once per layer and shape."""
    chunks = _native.chunk_rows(attrs, dims)
    if chunks is None:
        return None
    rows, inner = chunks
    begin, end, parts = attrs["axis_begin"], attrs["axis_end"], attrs["parts"]
    tail = [2] if parts == 2 else []
    shape = tf.shape(y)
    outer, n = tf.reduce_prod(shape[:begin]), tf.reduce_prod(shape[begin:end])
    y3 = tf.reshape(y, tf.concat([tf.stack([outer, n]), [inner], tail], 0))
    key = ("chunks", lo, rows, inner, parts, y.dtype, *sorted(attrs.items()))
    spec = [tf.TensorSpec([None, None, inner, *tail], y.dtype)]
    fn = _compiled(key, lambda v: _native.xla_moments_chunked(v, attrs, lo, rows), spec)
    out = fn(y3)
    kept = tf.concat([shape[:begin], shape[end:]], 0)
    var_kept = kept[:-1] if parts == 2 else kept
    return [tf.reshape(o, s) for o, s in zip(out[:-1], [kept, var_kept, kept])] + [out[-1]]


@tf.autograph.experimental.do_not_convert
def stats(x, axes, ddof, lo=True):
    """(mean, mean_lo, var) shaped like the kept axes; mean_lo is None unless lo.

    mean and var are correctly rounded; mean_lo is mean(x) - mean rounded from a
    deterministic fixed-point sum (the same bits in every mode; docs section 9).
    """
    op = _native_op(x)
    if op is not None:
        return _native_stats(op, x, axes, ddof, lo)[:3]
    if in_xla_context():
        out = _native_xla_stats(x, axes, ddof, lo)
        if out is not None:
            return out[:3]
    parts = _parts(x)
    laid = [_layout(p, axes) for p in parts]
    out = _slice_moments([p for p, _ in laid], laid[0][1], ddof, lo)
    k = len(parts)
    shape = _out_shape(x, axes, False)
    mean = out[0] if k == 1 else tf.complex(out[0], out[1])
    var = out[k]
    mean_lo = None
    if lo:
        mean_lo = out[k + 1] if k == 1 else tf.complex(out[k + 1], out[k + 2])
        mean_lo = _reshape(mean_lo, shape)
    return _reshape(mean, shape), mean_lo, _reshape(var, shape)


@tf.autograph.experimental.do_not_convert
def undecided_fraction(x, axes, ddof=0):
    """The fraction of slices of x that the fast path left to the exact path (diagnostics)."""
    x = tf.convert_to_tensor(x)
    axes = _canonical_axes(axes, x.shape.rank)
    op = _native_op(x)
    if op is not None:
        out = _native_stats(op, x, axes, _check_ddof(ddof), False)
    else:
        laid = [_layout(p, axes) for p in _parts(x)]
        out = _slice_moments([p for p, _ in laid], laid[0][1], _check_ddof(ddof))
    kept = int(np.prod([x.shape[a] for a in range(x.shape.rank) if a not in axes]))
    return float(out[-1]) / max(kept, 1)


def residuals(x, mean_hi, mean_lo, axes):
    """x - mean from the mean's two parts, differentiable as x - mean(x)."""
    # Zero in value (no overflow near the float maximum), mean(dx) in derivative.
    linear = tf.reduce_mean(x - tf.stop_gradient(x), axis=axes, keepdims=True)
    return ((x - tf.stop_gradient(mean_hi)) - tf.stop_gradient(mean_lo)) - linear


def _moments_real(x, axes, ddof):
    @tf.custom_gradient
    def fn(x):
        # The kernel is not differentiated (its gradient is analytic): no tape records it.
        mean, _, var = stats(tf.stop_gradient(x), axes, ddof, lo=False)

        def grad(g_mean, g_var):
            keep = _out_shape(x, axes, True)
            mh, ml, _ = stats(tf.stop_gradient(x), axes, ddof)
            n = tf.cast(_product([_dims(x)[a] for a in axes]), x.dtype)
            r = residuals(x, tf.reshape(mh, keep), tf.reshape(ml, keep), list(axes))
            # A slice with NaN or Inf gets a zero variance gradient (as in JAX): its
            # NaN residuals must not reach other slices (0 * NaN).
            finite = tf.math.is_finite(tf.reshape(var, keep))
            r = tf.where(finite, r, tf.zeros_like(r))
            g_mean, g_var = tf.reshape(g_mean, keep), tf.reshape(g_var, keep)
            return g_mean / n + g_var * (2 * r) / (n - ddof)

        return (mean, var), grad

    return fn(x)


def _eager_native(x, axes, keepdims, ddof):
    """moments in eager mode by one native op call, or None where the general path serves:
    a tape or forward accumulator that may record x (the analytic gradient), the native op
    unavailable, a rank unknown.  Same validation, same results (the op's are certified)."""
    if _record.could_possibly_record():
        return None
    x = tf.convert_to_tensor(x)
    op = _native_op(x)
    if op is None:
        return None
    _compute_dtype(x.dtype)
    if x.shape.rank is None:
        return None
    axes = _canonical_axes(axes, x.shape.rank)
    mean, var, _ = _native_call(op, x, axes, _check_ddof(ddof), keepdims)
    return mean, var


@tf.autograph.experimental.do_not_convert
def _keepdims(keepdims, keep_dims):
    """keepdims from the TF2 argument and the TF1 alias (tf.compat.v1.nn.moments)."""
    if keep_dims is None:
        return bool(keepdims)
    if keepdims is not None:
        raise ValueError(
            f"moments: cannot specify both keepdims and keep_dims (deprecated); "
            f"got keepdims={keepdims!r}, keep_dims={keep_dims!r}"
        )
    warnings.warn(
        "moments: keep_dims is deprecated, use keepdims instead", DeprecationWarning, stacklevel=3
    )
    return bool(keep_dims)


@tf.autograph.experimental.do_not_convert
def moments(x, axes, shift=None, keepdims=None, name=None, *, ddof=0, keep_dims=None):
    """One replica's (one device's) moments: the public `moments` without `synchronized`
    (tf_stable_moments/_union.py `moments`, whose docstring is the contract)."""
    del shift  # documented: ignored, as in tf.nn.moments
    keepdims = _keepdims(keepdims, keep_dims)
    if tf.executing_eagerly():  # one op call where nothing needs the gradient
        fast = _eager_native(x, axes, keepdims, ddof)
        if fast is not None:
            return fast
    with tf.name_scope(name or "moments"):
        x = tf.convert_to_tensor(x)
        _compute_dtype(x.dtype)
        if x.shape.rank is None:
            raise ValueError("moments: x must have a known rank; got a tensor of unknown rank")
        axes = _canonical_axes(axes, x.shape.rank)
        ddof = _check_ddof(ddof)
        if x.dtype.is_complex:  # not differentiable (as the native op's gradient says):
            # a recording tape must not trace the XLA kernel (it has no gradient to trace)
            mean, _, var = stats(tf.stop_gradient(x), axes, ddof, lo=False)
        else:
            mean, var = _moments_real(x, axes, ddof)
        shape = _out_shape(x, axes, keepdims)
        return _reshape(mean, shape), _reshape(var, shape)
