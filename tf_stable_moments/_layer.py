"""StableBatchNormalization: keras.layers.BatchNormalization on the exact moments kernel.

Why keras.layers.BatchNormalization breaks on offset data.  For data
x = mu + sigma * z in float32 it computes mean and var with ordinary float32
sums and then y = x * inv + (beta - mean * inv), inv = gamma / sqrt(var + eps).
Both x * inv and mean * inv are of size mu / sigma and each is rounded to
ulp(mu / sigma) / 2 = 2**-24 * mu / sigma: at mu / sigma = 1e6 every output
carries an absolute error of about 0.03, before counting the errors of mean
and var themselves (measured in tests/test_layer.py: > 1e-2 at 1e6, ~1 at 1e7).

What this layer does instead, in training mode:
  * (mean_hi, mean_lo, var) = kernel(x): mean_hi + mean_lo is the batch mean
    to double precision and var is the correctly rounded variance
    (tf_stable_moments on the TensorFlow backend, jax_kernel on the JAX
    backend; both give the same bits).
  * r = (x - mean_hi) - mean_lo.  x - mean_hi is exact whenever
    mean_hi / 2 <= x <= 2 * mean_hi (Sterbenz), the usual case for offset data,
    and otherwise has relative error 2**-24 of |x - mean_hi|; subtracting the
    small mean_lo adds one rounding of a number of size |r|.  So r is
    x - mean to about 2**-23 * |x - mean|: no error of size mu survives.
  * y = r * (gamma * (1 / sqrt(var + eps))) + beta, with every rounding fixed
    (docs/algorithm.md section 14): t = RN32(1 / sqrt(var + eps)) correctly
    rounded, f = RN32(gamma t), y = RN32(RN64(r f + beta)) (r f is exact in
    float64).  No compiler can change these bits: XLA's contraction into fused
    multiply-adds, TensorFlow's graph rewriting (1 / v into an approximate
    Reciprocal, a / sqrt into rsqrt), excess precision; so TF eager, tf.function,
    jit_compile, JAX eager and jit give the same outputs, and the same moving
    statistics (their averages are RN32(RN64(m momentum + b (1 - momentum)))).
    The per-channel factor has a relative error of at most 2 * 2**-24, so y is
    accurate to a few ulps of max(|y - beta|, |beta|).

Inference mode uses the same form with the moving statistics:
y = (x - moving_mean) * (gamma / sqrt(moving_variance + eps)) + beta, so an
accurate moving mean gives an accurate output.

Gradients.  The statistics are computed once per call and the gradient is
attached analytically (tf.custom_gradient / jax.custom_jvp) to the outputs
(r, var, mean) of one function of x.  With w the 0/1 selection weights
(all ones without a mask) and k = sum(w) per channel:
  d mean = sum(w dx) / k,  d r = dx - d mean,  d var = 2 sum(w r dx) / k,
  so x_bar = r_bar + (w / k) * (mean_bar - sum(r_bar) + 2 var_bar r).
No extra pass over x is made in the forward computation.  Higher orders are
right too: the TensorFlow gradient uses r made differentiable as x - mean
(r + t - sum(w t) / k with t = x - stop_gradient(x), which is 0), and the JAX
rule takes its primal outputs from the custom function itself.

Masks.  Keras normalises every element with the mean and variance of the
selected elements (mask true).  A kernel over a data-dependent subset is not
possible with static shapes, so the selected moments are recovered exactly
from two kernel passes over full slices of n elements, k of them selected:
  1. kernel(where(w, x, 0)) has mean S / n with S = sum of selected x, to
     double precision; c = fl(mean * n / k), its lowest significand bit
     cleared (`_shift_point`: no compiler may fuse the product into x - c), is
     within about 3 ulps of the selected mean.
  2. d = where(w, x - c, 0) (exact for offset data, by Sterbenz);
     kernel(d) gives mean_d = (k / n) u and var_d, with u = selected mean - c,
     tiny.  Then
       selected mean = c + u,  with u = mean_d * n / k  (two_sum gives hi, lo;
                                u's lowest bit cleared too),
       selected var  = (n / k) var_d - (1 - k / n) u**2.
     The subtracted term is of size ulp(mean)**2, so there is no cancellation
     unless the selected data are constant at the scale of ulp(mean)
     (clamped at 0).  A slice with nothing selected gets mean 0 and variance 0,
     as in Keras.
A masked call runs the kernel twice; an unmasked call once.

Moving statistics.  moving_mean = moving_mean * momentum + mean * (1 - momentum)
in float32 cannot represent a change smaller than ulp(moving_mean) / 2 (0.03125
at 1e6): with momentum 0.99 a batch mean that differs from the moving mean by
less than ~3 at 1e6 never moves it (measured in tests/test_layer.py).  The
keyword-only option compensated_moving_stats=True keeps the moving mean as an
unevaluated sum moving_mean + moving_mean_correction (Kahan-style):
  delta = ((mean_hi - moving_mean) + mean_lo) - correction
  (moving_mean, correction) = two_sum(moving_mean, correction + (1 - momentum) * delta)
which tracks the exact recursion to double precision, and inference subtracts
both parts.  The price is a fifth weight, "moving_mean_correction", appended
after the four standard weights: with the option on, set_weights needs five
arrays (a weight file of a standard BatchNormalization still loads: the
correction starts at 0).  The option is off by default, so that weights and weight
files stay those of keras.layers.BatchNormalization; measured cost of the default
(benchmarks/models.py offset: input BN on N(1e6, 1), momentum 0.99, 2048 steps): moving
mean 2.13 off and held-out accuracy 0.505, against 0.025 and 0.989 with the option on.
A layer whose moving mean stalls that way warns once (tf_stable_moments/_advice.py;
not inside TensorFlow XLA, which cannot call back into Python).
"""

import functools
import inspect
import math

import keras
from keras import ops

from moments_core._kernel import two_sum
from tf_stable_moments import _advice
from tf_stable_moments import _formulas as _formulas_module
from tf_stable_moments._centre_grad import (
    _centre_jvp,
    _centre_vjp,
    _counts,
    _differentiable_residual,
    _expand,
)

_BACKENDS = ("tensorflow", "jax")


def _shift_point(a, b):
    """fl(a * b) with its lowest significand bit cleared: c and u of the masked formulas.

    The masked formulas use one float32 c twice, in d = x - c (exact) and in
    two_sum(c, u), and u = mean_d * ratio in both parts of two_sum.  Inside one XLA
    fusion the CPU compiler contracts x - a * b (and u - bb, c + u) into fused
    multiply-adds (rounded once: not x - c), which made mean_lo, hence the output, wrong
    by up to ulp(mean) / 2 under jax.jit (seen with the mask computed in the traced
    function; an optimization barrier is expanded before fusion, and LLVM folds a
    float64 detour back into a float32 product).  Clearing a bit of the encoding (at
    most 1 ulp: c is any value near the selected mean, and u's change is 2**-24 of u,
    itself of the size of ulp(mean)) puts an integer operation between the product and
    its users, which no compiler contracts.  The same on both backends and every mode.
    """
    c = a * b
    integer = "int64" if c.dtype == "float64" else "int32"  # float32 or float64 statistics
    if keras.backend.backend() == "jax":
        from jax import lax

        bits = lax.bitcast_convert_type(c, integer)
        return lax.bitcast_convert_type(bits & -2, c.dtype)
    import tensorflow as tf

    bits = tf.bitcast(c, integer)
    return tf.bitcast(tf.bitwise.bitwise_and(bits, tf.constant(-2, integer)), c.dtype)


def _formulas():
    """The output formulas (docs section 14) of the active Keras backend."""
    return _formulas_module.formulas(keras.backend.backend())


def _masked_variance(n, k, ratio, var_d, u):
    """max(ratio var_d - ((n - k) / n) u**2, 0), ratio = n / k: both quotients correctly
    rounded and the difference RN32(RN64(...)) of two products exact in float64
    (docs section 14), so that no compiler changes its bits."""
    formulas = _formulas()
    weight = formulas.div(n - k, n)
    return ops.maximum(formulas.blend(ratio, var_d, -weight, u * u), 0)


def _centre(stats, x, w, axes):
    """(r, var, mean_hi, mean_lo): r = x - mean over all elements, moments of the selected.

    `stats` is the kernel of the backend; w is None (all selected) or a boolean
    tensor shaped like x.  See the module docstring for the masked formulas.
    """
    if w is None:
        mean_hi, mean_lo, var = stats(x, axes, 0)
    else:
        n, k = _counts(x, w, axes)
        ratio = _formulas().div(n, k)
        zero = ops.zeros_like(x)
        sum_over_n, _, _ = stats(ops.where(w, x, zero), axes, 0)
        c = _shift_point(sum_over_n, ratio)
        mean_d, _, var_d = stats(ops.where(w, x - _expand(c, axes), zero), axes, 0)
        u = _shift_point(mean_d, ratio)
        var = _masked_variance(n, k, ratio, var_d, u)
        mean_hi, mean_lo = two_sum(c, u)
    r = (x - _expand(mean_hi, axes)) - _expand(mean_lo, axes)
    return r, var, mean_hi, mean_lo


def _synchronized_centre(context, x, w, axes):
    """`_centre` over the global batch of all replicas; r of this replica's part.

    Each replica computes the exact moments state of its part
    (tf_stable_moments.moments_state: int32 digits of exact sums, O(channels));
    one all-reduce SUM merges them exactly in any order, and every replica
    rounds the merged state: the statistics of the global batch, bit-identical
    to one device holding it.  mean_lo (docs section 9) is the deterministic
    fixed-point sum of the kernel, all-reduced in float64 (its terms are integers
    whose sums stay below 2**53: exact in any order).  Collectives per call, every
    replica issuing the same ones with the same shapes in the same order:
    forward, unmasked: the state, then the mean_lo sums; masked: two states (the
    selected counts ride in the first); backward: one of [3, channels].

    Gradient: with g = all-reduce SUM of (mean_bar - sum(r_bar), var_bar) over the
    replicas, x_bar = r_bar + (w / k) * (g_0 + 2 g_1 r), k the global count; r is
    made differentiable as x - (global mean) as in the single-device rule (its sum
    of w t rides in the same all-reduce), so higher orders are right too.  This
    is the x_bar of the global batch; only the order of the float32 sums differs
    (sum(r_bar) per replica, then across replicas; mean_bar and var_bar, one per
    replica's loss, summed across replicas).
    """
    import tensorflow as tf

    from tf_stable_moments import _union

    all_sum, replica = _union.collectives(context)

    @tf.custom_gradient
    def fn(x):
        def global_stats(v, lo, extra):
            return _union.global_stats(all_sum, v, axes, lo, extra, replica)

        r, var, mean_hi, mean_lo, k = _global_centre(global_stats, tf.stop_gradient(x), w, axes)

        def grad(r_bar, var_bar, mean_bar, _):
            # t = x - stop_gradient(x) = 0 makes r differentiable as x - (global mean) for
            # higher orders (as in the single-device rule); sum(w t) rides in the same
            # all-reduce, whose own gradient is an all-reduce SUM.
            t = x - tf.stop_gradient(x)
            w_t = t if w is None else tf.where(w, t, tf.zeros_like(t))
            local = [mean_bar - tf.reduce_sum(r_bar, axis=axes), var_bar]
            g = all_sum(tf.stack(local + [tf.reduce_sum(w_t, axis=axes)]))
            r_d = tf.stop_gradient(r) + (t - _expand(g[2] / k, axes))
            x_bar = _expand(g[0] / k, axes) + _expand(2 * g[1] / k, axes) * r_d
            if w is not None:
                x_bar = tf.where(w, x_bar, tf.zeros_like(x_bar))
            return r_bar + x_bar

        return (r, var, mean_hi, mean_lo), grad

    return fn(x)


def _jax_global_stats(axis_name, devices, v, axes, lo, extra=None, rows=None, batch=None):
    """`tf_stable_moments._union.global_stats` on the JAX backend, inside `jax.shard_map`
    over `axis_name`: the certified merge of every device's fast sums
    (`jax_kernel._union.union_moments`, pure XLA: no FFI call; exact states for the slices
    it leaves open), `extra` (a per-slice count) psum-ed, and with lo mean_lo's float64
    fixed-point sums (`union_stats`: in the psum that tells whether a slice is open).
    rows: None, or which of this device's rows are the batch's (a batch padded to a
    multiple of the devices: the padding is left out of every sum, as a selection), batch
    the global batch's length."""
    import jax
    import numpy as np

    from jax_kernel import _union as jax_union

    valid = None
    if rows is not None:
        shape = [1] * v.ndim
        shape[0] = v.shape[0]
        valid = jax.numpy.broadcast_to(rows.reshape(shape), v.shape)
    summed = None if extra is None else jax.lax.psum(extra.astype(np.int32), axis_name)
    # The global count is static (even shards, or the batch's length where padded; `where`
    # selects by zeros, not by counting): a Python int, as `_counts` and `mean_lo` use on
    # one device, so that XLA folds the same constants (it turns a division by a constant n
    # into a product with 1 / n: a traced n would give other bits).
    n = math.prod(v.shape[a] for a in axes) * devices
    if rows is not None:
        n = math.prod(v.shape[a] for a in axes if a != 0) * batch
    if lo:  # docs section 13b; mean_lo's sums in the collective that opens the exact round
        mean, mean_lo, var = jax_union.union_stats(v, valid, axes, axis_name, n=n)
    else:
        mean, var = jax_union.union_moments(v, valid, axes, axis_name)
        mean_lo = None
    return mean, mean_lo, var, n, summed


def _jax_mesh_axis(x, axes):
    """(mesh, batch axis name, batch) when the layer should synchronize on the JAX backend:
    a keras.distribution with more than one device along its batch dimension, which the
    layer reduces, and a batch of known length (one that the devices do not divide is
    padded to a multiple: jax.shard_map needs even shards); else None (the single-device
    path: the same bits, without the O(channels) collectives)."""
    distribution = keras.distribution.distribution()
    if distribution is None or 0 not in axes:
        return None
    name = distribution.batch_dim_name
    mesh = distribution.device_mesh.backend_mesh
    size = mesh.shape.get(name, 1) if name is not None else 1
    batch = x.shape[0]
    if size <= 1 or batch is None:
        return None
    return mesh, name, batch


@functools.lru_cache(maxsize=64)
def _jax_synchronized_centre(mesh, axis_name, batch, axes, masked):
    """The differentiable `_centre` of the global batch on the JAX backend.

    Forward: `jax.shard_map` over the batch axis of the mesh, the certified merge of the
    devices' fast sums (`_jax_global_stats`; exact states for the slices it leaves open):
    O(channels) communication, the bits of one device holding the batch.  (The native
    kernel is an FFI custom call: on a sharded input XLA would gather the batch to run
    it.)  A batch the devices do not divide is padded with zero rows to a multiple of
    them, which every device leaves out of its sums (a selection: `_jax_global_stats`'s
    rows; the global count stays the batch's), and the output cut back to the batch.
    Tangents: the single-device rule (`_centre_jvp`) on the global arrays; XLA
    partitions its batch sums into
    per-device sums and an all-reduce of [channels] float32, so gradients equal the
    single device's to float32 rounding (the sums run in another order).
    """
    import jax
    from jax.sharding import PartitionSpec

    devices = mesh.shape[axis_name]
    pad = -batch % devices
    spec, replicated = PartitionSpec(axis_name), PartitionSpec()

    def body(x, w, rows):  # rows: None unless the batch is padded
        def global_stats(v, lo, extra):
            return _jax_global_stats(axis_name, devices, v, axes, lo, extra, rows, batch)

        return _global_centre(global_stats, x, w, axes)[:4]

    sharded = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, spec if masked else None, spec if pad else None),
            out_specs=(spec, replicated, replicated, replicated),
            check_vma=False,
        )
    )

    @jax.custom_jvp
    def centre(x, w):
        if not pad:
            return sharded(x, w, None)
        widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
        rows = jax.numpy.arange(batch + pad) < batch
        w = None if w is None else jax.numpy.pad(w, widths)
        r, *stats = sharded(jax.numpy.pad(x, widths), w, rows)
        return (r[:batch], *stats)

    @centre.defjvp
    def centre_jvp(primals, tangents):
        x, w = primals
        out = centre(x, w)
        return out, _centre_jvp(x, w, axes, out[0], tangents[0])

    return centre


def _global_centre(global_stats, x, w, axes):
    """(r, var, mean_hi, mean_lo, k): `_centre` with the moments and counts of the global
    batch (the masked formulas of the module docstring, n and k global).

    global_stats(v, lo, extra) -> (mean, mean_lo or None, var, n, extra summed): the
    statistics of the global batch of v, from the all-reduced states (`_union.global_stats`,
    `_jax_global_stats`).  Written in keras ops: the same formulas on both backends.
    """
    if w is None:
        mean_hi, mean_lo, var, n, _ = global_stats(x, True, None)
        k = ops.cast(n, x.dtype)
    else:
        zero = ops.zeros_like(x)
        selected = ops.sum(ops.cast(w, "int32"), axis=axes)
        sum_over_n, _, _, n, k = global_stats(ops.where(w, x, zero), False, selected)
        n, k = ops.cast(n, x.dtype), ops.maximum(ops.cast(k, x.dtype), 1)
        ratio = _formulas().div(n, k)
        c = _shift_point(sum_over_n, ratio)
        mean_d, _, var_d, _, _ = global_stats(ops.where(w, x - _expand(c, axes), zero), False, None)
        u = _shift_point(mean_d, ratio)
        var = _masked_variance(n, k, ratio, var_d, u)
        mean_hi, mean_lo = two_sum(c, u)
    r = (x - _expand(mean_hi, axes)) - _expand(mean_lo, axes)
    return r, var, mean_hi, mean_lo, k


def _gathered_centre(centre, context, x, w, axes):
    """The former synchronized path (kept for benchmarks/sync.py): all_gather the batch.

    Every replica computes `centre` on the gathered global batch (the same bits as the
    state all-reduce) and keeps r of its own rows; communication O(batch).
    """
    import tensorflow as tf

    a = axes[0]
    size = tf.shape(x)[a : a + 1]
    start = tf.reduce_sum(context.all_gather(size, axis=0)[: context.replica_id_in_sync_group])
    gathered_w = None if w is None else tf.cast(context.all_gather(tf.cast(w, tf.int32), a), bool)
    r, var, mean_hi, mean_lo = centre(context.all_gather(x, axis=a), gathered_w, axes)
    return tf.gather(r, tf.range(start, start + size[0]), axis=a), var, mean_hi, mean_lo


@functools.cache
def _backend_centre(name):
    """The differentiable `_centre` of a Keras backend, on that backend's kernel."""
    if name == "tensorflow":
        import tensorflow as tf
        from tensorflow.python.eager import record as _record

        from tf_stable_moments import _moments

        def centre(x, w, axes):
            # Eager and graphs outside XLA: one native op with the gradient registered.
            out = _moments.native_centre(x, axes) if w is None else None
            if out is not None:
                return out

            @tf.custom_gradient
            def fn(x):
                # stop_gradient: tapes must not record the kernel (they would trace its gradient).
                out = _centre(_moments.stats, tf.stop_gradient(x), w, axes)

                def grad(r_bar, var_bar, mean_bar, _):
                    r = out[0]
                    if _record.could_possibly_record():  # a tape may differentiate this
                        r = _differentiable_residual(r, x, w, axes)
                    return _centre_vjp(x, w, axes, r, r_bar, var_bar, mean_bar)

                return out, grad

            return fn(x)

        return centre

    return _jax_centre()


@functools.cache
def _jax_centre():
    """The JAX backend's differentiable `_centre`, one jitted function for the process:
    the layers of a model that share a shape share its trace and that of its derivative
    (under a training step's linearize each of its operations costs Python time, per
    layer and per trace)."""
    import jax

    from jax_kernel import _moments

    stats = jax.jit(_moments.stats, static_argnums=(1, 2))

    @functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
    def centre(x, w, axes):
        return _centre(stats, x, w, axes)

    @centre.defjvp
    def centre_jvp(axes, primals, tangents):
        x, w = primals
        out = centre(x, w, axes)
        return out, _centre_jvp(x, w, axes, out[0], tangents[0])

    return jax.jit(centre, static_argnums=(2,))


def _check_backend():
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            "StableBatchNormalization runs on the 'tensorflow' and 'jax' Keras backends "
            f"(the backends of the moments kernel); the active Keras backend is '{name}'."
        )
    return name


@keras.saving.register_keras_serializable(package="tf_stable_moments")
class StableBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization with exact batch statistics: accurate on offset data.

    A drop-in replacement: the same arguments, defaults, weights (gamma, beta,
    moving_mean, moving_variance: names, shapes and order), masks, renorm,
    trainable=False behaviour, mixed precision (statistics in float32, output
    in the compute dtype) and configuration as keras.layers.BatchNormalization,
    on the TensorFlow and JAX Keras backends (other backends raise
    NotImplementedError).  What differs is the arithmetic, described in the
    module docstring: the batch mean and variance come from the correctly
    rounded moments kernel, and the input is centred with the mean's two
    parts before scaling, so the output stays accurate to a few float32 ulps
    of its own size for any offset (keras's own layer has an absolute error of
    about 2**-24 * |mean| / std).

    Migration:

        import tf_stable_moments  # also registers the class for keras.models.load_model
        bn = tf_stable_moments.StableBatchNormalization(momentum=0.9)  # same arguments as before
        bn.set_weights(old_bn.get_weights())  # optional: keras BatchNormalization weights, 1:1
        model.load_weights("old.weights.h5")  # weight files of the old model load as they are

    Args:
        *args, **kwargs: those of keras.layers.BatchNormalization.
        compensated_moving_stats: keyword only, default False.  Keep the moving
            mean as moving_mean + moving_mean_correction so that updates below
            ulp(moving_mean) / 2 are not lost (see the module docstring).  Adds
            a fifth non-trainable weight, "moving_mean_correction", after the
            standard four; not available with renorm=True.  Off by default (keras's
            weights); a UserWarning says when the moving mean cannot move.

    With synchronized=True under a tf.distribute strategy with several
    replicas (TensorFlow backend, as in keras), every replica computes the
    exact moments state of its part (tf_stable_moments.moments_state) and the
    states are all-reduced (O(channels) per step, not O(batch); docs section
    13): every replica gets the statistics of the global batch, the same bits
    as one device holding the whole batch, and the input gradient of the
    global batch (to float32 rounding: its sums run per replica, then across).
    On the JAX backend (where keras refuses synchronized=True) the same holds
    under a keras.distribution with several devices on its batch axis
    (DataParallel): the statistics run in jax.shard_map over that axis, with a
    psum of the states (`_jax_synchronized_centre`).

    Raises:
        NotImplementedError: on a Keras backend other than TensorFlow or JAX.
        ValueError: the errors of keras.layers.BatchNormalization, and
            compensated_moving_stats that is not a bool or is combined with
            renorm=True.
    """

    def __init__(self, *args, compensated_moving_stats=False, **kwargs):
        backend = _check_backend()
        synchronized = None
        if backend == "jax":  # keras refuses synchronized=True off TensorFlow; this layer not
            bound = inspect.signature(keras.layers.BatchNormalization.__init__).bind(
                self, *args, **kwargs
            )
            synchronized = bound.arguments.get("synchronized", False)
            bound.arguments["synchronized"] = False
            args, kwargs = bound.args[1:], bound.kwargs
        super().__init__(*args, **kwargs)
        if synchronized is not None:
            self.synchronized = synchronized
        if not isinstance(compensated_moving_stats, bool):
            raise ValueError(
                "compensated_moving_stats must be a bool; "
                f"received: compensated_moving_stats={compensated_moving_stats!r}"
            )
        if compensated_moving_stats and self.renorm:
            raise ValueError(
                "compensated_moving_stats=True is not supported with renorm=True: "
                "renorm keeps its own moving statistics"
            )
        self.compensated_moving_stats = compensated_moving_stats
        self.moving_mean_correction = None

    def build(self, input_shape):
        super().build(input_shape)
        if self.compensated_moving_stats:
            self.moving_mean_correction = self.add_weight(
                shape=(input_shape[self.axis],),
                name="moving_mean_correction",
                initializer="zeros",
                trainable=False,
                autocast=False,
            )

    def __call__(self, *args, **kwargs):
        if args:  # before Keras autocasts the inputs: warn if it will make them 16-bit
            _advice.check_autocast(self, args[0])
        return super().__call__(*args, **kwargs)

    def call(self, inputs, training=None, mask=None):
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the inputs. "
                f"Received: mask.shape={mask.shape}, inputs.shape={inputs.shape}"
            )
        # Statistics in float32 at least (float16/bfloat16 inputs are upcast), float64 kept.
        compute_dtype = _formulas_module.compute_dtype(inputs.dtype)
        inputs = ops.cast(inputs, compute_dtype)
        axes = tuple(self._reduction_axes)
        gamma = ops.cast(self.gamma, compute_dtype) if self.scale else None
        beta = ops.cast(self.beta, compute_dtype) if self.center else None

        if training and self.trainable:
            residual, variance, mean_hi, mean_lo = self._batch_statistics(inputs, mask)
            if self.renorm:
                r, d, _, _ = self._renorm_correction_and_moments(mean_hi, variance)
                gamma, beta = self._compose_transforms(r, d, gamma, beta, compute_dtype)
                self._update_renorm_statistics(mean_hi, variance)
            else:
                self._update_moving_statistics(mean_hi, mean_lo, variance)
        else:
            residual = inputs - _expand(ops.cast(self.moving_mean, compute_dtype), axes)
            if self.compensated_moving_stats:
                correction = ops.cast(self.moving_mean_correction, compute_dtype)
                residual = residual - _expand(correction, axes)
            variance = ops.cast(self.moving_variance, compute_dtype)

        # docs section 14: every rounding fixed, whatever the compiler makes of the code
        def expand(v):
            return None if v is None else _expand(v, axes)

        outputs = _formulas().scale_shift(
            residual, expand(variance + self.epsilon), expand(gamma), expand(beta), shared=True
        )
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "compensated_moving_stats": self.compensated_moving_stats}

    def load_own_variables(self, store):
        """Keras's loader; with compensated_moving_stats=True it also reads the entry of a
        standard BatchNormalization (no correction weight) and starts the correction at 0."""
        if self.compensated_moving_stats:
            standard = [
                variable
                for variable in self._trainable_variables + self._non_trainable_variables
                if variable is not self.moving_mean_correction
            ]
            if len(store.keys()) == len(standard):
                for i, variable in enumerate(standard):
                    variable.assign(store[f"{i}"])
                self.moving_mean_correction.assign(ops.zeros_like(self.moving_mean_correction))
                return
        super().load_own_variables(store)

    def _batch_statistics(self, inputs, mask):
        """(residual, variance, mean_hi, mean_lo) of the batch, differentiable in inputs."""
        backend = _check_backend()
        weights = None
        if mask is not None:
            weights = ops.expand_dims(mask, axis=-1)
            weights = ops.cast(ops.broadcast_to(weights, ops.shape(inputs)), "bool")
        centre = _backend_centre(backend)
        axes = tuple(self._reduction_axes)
        if self.synchronized and backend == "tensorflow":
            import tensorflow as tf

            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                if getattr(self, "_sync_all_gather", False):  # private: benchmarks/sync.py
                    return _gathered_centre(centre, context, inputs, weights, axes)
                return _synchronized_centre(context, inputs, weights, axes)
        if self.synchronized and backend == "jax":
            sync = _jax_mesh_axis(inputs, axes)
            if sync is not None:
                centre = _jax_synchronized_centre(*sync, axes, weights is not None)
                return centre(inputs, weights)
        return centre(inputs, weights, axes)

    def _update_moving_statistics(self, mean_hi, mean_lo, variance):
        moving_mean = ops.cast(self.moving_mean, mean_hi.dtype)
        moving_variance = ops.cast(self.moving_variance, variance.dtype)
        # keras's moving averages, each RN32(RN64(a m + b (1 - m))): docs section 14
        blend = _formulas().blend
        momentum, rest = self.momentum, 1.0 - self.momentum
        if not self.compensated_moving_stats:
            # Warns once if it cannot move; returns moving_mean (on JAX through the check).
            moving_mean = _advice.check(self, moving_mean, mean_hi, variance)
            # Two calls (in TF eager mode two native ops: stacking the averages into one
            # call and slicing them apart again took longer than the second call).
            self.moving_variance.assign(blend(moving_variance, momentum, variance, rest))
            self.moving_mean.assign(blend(moving_mean, momentum, mean_hi, rest))
            return
        self.moving_variance.assign(blend(moving_variance, momentum, variance, rest))
        correction = ops.cast(self.moving_mean_correction, mean_hi.dtype)
        delta = ((mean_hi - moving_mean) + mean_lo) - correction
        moving_mean, correction = two_sum(moving_mean, blend(delta, rest, correction, 1.0))
        self.moving_mean.assign(moving_mean)
        self.moving_mean_correction.assign(correction)

    # Batch renormalization: keras's formulas with every rounding fixed (docs section 14).
    def _renorm_correction_and_moments(self, mean, variance):
        formulas = _formulas()
        stddev = ops.sqrt(variance + self.epsilon)
        renorm_mean = ops.cast(self.renorm_mean, mean.dtype)
        renorm_stddev = ops.maximum(
            ops.cast(self.renorm_stddev, mean.dtype), ops.sqrt(ops.cast(self.epsilon, mean.dtype))
        )
        r = formulas.div(stddev, renorm_stddev)
        d = formulas.div(mean - renorm_mean, renorm_stddev)
        clipping = self.renorm_clipping
        if clipping.get("rmin") is not None:
            r = ops.maximum(r, clipping["rmin"])
        if clipping.get("rmax") is not None:
            r = ops.minimum(r, clipping["rmax"])
        if clipping.get("dmax") is not None:
            d = ops.clip(d, -clipping["dmax"], clipping["dmax"])
        return r, d, mean, variance

    def _compose_transforms(self, r, d, gamma, beta, dtype):
        formulas = _formulas()
        r, d = ops.cast(ops.stop_gradient(r), dtype), ops.cast(ops.stop_gradient(d), dtype)
        if gamma is None:
            return r, d if beta is None else d + beta
        return formulas.times(r, gamma), formulas.affine(d, gamma, beta)

    def _update_renorm_statistics(self, mean, variance):
        blend = _formulas().blend
        stddev = ops.sqrt(variance + self.epsilon)
        renorm, rest = self.renorm_momentum, 1.0 - self.renorm_momentum
        renorm_mean = ops.cast(self.renorm_mean, mean.dtype)
        renorm_stddev = ops.cast(self.renorm_stddev, mean.dtype)
        self.renorm_mean.assign(blend(renorm_mean, renorm, mean, rest))
        self.renorm_stddev.assign(blend(renorm_stddev, renorm, stddev, rest))
        momentum, rest = self.momentum, 1.0 - self.momentum
        moving_mean = ops.cast(self.moving_mean, mean.dtype)
        moving_stddev = ops.cast(self.moving_stddev, mean.dtype)
        self.moving_mean.assign(blend(moving_mean, momentum, mean, rest))
        new_moving_stddev = blend(moving_stddev, momentum, stddev, rest)
        self.moving_stddev.assign(new_moving_stddev)
        square = blend(new_moving_stddev, new_moving_stddev, ops.ones_like(stddev), -self.epsilon)
        self.moving_variance.assign(ops.relu(square))

    def __repr__(self):
        return f"<tf_stable_moments.StableBatchNormalization name={self.name}, built={self.built}>"


# Keras 3 weight files (.weights.h5 and the weights inside .keras) address each layer of
# a model by its snake-cased class __name__ and a running count ("batch_normalization",
# "batch_normalization_1", ...), not by its position or its layer name.  Under its own
# name this class would be "stable_batch_normalization" there, and a file written by a
# model with keras.layers.BatchNormalization would not load into the same model with
# this class (nor the other way round).  The class therefore carries keras's __name__:
# weight files load in both directions, also when only some layers are replaced, and
# default layer names are keras's.  It is still registered, and deserialised, as
# "tf_stable_moments>StableBatchNormalization" (registration above read the original
# name); __qualname__ is kept so that tracebacks and pickling find the class; __repr__
# says which class it is.  model.summary() shows the type as "BatchNormalization".
StableBatchNormalization.__name__ = "BatchNormalization"
# The config's "module" is cls.__module__: the import that loading needs.  Keras cannot
# name the missing class otherwise: a .keras file loaded without `import tf_stable_moments`
# fails with "Could not locate class 'BatchNormalization'" (keras's message, built from
# __name__), followed by a config with 'module': 'tf_stable_moments' and
# 'registered_name': 'tf_stable_moments>StableBatchNormalization'.
StableBatchNormalization.__module__ = "tf_stable_moments"
