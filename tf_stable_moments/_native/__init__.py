"""The native CPU kernel as a TensorFlow custom op ("StableMoments").

The op is moments_core/native/moments.h behind tf_stable_moments/_native/
stable_moments_op.cc, built by ``pip install .`` (setup.py), or at first use
into a per-user cache when the install could not build it.  If it cannot be
built or loaded, `op()` returns None after one warning and the XLA path serves
every call.  ``TF_STABLE_MOMENTS_NATIVE=0`` switches it off (no warning).
"""

import contextlib
import functools
import os
import sys
import threading
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.saved_model import save_context

from moments_core.native import build, enabled
from tf_stable_moments import _centre_grad, _output_grad

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBRARY = os.path.join(_HERE, "_stable_moments_op.so")
_lock = threading.Lock()
_state = {
    "tried": False,
    "op": None,
    "mean_lo": None,
    "stall": None,
    "centre": None,
    "scale_shift": None,
    "blend": None,
    "state": None,
    "state_moments": None,
}


def _load():
    path, err = _LIBRARY, None
    if not os.path.exists(path):
        path, err = build.cached_library(
            "tensorflow", tf.__version__, build.TF_SOURCE, os.path.basename(_LIBRARY)
        )
        if err:
            return None, err
    try:
        return tf.load_op_library(path), None
    except (tf.errors.OpError, OSError) as e:  # built for another TensorFlow, say
        return None, f"{path} does not load: {e}"


@contextlib.contextmanager
def switched_off():
    """TF_STABLE_MOMENTS_NATIVE=0 for the calls and traces inside: a graph traced in it
    under jit_compile holds the XLA kernel (what an accelerator runs), not the native one."""
    old = os.environ.get("TF_STABLE_MOMENTS_NATIVE")
    os.environ["TF_STABLE_MOMENTS_NATIVE"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TF_STABLE_MOMENTS_NATIVE"]
        else:
            os.environ["TF_STABLE_MOMENTS_NATIVE"] = old


_portable = threading.local()


@contextlib.contextmanager
def portable(enabled=True):
    """Whether functions traced in this block (in this thread) hold standard TensorFlow
    operations only, so that an artifact saved from them loads where this package is not
    installed.

    By default, functions traced while `tf.saved_model.save` saves (Keras `model.export`
    included: it traces its endpoints there) are portable and all others use the native
    ops.  Portable means: every call takes the XLA kernel written in plain TensorFlow
    operations instead of the native ops (`StableMoments`, `StableCentre`, ..., and the
    native custom calls under ``jit_compile``), the layers' float32 output formulas
    are plain functions (outside ``jit_compile``: a served artifact compiles nothing
    for them, for any batch size), and the layers skip the stall check.
    The statistics are certified, so they have the same bits either way.

    portable(): portable tracing in the block, e.g. for a function traced before it is
      saved (one traced earlier keeps what it holds: trace it anew in the block).
    portable(False): the native ops even while saving, for a SavedModel that will be
      loaded only where this package is installed (its native kernel serves it faster).
    portable("tflite"): for TensorFlow Lite, which has neither float64 builtins nor
      TensorFlow's XLA operations (and whose Python interpreter runs no Select TF op):
      the statistics and the layers' formulas in float32 operations that TFLite has as
      builtins (docs/algorithm.md section 15: shifted sums with a correction pass, not
      certified; about 1e-7 relative on N(1e6, 1) data where keras's layers lose
      every digit).  Export inside the block a SavedModel to convert; a converter that
      traces the model itself (`TFLiteConverter.from_keras_model(model).convert()`)
      gets this without a block.

    >>> import tensorflow as tf, tf_stable_moments as tsm
    >>> f = tf.function(lambda x: tsm.moments(x, [0]))
    >>> with tsm.portable():
    ...     graph = f.get_concrete_function(tf.TensorSpec([4, 3])).graph
    >>> any(op.type.startswith("Stable") for op in graph.get_operations())
    False
    """
    if not isinstance(enabled, bool) and enabled != "tflite":
        raise TypeError(f"portable: enabled must be a bool or 'tflite'; got {enabled!r}")
    stack = _portable.__dict__.setdefault("stack", [])
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


_LITE = os.path.join("tensorflow", "lite", "python", "lite.py")


def _converting_to_tflite():
    """Whether a TensorFlow Lite converter is tracing now (a frame of its `lite.py` on the
    stack: `TFLiteConverter.from_keras_model(...).convert()` traces the model itself).
    Graph building only: an eager call is never a conversion."""
    if tf.executing_eagerly():
        return False
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith(_LITE):
            return True
        frame = frame.f_back
    return False


def _mode():
    """The innermost `portable` block's argument; without one, "tflite" while a TFLite
    converter traces, else whether `tf.saved_model.save` is tracing."""
    stack = getattr(_portable, "stack", None)
    if stack:
        return stack[-1]
    if _converting_to_tflite():
        return "tflite"
    return save_context.in_save_context()


def portable_now():
    """Whether functions traced now must hold standard operations only (`_mode`)."""
    return bool(_mode())


def tflite_now():
    """Whether functions traced now are for TensorFlow Lite: a portable("tflite") block,
    or a TFLite converter tracing the model (`_mode`)."""
    return _mode() == "tflite"


def op():
    """The StableMoments op function, or None (disabled, or not available: warned once)."""
    if not enabled() or portable_now():
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            lib, err = _load()
            if lib is None:
                warnings.warn(
                    f"tf_stable_moments: the native kernel is not available ({err}); "
                    "using the XLA implementation (same results, slower first calls)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            else:
                _state["op"] = lib.stable_moments
                _state["mean_lo"] = lib.stable_mean_lo
                _state["stall"] = lib.stable_stall_check
                _state["centre"] = lib.stable_centre
                _state["scale_shift"] = lib.stable_scale_shift
                _state["blend"] = lib.stable_blend
                _state["state"] = lib.stable_state
                _state["state_moments"] = lib.stable_state_moments
        return _state["op"]


def mean_lo_op():
    """The StableMeanLo op function of the same library, or None (as `op`)."""
    return _state["mean_lo"] if op() is not None else None


def stall_op():
    """The StableStallCheck op function of the same library, or None (as `op`)."""
    return _state["stall"] if op() is not None else None


def centre_op():
    """The StableCentre op function of the same library, or None (as `op`)."""
    return _state["centre"] if op() is not None else None


def formula_op(name, x):
    """The StableScaleShift ("scale_shift"), StableBlend ("blend"), StableState ("state") or
    StableStateMoments ("state_moments") op function where it may compute on x (`serves`:
    the CPU, outside XLA), else None."""
    return _state[name] if serves(x) else None


# ------------------------------------------------------------- inside XLA (jit_compile)
# The library registers its kernels with TensorFlow's XLA as custom calls for the CPU
# (stable_moments_op.cc); TensorFlow's XlaCustomCallV2 op calls them from a user's XLA
# computation.  XLA then compiles nothing of the kernel (the pure-XLA kernel, which it
# compiled into every layer of a model, cost seconds per layer).
def _custom_call_op():
    try:
        from tensorflow.compiler.tf2xla.ops import gen_xla_ops
    except ImportError:  # pragma: no cover - a TensorFlow without the op
        return None
    return getattr(gen_xla_ops, "xla_custom_call_v2", None)


def _accelerator_visible():
    return bool(tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))


def _scope_device():
    """The innermost `tf.device` scope of the graph being built, "" where there is none
    (read from the graph's device stack: building an op to ask would add it to the graph)."""
    stack = getattr(tf.compat.v1.get_default_graph(), "_device_function_stack", None)
    if not stack:
        return ""
    return getattr(stack.peek_top_obj(), "display_name", "") or ""


@functools.lru_cache(maxsize=64)
def _device_type(device):
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() if device else ""


def on_cpu(x):
    """Whether computations on x run on the CPU: x on the CPU (eager), or a graph whose
    ops are placed there (x's own device or the current `tf.device` scope names the CPU,
    or names nothing while no accelerator is visible, so that the placer has only the
    CPU).  False for a GPU or TPU tensor or scope, and for no scope with an accelerator
    visible (the placer puts the model there)."""
    device = getattr(x, "device", "") or ""
    if not device and not tf.executing_eagerly():
        device = _scope_device()
    device = _device_type(device)
    if device:
        return device == "CPU"
    return not _accelerator_visible()


def serves(x):
    """Whether the native CPU ops may compute on x, outside XLA: the one place TensorFlow's
    kernel choice looks at devices.  The ops have CPU kernels only: TensorFlow would place
    them on the CPU whatever x's device, copying a GPU's activations to the host and back.
    So only for x `on_cpu`; elsewhere the XLA kernel runs, on the device of the data."""
    return op() is not None and on_cpu(x)


def xla_available():
    """Whether the native kernels serve a user's XLA computation being traced now: the
    library is loaded and no accelerator is visible (XLA would compile the computation
    for it, and the calls are registered for the CPU only)."""
    if op() is None or _custom_call_op() is None:
        return False
    return not _accelerator_visible()


def _config(y, attrs, *names_then_extra):
    """A custom call's backend_config: y's element size and rank, then `attrs[name]` for
    each name (str) and the other values as given, space-separated (what the C++ side
    parses, in that order)."""
    values = [y.dtype.size, y.shape.rank]
    values += [attrs[v] if isinstance(v, str) else v for v in names_then_extra]
    return " ".join(str(int(v)) for v in values)


_FORMAT = ("precision", "emin", "emax", "parts", "axis_begin", "axis_end")


def xla_moments(y, attrs, lo, mean_shape, var_shape):
    """(mean, var, [mean_lo,] undecided): StableMoments (and StableMeanLo) of `y` with
    `attrs` (those of the ops) as one custom call in the XLA computation being traced;
    the static result shapes are the caller's (keepdims false)."""
    config = _config(y, attrs, "ddof", *_FORMAT, int(lo))
    dtypes = [y.dtype, y.dtype] + ([y.dtype] if lo else []) + [tf.int64]
    shapes = [mean_shape, var_shape] + ([mean_shape] if lo else []) + [[]]
    return _custom_call_op()(
        operands=[y, tf.shape(y, out_type=tf.int64)],
        call_target_name="tf_stable_moments_moments",
        backend_config=config,
        has_side_effect=False,
        result_dtypes=dtypes,
        result_shapes=shapes,
    )


def xla_state(y, attrs, l1, l2, shape):
    """The moments state (StableState) of `y` with `attrs` (those of the op) as one custom
    call in the XLA computation being traced: int32 values of the static `shape`."""
    config = _config(y, attrs, *_FORMAT, l1, l2)
    return _custom_call_op()(
        operands=[y, tf.shape(y, out_type=tf.int64)],
        call_target_name="tf_stable_moments_state",
        backend_config=config,
        has_side_effect=False,
        result_dtypes=[tf.int32],
        result_shapes=[shape],
    )[0]


CHUNK_ELEMENTS = 2**16  # inputs per custom call when the kept length is unknown


def _int64(values):
    return tf.constant(values, tf.int64, shape=[len(values)])


def chunk_rows(attrs, dims):
    """(rows, inner) for `xla_moments_chunked` on y of static dims `dims` (None where
    unknown): inner, the product of the kept dimensions after the reduced range, and rows
    per chunk, a power of two for about CHUNK_ELEMENTS inputs (1024 per row where the
    reduced length is unknown); None where inner is unknown."""
    begin, end = attrs["axis_begin"], attrs["axis_end"]
    inner = dims[end : len(dims) - (attrs["parts"] == 2)]
    if None in inner:
        return None
    inner = int(np.prod(inner, dtype=np.int64))
    reduced = dims[begin:end]
    size = 2**10 if None in reduced else int(np.prod(reduced, dtype=np.int64))
    rows = max(1, CHUNK_ELEMENTS // max(size * inner, 1))
    return 1 << (rows.bit_length() - 1), inner


def xla_moments_chunked(y3, attrs, lo, rows):
    """`xla_moments` of y3 [outer, n, inner(, 2)] (inner static) whose kept length `outer`
    is unknown while tracing (a LayerNormalization's batch under Keras fit): the custom
    call's result shapes are fixed then, so it runs on chunks of `rows` rows in an XLA
    loop.  The rows are padded with zeros to a whole number of chunks (slices of zeros:
    decided, cut off) and each chunk's results are written in place.  Returns (mean,
    var, [mean_lo,] undecided) as [outer, inner] (mean and mean_lo [outer, inner, 2] for
    complex data).  Slice by slice the same kernel: the same bits."""
    from tensorflow.compiler.tf2xla.python import xla

    tail = y3.shape.as_list()[3:]
    inner = y3.shape[2]
    shape = tf.shape(y3, out_type=tf.int64)
    outer, n = shape[0], shape[1]
    padded = (outer + rows - 1) // rows * rows
    pads = tf.concat([[[0, padded - outer]], tf.zeros([2 + len(tail), 2], tf.int64)], 0)
    y3 = tf.pad(y3, pads)
    sizes = tf.concat([tf.stack([tf.constant(rows, tf.int64), n]), _int64([inner, *tail])], 0)
    chunk_attrs = dict(attrs, axis_begin=1, axis_end=2)
    shapes = [[rows, inner, *tail], [rows, inner]] + ([[rows, inner, *tail]] if lo else [])

    def at(start, rank):
        return tf.concat([[start], _int64([0] * (rank - 1))], 0)

    def body(i, undecided, *buffers):
        start = i * rows
        chunk = xla.dynamic_slice(y3, at(start, 3 + len(tail)), sizes)
        chunk = tf.reshape(chunk, [rows, -1, inner, *tail])  # n may be unknown while tracing
        res = xla_moments(chunk, chunk_attrs, lo, shapes[0], shapes[1])
        new = [
            xla.dynamic_update_slice(b, r, at(start, len(s)))
            for b, r, s in zip(buffers, res, shapes)
        ]
        return (i + 1, undecided + res[-1], *new)

    buffers = [tf.zeros(tf.concat([[padded], _int64(s[1:])], 0), y3.dtype) for s in shapes]
    zero = tf.constant(0, tf.int64)
    out = tf.while_loop(lambda i, *_: i < padded // rows, body, (zero, zero, *buffers))
    return (*(b[:outer] for b in out[2:]), out[1])


def xla_stall_check(moving_mean, mean, variance, momentum, epsilon, threshold, token):
    """StableStallCheck as a custom call in the XLA computation being traced (float32
    vectors of a static length): returns moving_mean, which the update must use so that
    XLA keeps the call."""
    config = f"{float(momentum)!r} {float(epsilon)!r} {float(threshold)!r} {int(token)}"
    size = tf.size(moving_mean, out_type=tf.int64)[None]
    (out,) = _custom_call_op()(
        operands=[moving_mean, mean, variance, size],
        call_target_name="tf_stable_moments_stall_check",
        backend_config=config,
        has_side_effect=False,
        result_dtypes=[tf.float32],
        result_shapes=[moving_mean.shape],
    )
    return out


def xla_rsqrt(v):
    """RN32(1 / sqrt(v)) of a float32 tensor of a static shape (`_affine.rsqrt32`, the same
    bits) as one custom call in the XLA computation being traced; no derivative."""
    flat = tf.reshape(v, [-1])
    size = tf.size(flat, out_type=tf.int64)[None]
    (out,) = _custom_call_op()(
        operands=[flat, size],
        call_target_name="tf_stable_moments_rsqrt",
        backend_config="",
        has_side_effect=False,
        result_dtypes=[tf.float32],
        result_shapes=[flat.shape],
    )
    return tf.reshape(out, v.shape)


tf.no_gradient("StableMeanLo")  # a rounding error: the layers give mean_lo no tangent


@tf.RegisterGradient("StableScaleShift")
def _stable_scale_shift_grad(op, dy):
    """The plain expression's gradient (`_output_grad.scale_shift_grad`),
    as the formula's own tf.custom_gradient gives it where the op does not serve: a
    registered gradient spares eager mode the custom_gradient wrapper around every call."""
    r, v, g, b = op.inputs
    g = g if op.get_attr("has_gamma") else None
    b = b if op.get_attr("has_beta") else None
    return _output_grad.scale_shift_grad(dy, r, v, g, b, op.get_attr("shared"))


@tf.RegisterGradient("StableCentre")
def _stable_centre_grad(op, r_bar, var_bar, mean_bar, _):
    """The layers' analytic gradient (tf_stable_moments/_centre_grad.py `_centre_vjp`, no
    mask), r made differentiable as x - mean(x) where a tape may differentiate it again."""
    x, r = op.inputs[0], op.outputs[0]
    axes = tuple(range(op.get_attr("axis_begin"), op.get_attr("axis_end")))
    # Graph gradients pass None for an output nothing depends on.
    r_bar = tf.zeros_like(r) if r_bar is None else r_bar
    var_bar = tf.zeros_like(op.outputs[1]) if var_bar is None else var_bar
    mean_bar = tf.zeros_like(op.outputs[2]) if mean_bar is None else mean_bar
    if record.could_possibly_record():
        r = _centre_grad._differentiable_residual(r, x, None, axes)
    return [_centre_grad._centre_vjp(x, None, axes, r, r_bar, var_bar, mean_bar)]


@tf.RegisterGradient("StableMoments")
def _stable_moments_grad(op, g_mean, g_var, _):
    """d mean/dx = 1/n, d var/dx = 2 (x - mean)/(n - ddof); none for complex data.

    (The public functions differentiate analytically themselves, with the exact
    two-part mean; this gradient serves direct uses of the op.)
    """
    if op.get_attr("parts") != 1:
        return [None]
    x = op.inputs[0]
    mean, var = op.outputs[0], op.outputs[1]
    begin, end = op.get_attr("axis_begin"), op.get_attr("axis_end")
    shape = tf.shape(x)
    keep = tf.concat([shape[:begin], tf.ones([end - begin], shape.dtype), shape[end:]], 0)
    n = tf.cast(tf.reduce_prod(shape[begin:end]), x.dtype)
    ddof = tf.cast(op.get_attr("ddof"), x.dtype)
    mean, var = tf.reshape(mean, keep), tf.reshape(var, keep)
    g_mean, g_var = tf.reshape(g_mean, keep), tf.reshape(g_var, keep)
    r = x - mean
    r = tf.where(tf.math.is_finite(var), r, tf.zeros_like(r))
    return [g_mean / n + g_var * (2 * r) / (n - ddof)]
