"""The public API: drop-in shapes and dtypes, the dtype policy, bad input, special values."""

import glob
import math
import os
import re
import subprocess
import sys
import warnings

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from modes import MODES, XLA_MODES, bits, run

import jax_kernel
import tf_stable_moments
from tf_stable_moments import _moments as tf_moments

SHAPE_CASES = [
    ((6,), [0], False),
    ((6,), [0], True),
    ((4, 5), [0], False),
    ((4, 5), [1], True),
    ((4, 5), [0, 1], False),
    ((2, 3, 4, 5), [0, 1, 2], False),
    ((2, 3, 4, 5), [0, 1, 2], True),
    ((2, 3, 4, 5), [1, 3], True),
    ((2, 3, 4), [-1], False),
    ((2, 3, 4), [], False),
]


@pytest.mark.parametrize("shape,axes,keepdims", SHAPE_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_output_shapes_and_dtypes_match_tf_nn_moments(shape, axes, keepdims):
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    ref = tf.nn.moments(tf.constant(x), axes, keepdims=keepdims)
    got = tf_stable_moments.moments(tf.constant(x), axes, keepdims=keepdims)
    got_jax = jax_kernel.moments(x, tuple(axes), keepdims=keepdims)
    for g, gj, r in zip(got, got_jax, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert gj.shape == tuple(r.shape) and gj.dtype == np.float32
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32_and_cast_back(dtype):
    x32 = np.random.default_rng(1).normal(100.0, 0.5, (64, 3)).astype(np.float32)
    x = tf.cast(tf.constant(x32), dtype)
    mean, var = tf_stable_moments.moments(x, [0])
    assert mean.dtype == dtype and var.dtype == dtype
    m32, v32 = tf_stable_moments.moments(tf.cast(x, tf.float32), [0])
    np.testing.assert_array_equal(bits(var.numpy()), bits(tf.cast(v32, dtype).numpy()))
    np.testing.assert_array_equal(bits(mean.numpy()), bits(tf.cast(m32, dtype).numpy()))
    jmean, jvar = jax_kernel.moments(jnp.asarray(x32).astype(dtype), 0)
    assert jvar.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(bits(np.asarray(jvar)), bits(var.numpy()))


def test_float64_is_correctly_rounded_and_matches_the_mirror():
    from tf_stable_moments._oracle import exact_moments

    x = np.random.default_rng(2).normal(1e12, 1e-2, (500, 4))
    mean, var = tf_stable_moments.moments(tf.constant(x), [0])
    exact = np.array([exact_moments(x[:, j], np.float64)[1] for j in range(4)])
    np.testing.assert_array_equal(bits(var.numpy()), bits(exact))
    _, mirror_var = datasets.oracle(x, (0,))
    np.testing.assert_array_equal(bits(var.numpy()), bits(mirror_var))
    assert float(tf_stable_moments.moments(tf.constant([1e300] * 3, tf.float64), [0])[1]) == 0.0


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64, tf.bool, tf.string, tf.uint8])
def test_non_float_dtypes_raise_type_error_naming_the_dtype(dtype):
    x = tf.zeros([3], dtype)
    with pytest.raises(TypeError, match=rf"got dtype {dtype.name}"):
        tf_stable_moments.moments(x, [0])


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_jax_non_float_dtypes_raise_type_error_naming_the_dtype(dtype):
    with pytest.raises(TypeError, match=rf"got dtype {np.dtype(dtype).name}"):
        jax_kernel.moments(np.zeros(3, dtype), 0)


@pytest.mark.parametrize("impl", ["tf", "jax"])
@pytest.mark.parametrize(
    "axes,pattern",
    [
        ([2], r"axis 2 is out of range for an input of rank 2"),
        ([-3], r"axis -3 is out of range"),
        ([0, 0], r"repeated axis; got axes=\(0, 0\)"),
        ([1, -1], r"repeated axis; got axes=\(1, -1\)"),
    ],
)
def test_bad_axes_raise_value_error_naming_them(impl, axes, pattern):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=pattern):
        if impl == "tf":
            tf_stable_moments.moments(x, axes)
        else:
            jax_kernel.moments(x, axes)


@pytest.mark.parametrize("ddof", [-1, 1.5, True])
def test_bad_ddof_raises_value_error(ddof):
    with pytest.raises(ValueError, match=r"ddof must be a non-negative int; got ddof="):
        tf_stable_moments.moments(np.zeros(3, np.float32), [0], ddof=ddof)


@pytest.mark.parametrize("mode", MODES)
def test_ddof_divides_by_n_minus_ddof_and_nan_when_not_positive(mode):
    from tf_stable_moments._oracle import exact_moments

    x = np.random.default_rng(3).normal(5e4, 2.0, (7, 3)).astype(np.float32)
    _, var = run(mode, x, (0,), ddof=1)
    exact = np.array([exact_moments(x[:, j], np.float32, ddof=1)[1] for j in range(3)])
    np.testing.assert_array_equal(bits(var), bits(exact))
    for ddof in (7, 9) if mode not in XLA_MODES else (7,):  # (one compilation per ddof)
        _, var = run(mode, x, (0,), ddof=ddof)
        assert np.all(np.isnan(var))


@pytest.mark.parametrize("mode", MODES)
def test_empty_slices_give_nan(mode):
    x = np.zeros((0, 4), np.float32)
    mean, var = run(mode, x, (0,))
    assert mean.shape == (4,) and np.all(np.isnan(mean)) and np.all(np.isnan(var))


@pytest.mark.parametrize("mode", MODES)
def test_no_slices_give_empty_results(mode):
    """A kept axis of length 0 (was an IndexError in the XLA kernel's exact path)."""
    mean, var = run(mode, np.zeros((3, 0), np.float32), (0,))
    assert mean.shape == var.shape == (0,)
    assert mean.dtype == var.dtype == np.float32


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_stay_in_their_slice(mode):
    rng = np.random.default_rng(4)
    x = rng.normal(1e6, 1.0, (50, 9)).astype(np.float32)
    clean_mean, clean_var = run(mode, x, (0,))
    x[3, 1], x[7, 2], x[9, 3], x[11, 3], x[0, 4] = np.nan, np.inf, np.inf, -np.inf, -np.inf
    x[0, 6], x[5, 6] = np.inf, np.nan  # an infinity does not hide a NaN
    x[0, 7], x[9, 8], x[10, 8] = np.nan, -np.inf, -np.inf  # NaN first; two -inf
    mean, var = run(mode, x, (0,))
    for j in (0, 5):  # untouched slices keep their bits
        assert bits(var[j]) == bits(clean_var[j]) and bits(mean[j]) == bits(clean_mean[j])
    assert np.all(np.isnan(var[1:5])) and np.all(np.isnan(var[6:]))
    assert np.isnan(mean[1]) and mean[2] == np.inf and np.isnan(mean[3]) and mean[4] == -np.inf
    assert np.isnan(mean[6]) and np.isnan(mean[7]) and mean[8] == -np.inf


def test_shift_is_accepted_and_ignored_like_tf_nn_moments():
    x = tf.constant(np.random.default_rng(5).normal(1e5, 1, (40, 2)).astype(np.float32))
    a = tf_stable_moments.moments(x, [0])
    b = tf_stable_moments.moments(x, [0], shift=tf.constant(123.0), name="with_shift")
    for u, v in zip(a, b):
        np.testing.assert_array_equal(bits(u.numpy()), bits(v.numpy()))


def test_unknown_shapes_do_not_retrace_per_batch_size():
    traces = []

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def f(x):
        traces.append(1)
        return tf_stable_moments.moments(x, [0])

    for n in (3, 17, 100, 1):
        x = np.random.default_rng(n).normal(size=(n, 8)).astype(np.float32)
        np.testing.assert_array_equal(bits(f(x)[1].numpy()), bits(datasets.oracle(x, (0,))[1]))
    assert len(traces) == 1


_AUTOGRAPH_CALLS = {
    "moments": lambda v: tf_stable_moments.moments(v, [0]),
    "reduce_variance": lambda v: tf_stable_moments.reduce_variance(v, 0),
    "reduce_std": lambda v: tf_stable_moments.reduce_std(v, 0),
    "weighted_moments": lambda v: tf_stable_moments.weighted_moments(v, [0], tf.ones_like(v)),
    "moments_state": lambda v: tf_stable_moments.moments_state(v, [0]).values,
    "keras_moments": lambda v: tf_stable_moments.keras_moments(v, [0]),
}


@pytest.mark.parametrize("name", sorted(_AUTOGRAPH_CALLS))
def test_autograph_does_not_convert_the_package(name, monkeypatch):
    """A tf.function (autograph on, as by default) that calls a public function converts
    none of the package's code: autograph would transpile every function it reaches
    (tf.function of `moments`, native kernel on: a first call of 1.07-1.10 s, 0.06-0.07 s
    without; docs section 10)."""
    from tensorflow.python.autograph.impl import api

    converted = []
    convert = api._convert_actual

    def spy(entity, program_ctx):
        converted.append(getattr(entity, "__module__", None) or "")
        return convert(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", spy)
    x = tf.constant(np.random.default_rng(7).normal(1e4, 1.0, (16, 4)).astype(np.float32))
    tf.function(_AUTOGRAPH_CALLS[name]).get_concrete_function(x)
    assert converted, "the test's own lambda is converted: the spy must see it"
    ours = [m for m in converted if m.split(".")[0] in ("tf_stable_moments", "moments_core")]
    allowed = {"tf_stable_moments._keras_moments"} if name == "keras_moments" else set()
    assert set(ours) <= allowed, ours


def test_public_surface_is_thin():
    state = {"MomentsState", "moments_state", "merge_states", "state_moments", "accumulate_state"}
    layers = {
        "StableBatchNormalization",
        "StableGroupNormalization",
        "StableLayerNormalization",
        "StableNormalization",
    }
    functions = {"keras_moments", "reduce_std", "reduce_variance", "weighted_moments"}
    everything = {"moments", "portable", "stabilize"} | state | layers | functions
    assert set(tf_stable_moments.__all__) == everything
    assert set(jax_kernel.__all__) == {"moments", "mean", "var", "std", "standardize"} | state
    for package in (tf_stable_moments, jax_kernel):  # modules are private: nothing else shows
        names = {k for k in dir(package) if not k.startswith("_")}
        # jax_kernel.flax: the optional Flax modules, a public subpackage (it imports
        # flax, so `import jax_kernel` does not import it; once imported it shows).
        assert names - {"flax"} == set(package.__all__)
        assert "flax" not in package.__all__


def test_jax_vmap_matches_per_example_calls():
    x = np.random.default_rng(6).normal(1e4, 1.0, (3, 20, 4)).astype(np.float32)
    mean, var = jax.vmap(lambda v: jax_kernel.moments(v, 0))(x)
    for i in range(3):
        m, v = jax_kernel.moments(x[i], 0)
        np.testing.assert_array_equal(bits(np.asarray(var[i])), bits(np.asarray(v)))
        np.testing.assert_array_equal(bits(np.asarray(mean[i])), bits(np.asarray(m)))


def test_jax_float64_with_x64_matches_tensorflow_bitwise(tmp_path):
    """float64 in JAX needs jax_enable_x64, so it runs in its own process."""
    x = np.random.default_rng(8).normal(3e9, 1e-3, (257, 3))
    np.save(tmp_path / "x.npy", x)
    code = (
        "import jax, numpy as np; jax.config.update('jax_enable_x64', True); import jax_kernel;"
        f"x = np.load({str(tmp_path / 'x.npy')!r});"
        "m, v = jax_kernel.moments(x, 0);"
        f"np.save({str(tmp_path / 'out.npy')!r}, np.stack([np.asarray(m), np.asarray(v)]))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
    jax_mean, jax_var = np.load(tmp_path / "out.npy")
    mean, var = tf_stable_moments.moments(tf.constant(x), [0])
    assert jax_var.dtype == np.float64
    np.testing.assert_array_equal(bits(jax_var), bits(var.numpy()))
    np.testing.assert_array_equal(bits(jax_mean), bits(mean.numpy()))


# ------------------------------------------------------------------ XLA availability
def _failing_xla(fails):
    real = tf_moments._slice_moments_xla

    def fake(axis, ddof, parts, n=None, lo=False):
        if fails(parts[0]):
            raise tf.errors.UnimplementedError(None, None, "XLA is not available here")
        return real(axis, ddof, parts, n, lo)

    return fake


def test_without_xla_falls_back_to_plain_ops_with_the_same_bits(monkeypatch):
    x = np.random.default_rng(40).normal(1e6, 1, (64, 3)).astype(np.float32)
    expected = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [0])]
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")  # the native kernel needs no XLA
    monkeypatch.setitem(tf_moments._xla_state, "ok", None)
    monkeypatch.setattr(tf_moments, "_slice_moments_xla", _failing_xla(lambda part: True))
    with pytest.warns(UserWarning, match=r"XLA unavailable \(UnimplementedError\); using plain"):
        got = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [0])]
    assert tf_moments._xla_state["ok"] is False
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_array_equal(g, e)


def test_an_error_of_the_call_itself_is_raised_not_taken_for_missing_xla(monkeypatch):
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")
    monkeypatch.setitem(tf_moments._xla_state, "ok", None)
    only_large = _failing_xla(lambda part: part.shape[0] > 1)  # the 1 x 1 probe runs
    monkeypatch.setattr(tf_moments, "_slice_moments_xla", only_large)
    with pytest.raises(tf.errors.UnimplementedError, match="XLA is not available here"):
        tf_stable_moments.moments(np.ones((8, 2), np.float32), [0])
    assert tf_moments._xla_state["ok"] is None


# ------------------------------------------------------------------ the native kernel
@pytest.mark.native
def test_the_native_kernels_are_built_and_serve_cpu_calls():
    """The install (or the first use) builds both libraries: a failed build must not hide
    behind the fallback here, where a compiler and both frameworks' headers exist."""
    from jax_kernel import _moments as jax_moments
    from jax_kernel import _native as jax_native
    from tf_stable_moments import _native as tf_native

    assert tf_native.op() is not None
    assert tf_moments._native_op(tf.constant([1.0])) is not None
    assert jax_native.available() and jax_moments._use_native()


@pytest.mark.parametrize(
    "shape,axes,keepdims,dtype",
    [
        ((3, 4, 5, 6), [1, 2], False, tf.float32),
        ((3, 4, 5, 6), [0, 1], True, tf.float32),
        ((3, 4, 5, 6), [1, 3], True, tf.float32),
        ((30, 7), [0], False, tf.float16),
        ((5, 8), [1], False, tf.complex64),
    ],
)
@pytest.mark.native
def test_eager_calls_without_a_tape_are_one_native_op_with_the_bits_of_the_tape_path(
    shape, axes, keepdims, dtype, monkeypatch
):
    """A TF eager call that nothing records runs the native op alone (contiguous axes: no
    reshape, the op returns the kept shape); it gives the bits of the general path."""
    rng = np.random.default_rng(7)
    x = rng.normal(1e3, 1.0, shape)
    if dtype.is_complex:
        x = x + 1j * rng.normal(-5.0, 2.0, shape)
    x = tf.constant(x, dtype)
    want = tf.nn.moments(tf.cast(x, tf.float32), axes, keepdims=keepdims)  # shapes only
    with tf.GradientTape() as tape:  # a recording tape: the general (custom gradient) path
        tape.watch(x)
        slow = tf_stable_moments.moments(x, axes, keepdims=keepdims)
    contiguous = axes == list(range(axes[0], axes[-1] + 1))
    if contiguous:

        def no_reshape(*args, **kwargs):
            raise AssertionError("an eager call with contiguous axes reshaped")

        monkeypatch.setattr(tf, "reshape", no_reshape)
    fast = tf_stable_moments.moments(x, axes, keepdims=keepdims)
    monkeypatch.undo()
    for f, s, w in zip(fast, slow, want):
        assert f.shape == w.shape and f.dtype == s.dtype
        assert np.array_equal(bits(f.numpy()), bits(s.numpy()))


@pytest.mark.native
def test_the_native_op_reads_a_range_of_axes_and_differentiates_directly():
    """The op on x itself with reduced axes [1, 3) equals the rank-3 form on the reshaped
    x bit for bit; its registered gradient is 1/n and 2 (x - mean) / (n - ddof)."""
    from tf_stable_moments import _native as tf_native

    op = tf_native.op()
    x = tf.constant(np.random.default_rng(8).normal(0.0, 1.0, (3, 4, 5, 6)), tf.float32)
    fmt = dict(ddof=1, precision=24, emin=-126, emax=128)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        mean, var, _ = op(x, axis_begin=1, axis_end=3, keepdims=True, **fmt)
        loss = tf.reduce_sum(mean) + tf.reduce_sum(var * var)
    flat, flat_var, _ = op(tf.reshape(x, [3, 20, 6]), **fmt)
    assert mean.shape == (3, 1, 1, 6) and var.shape == (3, 1, 1, 6)
    assert np.array_equal(bits(mean.numpy().ravel()), bits(flat.numpy().ravel()))
    assert np.array_equal(bits(var.numpy().ravel()), bits(flat_var.numpy().ravel()))
    grad = tape.gradient(loss, x).numpy()
    x64 = x.numpy().astype(np.float64)
    m64 = x64.mean(axis=(1, 2), keepdims=True)
    want = 1 / 20 + 2 * var.numpy() * 2 * (x64 - m64) / 19
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)


def _plain_mean_lo(laid, axis, m64, v64, fmt):
    from moments_core import _kernel
    from tf_stable_moments import _ops

    return _kernel.mean_lo(_ops.PLAIN, laid, axis, m64, v64, 0, fmt)


def _xla_mean_lo(laid, axis, m64, v64, fmt):
    from moments_core import _kernel
    from tf_stable_moments import _ops

    @tf.function(jit_compile=True)
    def compiled(laid, m64, v64):
        return _kernel.mean_lo(_ops.XLA, laid, axis, m64, v64, 0, fmt)

    return compiled(laid, m64, v64)


@pytest.mark.parametrize(
    "formulation",
    [_plain_mean_lo, _xla_mean_lo],
    ids=["plain_operations", "xla_under_jit_compile"],
)
def test_the_native_mean_lo_op_gives_the_bits_of_the_kernel_formulation(formulation):
    """StableMeanLo (moments.h `mean_lo`) against moments_core/_kernel.py `mean_lo` on
    plain TensorFlow operations (what served the native path before) and inside an XLA
    computation (its fixed-point sum in `_variadic`'s column blocks, exact in any order):
    offsets, mixed magnitudes, inputs near the bottom and the top of each format's
    range, a NaN."""
    from moments_core._formats import FORMATS

    for x, axes in datasets.mean_lo_cases():
        xt = tf.constant(x)
        mean, lo, var = tf_moments.stats(xt, axes, 0, lo=True)
        parts = tf_moments._parts(xt)
        work = parts[0].dtype
        means = [mean] if len(parts) == 1 else [tf.math.real(mean), tf.math.imag(mean)]
        v64 = tf.cast(tf.reshape(var, [-1]), tf.float64)
        want = []
        for p, m in zip(parts, means):
            laid, axis = tf_moments._layout(p, axes)
            m64 = tf.cast(tf.reshape(m, [-1]), tf.float64)
            low = formulation(laid, axis, m64, v64, FORMATS[work.name])
            want.append(tf.cast(low, work).numpy())
        got = lo.numpy().ravel()
        want = want[0] if len(want) == 1 else (want[0] + 1j * want[1]).astype(got.dtype)
        assert np.array_equal(bits(got), bits(want.ravel())), (x.dtype, x.shape, axes)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_the_xla_kernel_mean_lo_follows_the_exact_path(graph, monkeypatch):
    """The XLA kernel's computations of their own (native kernel off) compute mean_lo with
    the fast path, from its statistics, and again after the exact path where a slice is
    open: a near-tie the float64 sums cannot see (column 0: mean 2**-1 + 2**-25 + 2**-62,
    a float32 midpoint plus 2**-62; the sums' nearest candidate is 0.5, the mean 0.5 +
    2**-24) has the mean_lo of its exact mean (negative; 0.5's would be positive), as the
    kernel's own formulation gives it from the certified mean."""
    from moments_core._formats import FORMATS

    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")
    x = np.random.default_rng(9).normal(1e4, 1.0, (4, 3)).astype(np.float32)
    x[:, 0] = [1.0, 1.0 + 2.0**-23, 2.0**-60, 0.0]
    xt = tf.constant(x)

    def stats(v):
        return tf_moments.stats(v, [0], 0, lo=True)

    mean, lo, var = (tf.function(stats) if graph else stats)(xt)
    assert tf_moments.undecided_fraction(xt, [0]) > 0  # column 0 took the exact path
    want_mean, want_var = datasets.oracle(x, (0,))
    assert np.array_equal(bits(mean.numpy()), bits(want_mean))
    assert np.array_equal(bits(var.numpy()), bits(want_var))
    assert mean.numpy()[0] == np.float32(0.5 + 2.0**-24)
    laid, axis = tf_moments._layout(xt, [0])
    m64, v64 = (tf.cast(t, tf.float64) for t in (mean, var))
    want_lo = tf.cast(_xla_mean_lo(laid, axis, m64, v64, FORMATS["float32"]), tf.float32)
    assert np.array_equal(bits(lo.numpy()), bits(want_lo.numpy()))
    assert lo.numpy()[0] < 0


@pytest.mark.native
def test_a_layer_step_in_a_graph_runs_the_native_ops_and_no_cond():
    """The batch statistics and the centred input are one StableCentre op (its gradient
    registered: no custom_gradient of its own) and the stall check one StableStallCheck
    op: no plain-operations formulation (bitcasts) and no tf.cond in the traced step,
    which has at most as many operations as keras's (the trace is most of a first
    tf.function step).  The output formula (docs section 14) is one StableScaleShift op,
    its gradient registered too, and each moving average one StableBlend: no
    tf.custom_gradient (IdentityN) in the step."""
    import keras

    def kinds(bn):
        bn.build((8, 4, 4, 16))

        @tf.function
        def step(v):
            with tf.GradientTape() as tape:
                tape.watch(v)
                loss = tf.reduce_sum(bn(v, training=True) ** 2)
            return tape.gradient(loss, v)

        graph = step.get_concrete_function(tf.TensorSpec((8, 4, 4, 16), tf.float32)).graph
        return [op.type for op in graph.get_operations()]

    ours, theirs = (
        kinds(tf_stable_moments.StableBatchNormalization()),
        kinds(keras.layers.BatchNormalization()),
    )
    for name in ("StableCentre", "StableStallCheck", "StableScaleShift"):
        assert ours.count(name) == 1, (name, sorted(set(ours)))
    assert ours.count("StableBlend") == 2, sorted(set(ours))  # one per moving average
    forbidden = {"If", "StatelessIf", "Bitcast", "EagerPyFunc", "StableMoments"}
    assert not forbidden & set(ours), sorted(set(ours))
    assert ours.count("IdentityN") == 0, sorted(set(ours))
    assert len(ours) <= len(theirs), (len(ours), len(theirs))


def _fusions(hlo):
    """(result dimensions, instruction count) of every fusion of an optimized XLA module
    (text): one list of dimensions per result array."""
    for body in re.split(r"\n(?=%)", hlo):
        head = body.split("\n", 1)[0]
        if head.startswith("%fused") and "{" in head:
            shapes = re.findall(r"\[([0-9,]+)\]", head.split("->", 1)[1])
            yield [[int(d) for d in s.split(",")] for s in shapes], body.count("\n")


def _largest_elementwise_fusion(hlo, elements):
    """The most instructions in one fusion of an optimized XLA module (text) that
    computes a value per input element (a shape of `elements` elements)."""
    sizes = [n for dims, n in _fusions(hlo) if any(math.prod(d) == elements for d in dims)]
    assert sizes, "no per-element fusion found"
    return max(sizes)


def _jit_layer_step_hlo(bn, stage, shape=(8, 8, 8, 128)):
    """The XLA module (text, at `stage`) of a training step of layer bn under jit_compile."""
    bn.build(shape)

    @tf.function(jit_compile=True)
    def step(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            loss = tf.reduce_sum(bn(v, training=True) ** 2)
        return tape.gradient(loss, v)

    return step.experimental_get_compiler_ir(tf.TensorSpec(shape))(stage)


@pytest.mark.parametrize("native", [True, False], ids=["native_custom_call", "xla_kernel"])
def test_a_layer_step_under_jit_compile_computes_per_slice_values_once(native, monkeypatch):
    """XLA fuses a cheap per-slice chain into each consumer, i.e. per element: mean_lo's
    rounding, used by the output and the gradient, is made a buffer of its own in the XLA
    kernel (`_ops.XLA.materialize`).  The per-element fusions of a BN training step under
    jit_compile stay about as small as keras's (with the chain: 137 instructions against
    45, and 0.4 ms of a 1.7 ms step), with the native custom call (CPU) and with the XLA
    kernel (accelerators)."""
    import keras

    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "1" if native else "0")

    ours = _jit_layer_step_hlo(tf_stable_moments.StableBatchNormalization(), "optimized_hlo")
    assert ("tf_stable_moments_moments" in ours) is native
    ours = _largest_elementwise_fusion(ours, 8 * 8 * 8 * 128)
    theirs = _jit_layer_step_hlo(keras.layers.BatchNormalization(), "optimized_hlo")
    theirs = _largest_elementwise_fusion(theirs, 8 * 8 * 8 * 128)
    assert ours <= 1.5 * theirs + _output_formula_size(), (ours, theirs)


def _xla_kernel_graph(fn, *specs):
    """The op types of fn's trace as a tf.function(jit_compile=True), nested functions
    included."""
    graph = tf.function(fn, jit_compile=True).get_concrete_function(*specs).graph
    types = [op.type for op in graph.get_operations()]
    for f in graph._functions.values():  # noqa: SLF001
        types += [node.op for node in f.definition.node_def]
    return types


@pytest.mark.parametrize("lo", [False, True], ids=["moments", "stats"])
def test_inside_xla_the_kernel_is_one_xla_call_module(lo, monkeypatch):
    """The XLA kernel inside a user's XLA computation (accelerators; here the native
    kernel switched off) is one XlaCallModule op holding its JAX export (one module per
    variant, any shape): not the two thousand TensorFlow operations that the XLA bridge
    converted at every call site."""
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")

    def fn(x):
        if lo:
            return tf_moments.stats(x, (0, 1, 2), 0)
        return tf_stable_moments.moments(x, [0, 1, 2])

    types = _xla_kernel_graph(fn, tf.TensorSpec([4, 8, 8, 16]))
    assert types.count("XlaCallModule") == 1, types
    assert len(types) < 60, len(types)
    types = _xla_kernel_graph(fn, tf.TensorSpec([None, 8, 8, 16]))
    assert types.count("XlaCallModule") == 1, types


@pytest.mark.parametrize(
    "shape", [(37, 5), (300, 3), (0, 3), (6, 0)], ids=["short", "long", "no_elements", "no_slices"]
)
def test_the_xla_call_module_of_unknown_shape_gives_the_oracle_bits(shape, monkeypatch):
    """One module serves every shape (symbolic dimensions, refined by TensorFlow's XLA
    at compile time): the oracle's bits for slices short and long, N(1e6, 1) and ties;
    a length or slice count that is 0 at run time (symbolic dimensions are at least 1)
    gives section 8's results through the op's guard."""
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")
    rng = np.random.default_rng(7)
    x = (1e6 + rng.standard_normal(shape)).astype(np.float32)
    if shape[0] > 1 and shape[1] > 0:
        x[:, 0] = np.float32(1e6)  # a slice whose mean and variance are exact
        x[: shape[0] // 2, 0] += np.float32(0.0625)
    fn = tf.function(
        lambda v: tf_stable_moments.moments(v, [0]),
        jit_compile=True,
        input_signature=[tf.TensorSpec([None, None])],
    )
    mean, var = fn(tf.constant(x))
    if 0 in shape:  # as a static shape gives them (mean_lo included)

        def stats(v):
            return tf_moments.stats(v, (0,), 0)

        static = tf.function(stats, jit_compile=True)(tf.constant(x))
        dynamic = tf.function(
            stats, jit_compile=True, input_signature=[tf.TensorSpec([None, None])]
        )(tf.constant(x))
        for a, b in zip(static, dynamic):
            np.testing.assert_array_equal(bits(a.numpy()), bits(b.numpy()))
        assert mean.shape == (shape[1],) and np.isnan(mean.numpy()).all()
        return
    want_mean, want_var = datasets.oracle(x, (0,))
    np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
    np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))


def test_the_exported_modules_are_cached_on_disk_and_read_back(tmp_path, monkeypatch):
    """A variant's module is stored in the module cache (TF_STABLE_MOMENTS_CACHE), and a
    later process reads it back instead of exporting the kernel again, with the oracle's
    bits; a damaged file is exported again; the folder is named by the kernel's sources,
    so that a changed kernel never loads an older module."""
    import shutil

    from tf_stable_moments import _xla_module

    monkeypatch.setenv("TF_STABLE_MOMENTS_CACHE", str(tmp_path / "cache"))
    variant = ("kernel", "float32", 1, 0, 0, False, False, False, False, ())
    path = _xla_module._cache_path(variant)
    assert path.startswith(str(tmp_path / "cache")) and not os.path.exists(path)
    exported = _xla_module._exported.__wrapped__(*variant)
    assert os.path.exists(path)

    def no_export(*args):
        raise AssertionError(f"exported again: {args}")

    monkeypatch.setattr(_xla_module, "_export", no_export)
    loaded = _xla_module._exported.__wrapped__(*variant)
    assert loaded.mlir_module_serialized == exported.mlir_module_serialized
    x = (1e6 + np.random.default_rng(11).standard_normal((300, 5))).astype(np.float32)
    x[:, 0] = np.float32(1e6)  # exact sums
    x[:150, 0] += np.float32(0.0625)
    fn = tf.function(lambda v: _xla_module._call([v], loaded, 5), jit_compile=True)
    mean, var, _ = fn(tf.constant(x))
    want_mean, want_var = datasets.oracle(x, (0,))
    np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
    np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))

    with open(path, "wb") as f:
        f.write(b"not a module")
    monkeypatch.setattr(_xla_module, "_export", lambda *args: exported)
    assert _xla_module._exported.__wrapped__(*variant) is exported
    assert _xla_module._load(path).mlir_module_serialized == exported.mlir_module_serialized

    copy = tmp_path / "packages"
    for pattern in _xla_module._SOURCES:
        for source in glob.glob(os.path.join(_xla_module._PACKAGES, pattern)):
            target = copy / os.path.relpath(source, _xla_module._PACKAGES)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
    monkeypatch.setattr(_xla_module, "_PACKAGES", str(copy))
    same = _xla_module._sources_digest.__wrapped__()
    assert same == _xla_module._sources_digest()
    with open(copy / "moments_core" / "_exact.py", "a") as f:
        f.write("\n")
    changed = _xla_module._sources_digest.__wrapped__()
    assert changed != same
    monkeypatch.setattr(_xla_module, "_sources_digest", lambda: changed)
    assert os.path.dirname(_xla_module._cache_path(variant)) != os.path.dirname(path)


def _output_formula_size(shape=(8, 8, 8, 128)):
    """The instructions of the output formula y = RN32(RN64(r f + b)) alone (docs section
    14: a float64 product and sum, the rounding on the encoding), which every layer step
    now computes per element: added to the bound above, so that a per-slice chain
    recomputed per element (the 60 operations of rsqrt32, say) still fails it."""
    from moments_core import _affine
    from tf_stable_moments._ops import XLA

    fn = tf.function(lambda r, f, b: _affine.affine32(XLA, r, f, b), jit_compile=True)
    channels = tf.TensorSpec(shape[-1:])
    hlo = fn.experimental_get_compiler_ir(tf.TensorSpec(shape), channels, channels)
    return _largest_elementwise_fusion(hlo("optimized_hlo"), math.prod(shape))


def _instructions(hlo):
    """The instructions of an XLA module (text): its lines that assign a value."""
    return [line for line in hlo.splitlines() if " = " in line and line.startswith("  ")]


@pytest.mark.native
def test_under_jit_compile_on_the_cpu_the_layer_is_three_custom_calls():
    """Inside a user's XLA computation on the CPU the native kernels run as XLA custom
    calls: a BN training step holds one call for mean, variance and mean_lo, one for
    the stall check and one for the output formulas' per-channel t = rsqrt32(var + eps),
    and none of the XLA kernel (no loop: its exact path was most of a model's first
    jit_compile step, seconds per layer).  The step's XLA module is about as large as
    keras's and the output formulas' together."""
    import keras

    hlo = _jit_layer_step_hlo(tf_stable_moments.StableBatchNormalization(), "hlo")
    calls = re.findall(r'custom_call_target="([a-z_]+)"', hlo)
    assert sorted(calls) == [
        "tf_stable_moments_moments",
        "tf_stable_moments_rsqrt",
        "tf_stable_moments_stall_check",
    ]
    # No XLA kernel: no loop, and no bitcasts but those of the output formulas (section 14)
    formulas = _formulas_hlo()
    assert " while(" not in hlo
    assert hlo.count("bitcast-convert(") <= formulas.count("bitcast-convert("), hlo
    theirs = _jit_layer_step_hlo(keras.layers.BatchNormalization(), "hlo")
    bound = 1.5 * len(_instructions(theirs)) + len(_instructions(formulas))
    assert len(_instructions(hlo)) <= bound, (len(_instructions(hlo)), bound)


def _formulas_hlo(shape=(8, 8, 8, 128)):
    """The XLA module (text) of the output formulas a BN training step computes (docs
    section 14): t = rsqrt32(var + eps), f = times32(gamma, t), y = affine32(r, f, beta),
    the two moving averages blend32, each value materialized as the layer does."""
    from moments_core import _affine
    from tf_stable_moments._ops import XLA

    def formulas(r, v, gamma, beta, m, s):
        t = XLA.materialize(_affine.rsqrt32(XLA, v))
        y = _affine.affine32(XLA, r, XLA.materialize(_affine.times32(XLA, gamma, t)), beta)
        return y, _affine.blend32(XLA, m, s, v, s), _affine.blend32(XLA, m, s, v, s)

    channels = [tf.TensorSpec(shape[-1:])] * 5
    fn = tf.function(formulas, jit_compile=True)
    return fn.experimental_get_compiler_ir(tf.TensorSpec(shape), *channels)("hlo")


@pytest.mark.native
def test_under_jit_compile_with_an_accelerator_the_xla_kernel_serves(monkeypatch):
    """The custom calls are registered for the CPU: where an accelerator is visible (XLA
    would compile for it) the XLA kernel is built into the computation instead."""
    from tf_stable_moments import _native

    real = tf.config.list_logical_devices

    def with_a_gpu(kind=None):
        fake = [tf.config.LogicalDevice("/device:GPU:0", "GPU")]
        return fake if kind == "GPU" else real(kind)

    assert _native.xla_available()
    monkeypatch.setattr(tf.config, "list_logical_devices", with_a_gpu)
    assert not _native.xla_available()

    @tf.function(jit_compile=True)
    def fn(x):
        return tf_stable_moments.moments(x, [0])

    hlo = fn.experimental_get_compiler_ir(tf.TensorSpec((64, 3)))("hlo")
    assert "custom_call_target" not in hlo and " while(" in hlo


@pytest.mark.parametrize(
    "shape,axes,spec,dtype",
    [
        ((48, 5), [0], [None, 5], np.float32),  # reduced axis unknown: one call
        ((48, 5), [1], [None, 5], np.float32),  # kept axis unknown: chunks of 8192 rows
        ((40000, 3), [1], [None, 3], np.float64),  # three chunks, the last one padded
        ((6, 7, 33), [2], [None, 7, None], np.complex64),  # reduced length unknown too
        ((3, 4, 5, 6), [1, 3], [None, 4, 5, 6], np.float32),  # transposed, kept [3, 5]
    ],
    ids=["reduced-unknown", "kept-unknown", "three-chunks", "complex", "transposed"],
)
@pytest.mark.native
def test_under_jit_compile_unknown_lengths_take_the_native_custom_call(shape, axes, spec, dtype):
    """The custom call's result shapes are fixed when the graph is traced: with the kept
    axes unknown then (a LayerNormalization's batch under Keras fit), it runs on chunks
    of a static number of rows in one XLA loop instead of the XLA kernel being built in;
    reduced axes unknown (a BatchNormalization's batch) are one call.  Oracle bits."""
    rng = np.random.default_rng(71)
    x = rng.normal(1e6, 1.0, shape).astype(dtype)
    if np.iscomplexobj(x):
        x = (x + 1j * rng.normal(5.0, 1.0, shape)).astype(dtype)
    fn = tf.function(
        lambda v: tf_stable_moments.moments(v, axes),
        jit_compile=True,
        input_signature=[tf.TensorSpec(spec, tf.as_dtype(dtype))],
    )
    hlo = fn.experimental_get_compiler_ir(tf.constant(x))("hlo")
    assert hlo.count('custom_call_target="tf_stable_moments_moments"') == 1
    kept_unknown = None in [spec[a] for a in range(len(spec)) if a not in axes]
    assert hlo.count(" while(") == int(kept_unknown)  # the chunks' loop, no exact path
    want = datasets.oracle(x, tuple(axes), 0)
    for got, exact in zip(fn(tf.constant(x)), want):
        assert np.array_equal(bits(got.numpy()), bits(exact))


def test_the_jax_xla_kernel_gradient_computes_mean_lo_once():
    """The same in JAX's XLA kernel (accelerators, no native library): the gradient of
    the variance uses mean_lo per element (the residuals); returned through
    `jax_kernel._ops.materialize`, its per-element fusions stay about as small as those
    of jnp.var's gradient (31 instructions against 25; with the rounding fused: 130)."""
    import jax
    import jax.numpy as jnp

    from jax_kernel import _moments as jax_moments

    spec = jax.ShapeDtypeStruct((512, 128), jnp.float32)
    weights = jnp.arange(128.0)

    def ours(v):
        return jnp.sum(jax_moments._moments(v, (0,), False, 0, False, False)[1] * weights)

    def theirs(v):
        return jnp.sum(jnp.var(v, 0) * weights)

    ours, theirs = (
        _largest_elementwise_fusion(jax.jit(jax.grad(f)).lower(spec).compile().as_text(), 512 * 128)
        for f in (ours, theirs)
    )
    assert ours <= 1.5 * theirs, (ours, theirs)


def test_the_synchronized_centring_computes_mean_lo_once():
    """mean_lo of the union (the layers' synchronized path: a fixed-point sum all-reduced,
    then its rounding per slice) is a buffer of its own (`_kernel.mean_lo_round`): its
    rounding was fused into the per-element passes of the synchronized BN step (JAX: 109,
    144 and 118 instructions per element, against 9, 45 and 18 now).  A synchronized
    centring's gradient step (two devices, `jax.vmap` with an axis name) keeps its
    per-element fusions about as small as a plain centring's with `pmean`, the output
    formula's size aside."""
    import jax
    import jax.numpy as jnp

    from jax_kernel import _centre

    spec = jax.ShapeDtypeStruct((2, 512, 128), jnp.float32)
    weights = jnp.arange(128.0)

    def ours(v):
        return _centre.centre(v, None, (0,), "r")[0]

    def theirs(v):
        return v - jax.lax.pmean(jnp.mean(v, 0), "r")

    def step(centring):
        fn = jax.vmap(centring, axis_name="r")
        return jax.jit(jax.grad(lambda v: jnp.sum(fn(v) ** 2 * weights)))

    ours, theirs = (
        _largest_elementwise_fusion(step(f).lower(spec).compile().as_text(), 2 * 512 * 128)
        for f in (ours, theirs)
    )
    assert ours <= 1.5 * theirs, (ours, theirs)


def _per_slice_fusions(hlo, kept):
    """Instruction counts of the fusions of an optimized XLA module (text) whose results
    are all per-slice values: `kept` (or kept + 1, the exact path's dummy slot) along
    their last axis, at most four rows."""
    return [
        n
        for dims, n in _fusions(hlo)
        if dims and all(d[-1] in (kept, kept + 1) and math.prod(d) <= 4 * (kept + 1) for d in dims)
    ]


def test_the_fast_paths_per_slice_chain_is_compiled_once():
    """The bounds and the rounding test of a slice (some 400 operations) feed its mean,
    its variance and its open flag.  XLA fused the chain into a computation of its own
    for each result that a later step reads (JAX, float32 [4096, 64], XLA kernel: 390,
    342 and 175 instructions; the certified merge of two devices: 442, 440, 399 and 215),
    compiling and running it up to four times; `_kernel._one_buffer` computes the three
    into one buffer.  One large per-slice fusion, on one device and in the merge."""
    import jax
    import jax.numpy as jnp

    from jax_kernel import _moments as jax_moments
    from jax_kernel import _union

    def single(v):
        return jax_moments._moments(v, (0,), False, 0, False, False)

    merged = jax.vmap(lambda v: _union.union_moments(v, None, (0,), "r"), axis_name="r")
    for fn, shape in ((single, (4096, 64)), (merged, (2, 512, 64))):
        spec = jax.ShapeDtypeStruct(shape, jnp.float32)
        sizes = _per_slice_fusions(jax.jit(fn).lower(spec).compile().as_text(), 64)
        assert max(sizes) > 300, sizes  # the chain is there
        assert len([n for n in sizes if n > max(sizes) / 2]) == 1, sizes


_ROUNDS_CODE = {
    "jax": """
import jax, jax.numpy as jnp
from jax_kernel import _moments as jm

def step(v):  # the kernel with mean_lo, and a layer's elementwise formula after it
    mean, lo, var = jm.stats(v, (0,), 0, lo=True, native=False)
    return (v - mean - lo) * jax.lax.rsqrt(var + 1e-3) * 2.0 + 1.0

jax.jit(step).lower(jax.ShapeDtypeStruct((4096, 64), jnp.float32)).compile()
""",
    # A batch unknown while tracing: the kernel's module is symbolic in the length, and
    # slices of one block (16 * 4 * 4 = 256 elements).
    "tf": """
import os
os.environ["TF_STABLE_MOMENTS_NATIVE"] = "0"
import tensorflow as tf, tf_stable_moments

spec = tf.TensorSpec([None, 4, 4, 64], tf.float32)
step = tf.function(lambda v: tf_stable_moments.moments(v, [0, 1, 2]), jit_compile=True)
step.get_concrete_function(spec)(tf.ones([16, 4, 4, 64]))
""",
}


@pytest.mark.parametrize("framework", ["jax", "tf"])
def test_the_xla_kernel_leaves_xlas_simplification_in_four_rounds(framework):
    """XLA's simplification pipeline repeats until a round changes nothing, each round a
    pass over the whole module.  Three shapes of the kernel kept it going: the exact
    path's results left its loop as reshaped columns of its table, a reshape that XLA's
    reshape mover sank through their consumers one operation per round; constants
    subtracted inside its loops came back into them a round after code motion had
    hoisted their negations (`_kernel._batched`, `_exact`'s module docstring); and with
    a length unknown while tracing, a slice of one block made the fast path's second
    stage a reduction of one element, a reshape once XLA knew the length
    (`_kernel.block_sums`).  JAX's step took 10 rounds (7 with either of the first two
    changes alone), TensorFlow's 9 (with the first two changes); now 4, as XLA's own
    moments.  The rounds are XLA's log (a process of its own, VLOG of hlo_pass_fix)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="hlo_pass_fix=3")
    proc = subprocess.run(
        [sys.executable, "-c", _ROUNDS_CODE[framework]],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pattern = r"\] simplification iteration (\d+) changed_this_iteration"
    rounds = [int(r) + 1 for r in re.findall(pattern, proc.stderr)]
    assert rounds, proc.stderr[-3000:]  # the log is there: the test can see the rounds
    assert max(rounds) <= 4, max(rounds)


def test_a_missing_native_kernel_warns_once_and_falls_back_with_the_same_bits(
    monkeypatch, tmp_path
):
    from moments_core.native import build
    from tf_stable_moments import _native as tf_native

    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "1")  # a missing kernel, not a switched-off one
    x = np.random.default_rng(41).normal(1e6, 1, (64, 3)).astype(np.float32)
    expected = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [0])]
    monkeypatch.setattr(tf_native, "_state", {"tried": False, "op": None})
    monkeypatch.setattr(tf_native, "_LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setenv("TF_STABLE_MOMENTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match=r"native kernel is not available \(no C\+\+ compiler"):
        got = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [0])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        again = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [0])]
    assert tf_native.op() is None
    for g, a, e in zip(got, again, expected, strict=True):
        np.testing.assert_array_equal(g, e)
        np.testing.assert_array_equal(a, e)


def test_the_package_modules_import_each_other_without_a_cycle():
    """No module of the three packages imports (at the top or inside a function) a module
    that imports it back: the native op's gradient math lives in _centre_grad.py, which
    the layers and the op both import (was a cycle _native -> _layer -> ... -> _native)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    packages = ("tf_stable_moments", "jax_kernel", "moments_core")
    files = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        # A package's __init__ imports its own modules; edges into a package are not cycles.
        graph[name] = {d for d in deps if d in files and d != name and d not in packages}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for d in graph[todo.pop()] - seen:
                seen.add(d)
                todo.append(d)
        return seen

    cycles = sorted(m for m in graph if m not in packages and m in reach(m))
    assert cycles == [], cycles


def test_keep_dims_is_the_tf1_alias_of_keepdims_with_a_deprecation_warning():
    """tf.compat.v1.nn.moments code passes keep_dims= (issue #26 item 6)."""
    x = tf.constant(np.random.default_rng(6).normal(1e4, 1, (8, 3, 2)).astype(np.float32))
    want = tf_stable_moments.moments(x, [0, 2], keepdims=True)
    with pytest.warns(DeprecationWarning, match=r"keep_dims is deprecated, use keepdims"):
        got = tf_stable_moments.moments(x, [0, 2], keep_dims=True)
    for g, w in zip(got, want):
        assert g.shape == (1, 3, 1)
        np.testing.assert_array_equal(g.numpy().view(np.uint32), w.numpy().view(np.uint32))
    with pytest.warns(DeprecationWarning):
        assert tf_stable_moments.moments(x, [0], keep_dims=False)[0].shape == (3, 2)
    with pytest.raises(ValueError, match=r"cannot specify both keepdims and keep_dims.*"):
        tf_stable_moments.moments(x, [0], keepdims=True, keep_dims=True)
