"""Warnings of StableBatchNormalization about numerics it cannot fix itself (once per layer).

1. check_autocast: Keras casts a layer's float32 inputs to a float16/bfloat16 compute
dtype (mixed precision policies) before the layer sees them.  For an input BN on
data N(1e6, 1) the bfloat16 values are all equal: the spread is gone before any
statistic is computed.  The check is on dtypes, so it runs in every mode (also at
trace time and when a functional model is built); the remedy is dtype="float32" on
that layer (a policy is saved with the model; `autocast=False` would not be).

2. check (stalls): a float32 moving mean that cannot follow the batch mean.

moving_mean = moving_mean * momentum + mean * (1 - momentum) leaves a float32
moving_mean unchanged when |mean - moving_mean| * (1 - momentum) is below half an ulp
of moving_mean (0.03125 at 1e6): with momentum 0.99 the moving mean then stops up to
ulp(moving_mean) / (2 * (1 - momentum)) away from the data mean (3.1 at 1e6) and
inference is off by as much.  The layer warns when that happens to a channel whose
batch mean is more than 0.1 standard deviations (sqrt(var + epsilon)) away, i.e.
when the stall shifts the normalized output by more than 0.1: without this second
condition data at offset 100 with unit spread would warn for harmless 1e-4 stalls.

Where the check runs: TensorFlow eager (on the values), tf.function graphs without
XLA (float32: the native op StableStallCheck, which calls back into Python the first
time a channel stalls; else, or without the native library, a tf.cond that calls
back into Python only when a channel stalls), JAX eager,
JAX jit (Keras fit on the JAX backend: float32, the FFI call stable_stall_check;
else a lax.cond whose taken branch is a jax.debug.callback), and TensorFlow XLA on
the CPU (jit_compile=True: float32, the same C++ check as an XLA custom call).  Not
in TensorFlow XLA without the native library or on an accelerator (jit_compile is
the Keras default on a GPU): such an XLA cluster cannot call back into Python.  In
compiled code (tf.function, JAX jit, XLA) the check is added only when the
computation runs on the CPU: on an accelerator its conditional would synchronize
device and host at every step; there the check runs in eager calls only.
"""

import itertools
import warnings
import weakref

import numpy as np

_WIDE = ("float32", "float64")
_NARROW = ("float16", "bfloat16")


def check_autocast(layer, inputs):
    """Warn (once per layer) if Keras is about to cast float32 inputs to a 16-bit dtype."""
    if getattr(layer, "_autocast_warned", False) or not layer.autocast:
        return
    dtype = getattr(inputs, "dtype", None)
    if dtype is None:
        return
    import keras

    source = keras.backend.standardize_dtype(dtype)
    target = keras.backend.standardize_dtype(layer.compute_dtype)
    if source not in _WIDE or target not in _NARROW:
        return
    layer._autocast_warned = True
    warnings.warn(
        f"StableBatchNormalization '{layer.name}': Keras casts its {source} inputs to "
        f"{target} before the layer sees them (the dtype policy "
        f"'{layer.dtype_policy.name}' autocasts inputs to the compute dtype), so the "
        f"statistics are those of the {target} values: data with a large offset relative "
        "to their spread lose the spread (N(1e6, 1) is constant in bfloat16, inf in "
        f"float16).  To normalize the {source} values, pass dtype='float32' to this layer "
        "(its output is then float32; the next layer casts it).",
        UserWarning,
        stacklevel=3,
    )


THRESHOLD = 0.1  # standard deviations of the normalized output


def _report(layer, moving_mean, mean, variance):
    """Warn (once per layer) if a channel stalls; numpy inputs."""
    if getattr(layer, "_stall_warned", False):
        return
    ulp = np.spacing(np.abs(moving_mean)).astype(np.float64)
    moving_mean, mean, variance = (np.asarray(a, np.float64) for a in (moving_mean, mean, variance))
    distance = np.abs(mean - moving_mean)
    std = np.sqrt(variance + layer.epsilon)
    stalled = (distance * (1 - layer.momentum) < ulp / 2) & (distance > THRESHOLD * std)
    if not np.any(stalled):
        return
    layer._stall_warned = True
    c = int(np.argmax(np.where(stalled, distance / std, -1)))
    warnings.warn(
        f"StableBatchNormalization '{layer.name}': the float32 moving mean cannot follow the "
        f"batch mean (channel {c}: moving mean {moving_mean[c]:.9g}, batch mean "
        f"{mean[c]:.9g}): an update of |batch mean - moving mean| * (1 - momentum) = "
        f"{distance[c] * (1 - layer.momentum):.3g} is below half an ulp of the moving mean "
        f"({ulp[c] / 2:.3g}) and is lost, so inference on that channel is off by "
        f"{distance[c] / std[c]:.2g} standard deviations.  Pass compensated_moving_stats=True "
        "to StableBatchNormalization to keep the moving mean to double precision "
        "(tf_stable_moments.stabilize(model, compensated_moving_stats=True) for a whole model).",
        UserWarning,
        stacklevel=2,
    )


_layers = {}  # token -> weak reference to the layer (the native check names it by token)
_tokens = itertools.count(1)


def _token(layer):
    """A number for `layer`, unique in the process, that the native op passes back."""
    token = getattr(layer, "_stall_token", None)
    if token is None:
        token = layer._stall_token = next(_tokens)
        _layers[token] = weakref.ref(layer)
    return token


def _native_report(token, moving_mean, mean, variance):
    """Called by the native checks (the TF op StableStallCheck, the JAX FFI call
    stable_stall_check), holding the GIL, when a channel of layer `token` stalls."""
    ref = _layers.get(token)
    layer = ref() if ref is not None else None
    if layer is not None and not getattr(layer, "_stall_warned", False):
        _report(layer, *(np.asarray(v, np.float32) for v in (moving_mean, mean, variance)))


def check(layer, moving_mean, mean, variance):
    """Called by the layer before each uncompensated moving-mean update; returns the
    moving mean to update (moving_mean itself: on the JAX backend the native check's
    output, which the update must use so that XLA keeps the check)."""
    if getattr(layer, "_stall_warned", False):
        return moving_mean
    import keras

    if keras.backend.backend() == "jax":
        return _check_jax(layer, moving_mean, mean, variance)
    return _check_tf(layer, moving_mean, mean, variance)


def _check_jax(layer, moving_mean, mean, variance):
    import jax
    import jax.numpy as jnp

    values = (moving_mean, mean, variance)
    if not any(isinstance(t, jax.core.Tracer) for t in values):
        _report(layer, *(np.asarray(t) for t in values))
        return moving_mean
    from jax_kernel import _native

    if moving_mean.dtype == jnp.float32 and _native.available():
        # One custom call on the CPU, none on a device (lowered per platform: a check on
        # the host would sync device and host at every step); a lax.cond around
        # jax.debug.callback cost a compiled training step about 0.5 ms per layer on a
        # 2-core CPU, taken or not.
        _native.set_stall_reporter(_native_report)
        return _native.stall_call(
            moving_mean, mean, variance, layer.momentum, layer.epsilon, THRESHOLD, _token(layer)
        )
    magnitude = jnp.abs(moving_mean)
    ulp = jnp.nextafter(magnitude, jnp.inf) - magnitude
    distance = jnp.abs(mean - moving_mean)
    std = jnp.sqrt(variance + layer.epsilon)
    stalled = (distance * (1 - layer.momentum) < ulp / 2) & (distance > THRESHOLD * std)

    def warn(*arrays):
        _report(layer, *(np.asarray(a) for a in arrays))

    def check():
        jax.lax.cond(jnp.any(stalled), lambda: jax.debug.callback(warn, *values), lambda: None)
        return moving_mean

    # The check on the CPU only, chosen per lowering platform as the native check is:
    # on a device a compiled cond around a host callback would sync device and host.
    return jax.lax.platform_dependent(cpu=check, default=lambda: moving_mean)


def _check_tf(layer, moving_mean, mean, variance):
    import tensorflow as tf

    if tf.executing_eagerly():
        _report(layer, *(t.numpy() for t in (moving_mean, mean, variance)))
        return moving_mean
    from tf_stable_moments import _moments, _native
    from tf_stable_moments._xla_context import in_xla_context

    float32 = moving_mean.dtype == tf.float32
    if in_xla_context():
        # XLA on the CPU: the native check as a custom call, which returns moving_mean (the
        # update uses that output, so XLA keeps the call); otherwise XLA cannot call back.
        if float32 and moving_mean.shape.is_fully_defined() and _native.xla_available():
            values = (tf.stop_gradient(t) for t in (moving_mean, mean, variance))
            args = (layer.momentum, layer.epsilon, THRESHOLD, _token(layer))
            return _native.xla_stall_check(*values, *args)
        return moving_mean
    if not _native.on_cpu(moving_mean):
        return moving_mean  # on a device the check would sync device and host at each step
    # Nothing here has a gradient: no tape records the check (a recorded cond would have
    # its branches rebuilt for the gradient: seconds of tracing in a deep model).
    checked = moving_mean
    moving_mean, mean, variance = (tf.stop_gradient(t) for t in (moving_mean, mean, variance))
    op = _native.stall_op()
    if op is not None and float32:
        op(
            moving_mean,
            mean,
            variance,
            momentum=layer.momentum,
            epsilon=layer.epsilon,
            threshold=THRESHOLD,
            token=_token(layer),
        )
        return checked
    # One function per dtype, traced once: a call site adds one call, not a tf.cond with
    # its two branch graphs (under cProfile about 18 ms of tracing a layer, 1 s of a
    # ResNet50's).
    shape = [None] * moving_mean.shape.rank
    spec = [tf.TensorSpec(shape, moving_mean.dtype)] * 3 + [
        tf.TensorSpec([], tf.float64),
        tf.TensorSpec([], tf.float64),
        tf.TensorSpec([], tf.int64),
    ]
    key = ("stall", moving_mean.dtype, len(shape))
    fn = _moments._compiled(key, _stall_check, spec, jit_compile=False)
    fn(moving_mean, mean, variance, 1 - layer.momentum, layer.epsilon, _token(layer))
    return checked


def _stall_check(moving_mean, mean, variance, rest, epsilon, token):
    """The check without the native op: a tf.cond that calls back into Python (`_report`
    for the layer of `token`) only when a channel stalls.  rest = 1 - momentum."""
    import tensorflow as tf

    dtype = moving_mean.dtype
    magnitude = tf.abs(moving_mean)
    ulp = tf.math.nextafter(magnitude, tf.constant(np.inf, dtype)) - magnitude
    distance = tf.abs(mean - moving_mean)
    std = tf.sqrt(variance + tf.cast(epsilon, dtype))
    stalled = (distance * tf.cast(rest, dtype) < ulp / 2) & (distance > THRESHOLD * std)

    def warn(token, *values):
        ref = _layers.get(int(token))
        layer = ref() if ref is not None else None
        if layer is not None:
            _report(layer, *(v.numpy() for v in values))
        return True

    return tf.cond(
        tf.reduce_any(stalled),
        lambda: tf.py_function(warn, [token, moving_mean, mean, variance], tf.bool),
        lambda: tf.constant(False),
    )
