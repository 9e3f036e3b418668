"""The drop-in functions: tf.math.reduce_variance / reduce_std, tf.nn.weighted_moments,
jnp.mean / var / std (where=), keras.ops.moments.

Shapes and dtypes against the replaced functions on a grid (JAX where= through
jax.eval_shape, weighted_moments on plain operations: no XLA compile per shape);
results bit for bit against the exact oracle; the same bits across modes and
between TensorFlow and JAX; the float16 overflow policy per API; bad inputs.
Few XLA compilations (CI budget): one masked JAX kernel (and its exact-only
twin), one weighted TF kernel.
"""

import math
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import tensorflow as tf
from datasets import oracle, oracle_rsqrt32
from modes import bits, native, xla

import jax_kernel
import tf_stable_moments
from moments_core import _state
from tf_stable_moments import _keras_moments
from tf_stable_moments._oracle import exact_value, round_rational

RNG = np.random.default_rng(13)
SHAPES_AXES = [((5, 3), None), ((5, 3), 0), ((5, 3), -1), ((2, 3, 4), (0, 2)), ((2, 3, 4), 1)]


def _axes_list(axis, ndim):
    return list(range(ndim)) if axis is None else ([axis] if isinstance(axis, int) else list(axis))


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype


# ------------------------------------------------------------------ shapes and dtypes
GRID = [(s, a, k, np.float32) for s, a in SHAPES_AXES for k in (False, True)]
GRID += [((2, 3, 4), (0, 2), False, np.float16), ((2, 3, 4), (0, 2), True, np.complex64)]


def test_shapes_and_dtypes_equal_the_replaced_functions():
    for i, (shape, axis, keepdims, dtype) in enumerate(GRID):
        x = RNG.normal(2.0, 1.0, shape).astype(dtype)
        for ours, ref in [
            (tf_stable_moments.reduce_variance, tf.math.reduce_variance),
            (tf_stable_moments.reduce_std, tf.math.reduce_std),
        ]:
            assert _same(ours(x, axis, keepdims), ref(x, axis, keepdims)), (ours, shape, axis)
        for fn in ("mean", "var", "std"):
            assert _same(
                getattr(jax_kernel, fn)(x, axis, keepdims=keepdims),
                getattr(jnp, fn)(x, axis, keepdims=keepdims),
            ), (fn, shape, axis)
            if i % 4 or (fn == "std") != (i % 8 == 0):
                continue  # tracing the masked kernel costs ~2 s: a quarter of the grid
            # where= (the masked XLA kernel) without compiling: traced shapes and dtypes.
            mask = np.ones(shape, bool)
            ours = jax.eval_shape(
                lambda t, m, f=fn, a=axis, k=keepdims: getattr(jax_kernel, f)(
                    t, a, keepdims=k, where=m
                ),
                x,
                mask,
            )
            ref = jax.eval_shape(
                lambda t, m, f=fn, a=axis, k=keepdims: getattr(jnp, f)(t, a, keepdims=k, where=m),
                x,
                mask,
            )
            assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype), (fn, shape, axis)
        if dtype == np.complex64:
            continue
        axes = _axes_list(axis, len(shape))
        ours = tf_stable_moments.keras_moments(x, axes, keepdims)
        ref = keras.ops.moments(x, axes, keepdims)
        assert all(_same(a, b) for a, b in zip(ours, ref)), (shape, axis)
        w = RNG.integers(0, 3, shape[-1:]).astype(np.float32)  # broadcast weights
        with xla(False), native(False):
            ours = tf_stable_moments.weighted_moments(x, axes, w, keepdims)
        ref = tf.nn.weighted_moments(x, axes, w, keepdims)
        assert all(_same(a, b) for a, b in zip(ours, ref)), (shape, axis)


def test_integer_input_and_dtype_argument_follow_jnp():
    x = np.arange(12, dtype=np.int32).reshape(3, 4)
    for fn in ("mean", "var", "std"):
        assert _same(getattr(jax_kernel, fn)(x, 0), getattr(jnp, fn)(x, 0)), fn
    f16 = RNG.normal(0, 1, (6, 2)).astype(np.float16)
    assert _same(jax_kernel.var(f16, 0, dtype=jnp.float32), jnp.var(f16, 0, dtype=jnp.float32))
    np.testing.assert_array_equal(
        bits(jax_kernel.var(x, 0, correction=1)), bits(jax_kernel.var(x, 0, ddof=1))
    )


# ------------------------------------------------------------------ exact oracle, modes
def _round_sqrt(v, dtype):
    """sqrt of a Fraction v >= 0, rounded once to dtype (nearest, ties to even)."""
    c = dtype(math.sqrt(float(v)))
    for _ in range(4):
        lo, hi = np.nextafter(c, dtype(-np.inf)), np.nextafter(c, dtype(np.inf))
        low = (Fraction(float(lo)) + Fraction(float(c))) / 2
        high = (Fraction(float(c)) + Fraction(float(hi))) / 2
        if v < low * low:
            c = lo
        elif v > high * high:
            c = hi
        else:
            return c
    raise AssertionError("no convergence")


def _offset_data():
    """float32 N(1e6, 1) and N(1e4, 0.01) columns, n = 40: variances tf.math gets wrong."""
    x = np.concatenate(
        [RNG.normal(1e6, 1.0, (40, 3)), RNG.normal(1e4, 0.01, (40, 3))], axis=1
    ).astype(np.float32)
    return x


def test_reduce_variance_and_std_are_exact_in_every_mode_and_equal_jax():
    x = _offset_data()
    mean_ref, var_ref = oracle(x, (0,))
    std_ref = np.array([_round_sqrt(exact_value(c, np.float32)[1], np.float32) for c in x.T])
    results = {
        "tf_eager": (
            tf_stable_moments.reduce_variance(x, 0),
            tf_stable_moments.reduce_std(x, 0),
        ),
        "tf_function": tf.function(
            lambda t: (tf_stable_moments.reduce_variance(t, 0), tf_stable_moments.reduce_std(t, 0))
        )(tf.constant(x)),
        "jax_jit": jax.jit(lambda t: (jax_kernel.var(t, 0), jax_kernel.std(t, 0)))(x),
        "jax_eager": (jax_kernel.var(x, 0), jax_kernel.std(x, 0)),
    }
    for mode, (var, std) in results.items():
        np.testing.assert_array_equal(bits(var), bits(var_ref), err_msg=mode)
        np.testing.assert_array_equal(bits(std), bits(std_ref), err_msg=mode)
    np.testing.assert_array_equal(bits(jax_kernel.mean(x, 0)), bits(mean_ref))
    # tf.math itself is off by many ulps on these data: the test can tell.
    assert np.any(bits(tf.math.reduce_variance(x, 0)) != bits(var_ref))


def _std_oracle(column, dtype, ddof):
    """sqrt of the exact variance rounded to float64, then to dtype: std's contract."""
    values = np.asarray(column)
    if not np.all(np.isfinite(values.astype(np.float64))) or len(values) - ddof <= 0:
        return dtype(np.nan)
    var64 = round_rational(exact_value(values, dtype, ddof)[1], np.float64)
    return round_rational(Fraction(float(np.sqrt(var64))), dtype)


def test_std_of_long_slices_rounds_the_exact_states_variance():
    """From `STD_FROM_STATE` elements per slice std takes its float64 variance from the
    exact state (moments_state, rounded once to float64) instead of the kernel on the
    data widened to float64: the oracle's bits (sqrt of the float64-rounded exact
    variance, rounded once more), TF eager and jit_compile, JAX jit with and without a
    mask, ddof 0 and 1, float32 and float16, NaN and Inf in their own slices."""
    n = _state.STD_FROM_STATE + 3
    for dtype in (np.float32, np.float16):
        x = np.stack(
            [
                RNG.normal(1e4, 1, n),
                RNG.normal(0, 1, n),
                RNG.normal(3, 1e-2, n),
                RNG.normal(0, 1, n),
            ],
            1,
        ).astype(dtype)
        x[5, 1], x[9, 3] = np.nan, -np.inf
        mask = RNG.random(x.shape) < 0.6

        def both(t, m=None):  # ddof 0 and 1 in one compilation
            return [jax_kernel.std(t, 0, ddof=d, where=m) for d in (0, 1)]

        assert "tf_stable_moments_state" in str(jax.make_jaxpr(both)(x)), "not the state"
        got = {"jax_jit": jax.jit(both)(x), "jax_where": jax.jit(both)(x, mask)}
        got["tf_eager"] = [tf_stable_moments.reduce_std(x, 0)]  # reduce_std has no ddof
        got["tf_jit_compile"] = [
            tf.function(lambda t: tf_stable_moments.reduce_std(t, 0), jit_compile=True)(
                tf.constant(x)
            )
        ]
        for mode, values in got.items():
            for ddof, value in enumerate(values):
                selected = mask.T if mode == "jax_where" else np.ones(x.T.shape, bool)
                want = [_std_oracle(c[m], dtype, ddof) for c, m in zip(x.T, selected)]
                np.testing.assert_array_equal(bits(value), bits(np.array(want)), err_msg=mode)


def _masked_data():
    x = _offset_data()[:, :5]
    mask = RNG.random(x.shape) < 0.5
    mask[:, 0] = True  # all selected
    mask[:, 1] = False  # none selected: NaN, as jnp
    mask[0, 2], x[0, 2] = False, np.nan  # an unselected NaN does not count
    # An exact tie among the selected: mean 1 + 2**-24 rounds to even (1.0) on the exact path.
    mask[1:21, 2], mask[21:, 2] = True, False
    x[1:21:2, 2], x[2:21:2, 2] = 1.0, 1.0 + 2.0**-23
    x[:, 3] = x[0, 3]  # constant: var 0
    mask[0, 3] = True
    x[mask[:, 4].argmax(), 4] = np.inf  # a selected inf: mean inf, var NaN; others unaffected
    return x, mask


def _masked_oracle(x, mask, ddof=0):
    means, variances = [], []
    for j in range(x.shape[1]):
        if not mask[:, j].any():  # nothing selected: NaN (jnp: 0 / 0)
            means.append(np.nan)
            variances.append(np.nan)
            continue
        m, v = oracle(x[mask[:, j], j], (0,), ddof)
        means.append(m)
        variances.append(v)
    return np.array(means, x.dtype), np.array(variances, x.dtype)


def test_jax_where_is_the_exact_statistic_of_the_selected_elements():
    # Slice 2 is an exact tie and slice 4 holds an inf: both take the masked exact path.
    x, mask = _masked_data()
    mean_ref, var_ref = _masked_oracle(x, mask)
    assert mean_ref[2] == 1.0
    mean = jax_kernel.mean(x, 0, where=mask)
    var = jax_kernel.var(x, 0, where=mask)
    np.testing.assert_array_equal(bits(mean), bits(mean_ref))
    np.testing.assert_array_equal(bits(var), bits(var_ref))
    # A slice's NaN/Inf stays in it: changing slice 4 changes no other slice.
    x2 = x.copy()
    x2[:, 4] = np.nan
    other = jax_kernel.var(x2, 0, where=mask)
    np.testing.assert_array_equal(bits(other)[:4], bits(var_ref)[:4])


def _weighted_oracle(x, w):
    means, variances = [], []
    for col, wc in zip(x.T, w.T):
        xs, ws = [Fraction(float(v)) for v in col], [Fraction(float(v)) for v in wc]
        total = sum(ws)
        if total == 0:
            means.append(0.0)
            variances.append(0.0)
            continue
        mu = sum(a * b for a, b in zip(ws, xs)) / total
        var = sum(a * (b - mu) ** 2 for a, b in zip(ws, xs)) / total
        means.append(round_rational(mu, x.dtype))
        variances.append(round_rational(var, x.dtype))
    return np.array(means, x.dtype), np.array(variances, x.dtype)


def test_weighted_moments_are_exact_in_every_mode():
    x = _offset_data()
    w = RNG.integers(0, 4, x.shape).astype(np.float32)
    w[:, 1] = 0.25 * RNG.integers(0, 9, 40)  # fractional weights of a common scale
    w[:, 2] = np.float32(0.1)  # weights of 24 bits: still integers after scaling
    w[:, 3] = 0.0  # no weight: 0, 0 (div_no_nan)
    mean_ref, var_ref = _weighted_oracle(x, w)
    xt, wt = tf.constant(x), tf.constant(w)
    fn = tf.function(lambda a, b: tf_stable_moments.weighted_moments(a, [0], b))
    results = {"tf_function": fn(xt, wt)}  # the XLA kernel (tf eager runs the same function)
    with xla(False), native(False):
        results["tf_eager_plain"] = tf_stable_moments.weighted_moments(x, [0], w)
    for mode, (mean, var) in results.items():
        np.testing.assert_array_equal(bits(mean), bits(mean_ref), err_msg=mode)
        np.testing.assert_array_equal(bits(var), bits(var_ref), err_msg=mode)
    ref_var = tf.nn.weighted_moments(x, [0], w)[1]
    assert np.any(bits(ref_var) != bits(var_ref))  # tf.nn is off by many ulps here
    # 0/1 weights are a selection: the same bits as moments of the selected elements.
    sel = w[:, 0] > 0
    with xla(False), native(False):
        m01, v01 = tf_stable_moments.weighted_moments(x[:, :1], [0], sel[:, None] * 1.0)
    np.testing.assert_array_equal(bits(v01), bits(oracle(x[sel, 0], (0,))[1][None]))
    np.testing.assert_array_equal(bits(m01), bits(oracle(x[sel, 0], (0,))[0][None]))
    # A negative weight makes only its slice NaN.
    bad = w.copy()
    bad[5, 0] = -1.0
    with xla(False), native(False):
        mean, var = tf_stable_moments.weighted_moments(x, [0], bad)
    assert np.isnan(mean[0]) and np.isnan(var[0])
    np.testing.assert_array_equal(bits(var)[1:], bits(var_ref)[1:])


def test_gradients_agree_with_the_replaced_functions_on_benign_data():
    x = RNG.normal(0.0, 1.0, (30, 4)).astype(np.float32)
    w = RNG.integers(1, 3, (30, 4)).astype(np.float32)
    xv, wv = tf.Variable(x), tf.Variable(w)
    with tf.GradientTape(persistent=True) as tape:
        ours = tf.reduce_sum(tf_stable_moments.reduce_std(xv, 0))
        ref = tf.reduce_sum(tf.math.reduce_std(xv, 0))
        with xla(False), native(False):
            m, v = tf_stable_moments.weighted_moments(xv, [0], wv)
        ours_w = tf.reduce_sum(m) + tf.reduce_sum(v)
        m, v = tf.nn.weighted_moments(xv, [0], wv)
        ref_w = tf.reduce_sum(m) + tf.reduce_sum(v)
    np.testing.assert_allclose(tape.gradient(ours, xv), tape.gradient(ref, xv), atol=1e-5)
    for var in (xv, wv):
        np.testing.assert_allclose(tape.gradient(ours_w, var), tape.gradient(ref_w, var), atol=1e-5)
    g_ours = jax.grad(lambda t: jax_kernel.std(t, 0).sum())(x)
    np.testing.assert_allclose(g_ours, jax.grad(lambda t: jnp.std(t, 0).sum())(x), atol=1e-5)


# ------------------------------------------------------------------ keras_moments, float16
def test_keras_moments_equal_tf_and_jax_and_clip_float16_as_keras():
    x = _offset_data()
    mean_ref, var_ref = oracle(x, (0,))
    mean, var = tf_stable_moments.keras_moments(x, [0])
    np.testing.assert_array_equal(bits(mean), bits(mean_ref))
    np.testing.assert_array_equal(bits(var), bits(var_ref))
    jmean, jvar = _keras_moments._jax_moments(x, [0], False, False)
    np.testing.assert_array_equal(bits(jvar), bits(var_ref))
    np.testing.assert_array_equal(bits(jmean), bits(mean_ref))
    # float16: the variance of [-60000, 60000] (3.6e9) overflows float16.
    h = np.array([[-60000.0, 1.0], [60000.0, 2.0]], np.float16)
    k_mean, k_var = keras.ops.moments(h, [0])
    o_mean, o_var = tf_stable_moments.keras_moments(h, [0])
    np.testing.assert_array_equal(bits(o_var), bits(np.array([65504.0, 0.25], np.float16)))
    np.testing.assert_array_equal(bits(o_var), bits(k_var))  # keras.ops: clipped
    np.testing.assert_array_equal(bits(o_mean), bits(k_mean))
    j_var = _keras_moments._clip(
        _keras_moments._jax_moments(h, [0], False, False)[1], "float16", jnp
    )
    np.testing.assert_array_equal(bits(j_var), bits(o_var))
    # tf.nn / tf.math style drop-ins follow tf.nn.moments: inf.
    assert np.isinf(tf_stable_moments.reduce_variance(h, 0)[0])
    assert np.isinf(tf.nn.moments(tf.constant(h), [0])[1][0])
    with xla(False), native(False):
        assert np.isinf(tf_stable_moments.weighted_moments(h, [0], np.ones_like(h))[1][0])
    assert np.isinf(jax_kernel.var(h, 0)[0])
    # synchronized=True: TF without replicas is the plain computation; JAX raises as keras.
    np.testing.assert_array_equal(
        bits(tf_stable_moments.keras_moments(x, [0], synchronized=True)[1]), bits(var_ref)
    )
    with pytest.raises(NotImplementedError, match=r"synchronized=True is not supported"):
        _keras_moments._jax_moments(x, [0], False, True)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_keras_moments_on_a_keras_tensor_builds_a_functional_model(dtype, keepdims):
    """A KerasTensor gives KerasTensors of the output shape and dtype (issue #26 item 5),
    and the model's outputs are the oracle's bits (the JAX backend: test_norm_layers)."""
    x = _offset_data()[:, :6].reshape(-1, 2, 3)
    x = x if dtype == "float32" else np.round(x).astype(np.int32)
    inputs = keras.Input(x.shape[1:], dtype=dtype)
    mean, var = tf_stable_moments.keras_moments(inputs, [0, 1], keepdims=keepdims)
    want_shape = (1, 1, 3) if keepdims else (3,)
    for t in (mean, var):
        assert isinstance(t, keras.KerasTensor)
        assert tuple(t.shape) == want_shape and t.dtype == "float32"
    got = keras.Model(inputs, [mean, var])(x)
    ref_mean, ref_var = oracle(x.astype(np.float32).reshape(-1, 3), (0,))
    np.testing.assert_array_equal(bits(np.ravel(got[0])), bits(ref_mean))
    np.testing.assert_array_equal(bits(np.ravel(got[1])), bits(ref_var))


# ------------------------------------------------------------------ bad inputs
BAD_AXES = {"float": 1.5, "string": "1", "bool_in_list": [True], "nested": [[0, 1]]}
CALLS = {
    "reduce_variance": (lambda x, a: tf_stable_moments.reduce_variance(x, a), "axis"),
    "reduce_std": (lambda x, a: tf_stable_moments.reduce_std(x, a), "axis"),
    "weighted_moments": (
        lambda x, a: tf_stable_moments.weighted_moments(x, a, np.ones_like(x)),
        "axes",
    ),
    "mean": (lambda x, a: jax_kernel.mean(x, a), "axis"),
    "var": (lambda x, a: jax_kernel.var(x, a), "axis"),
    "std": (lambda x, a: jax_kernel.std(x, a, where=np.ones(x.shape, bool)), "axis"),
    "moments": (lambda x, a: tf_stable_moments.keras_moments(x, a), "axes"),
}


@pytest.mark.parametrize("fn", CALLS)
def test_bad_axes_raise_errors_naming_the_value(fn):
    call, arg = CALLS[fn]
    x = np.zeros((2, 3), np.float32)
    for axes in BAD_AXES.values():
        pattern = rf"{arg} must be an int or a sequence of ints; got {arg}=" + re.escape(repr(axes))
        with pytest.raises(TypeError, match=pattern):
            call(x, axes)
    with pytest.raises(ValueError, match=r"axis 2 is out of range for an input of rank 2"):
        call(x, [2])
    with pytest.raises(ValueError, match=rf"{arg} contains a repeated axis; got {arg}=\(0, 0\)"):
        call(x, [0, 0])


def test_bad_arguments_raise_errors_naming_them():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"var: ddof must be a non-negative int; got ddof=-1"):
        jax_kernel.var(x, 0, ddof=-1)
    with pytest.raises(ValueError, match=r"std: correction must be a non-negative int; got corr"):
        jax_kernel.std(x, 0, correction=0.5)
    with pytest.raises(ValueError, match=r"var: ddof and correction cannot both be given"):
        jax_kernel.var(x, 0, ddof=1, correction=1)
    with pytest.raises(NotImplementedError, match=r"mean: the out argument is not supported"):
        jax_kernel.mean(x, 0, out=np.zeros(3, np.float32))
    with pytest.raises(NotImplementedError, match=r"var: the mean argument is not supported"):
        jax_kernel.var(x, 0, mean=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match=r"reduce_variance: the input must have a floating or "):
        tf_stable_moments.reduce_variance(np.zeros((2, 3), np.int32))
    with pytest.raises(TypeError, match=r"weighted_moments: the input must have a floating dt"):
        tf_stable_moments.weighted_moments(np.zeros(3, np.complex64), [0], np.ones(3))
    with pytest.raises(TypeError, match=r"frequency_weights must be real numbers; got dtype co"):
        tf_stable_moments.weighted_moments(x, [0], np.ones((2, 3), np.complex64))


# ------------------------------------------------------------------ jax_kernel.standardize
@pytest.mark.parametrize("masked", [False, True], ids=["all", "where"])
@pytest.mark.parametrize("axis", [-1, (0, 2), None], ids=["last", "axes_02", "all"])
def test_standardize_is_accurate_and_the_same_bits_eager_and_jit(axis, masked):
    """jax.nn.standardize's default loses the spread of N(1e6, 0.1) (jax #30426) and
    differs between eager and jit (#37281); ours matches float64 and is one result."""
    x = np.random.default_rng(37).normal(1e6, 0.1, (4, 6, 32)).astype(np.float32)
    where = np.random.default_rng(8).random(x.shape) < 0.7 if masked else None
    got = np.asarray(jax_kernel.standardize(x, axis, where=where))
    jitted = jax.jit(lambda v: jax_kernel.standardize(v, axis, where=where))(x)
    np.testing.assert_array_equal(bits(got), bits(np.asarray(jitted)))
    x64 = x.astype(np.float64)
    select = True if where is None else where
    m = np.mean(x64, axis, keepdims=True, where=select)
    v = np.mean((x64 - m) ** 2, axis, keepdims=True, where=select)
    assert np.abs(got - (x64 - m) / np.sqrt(v + 1e-5)).max() <= 1e-5
    assert (
        np.abs(
            np.asarray(jax.nn.standardize(x, axis, where=where)) - (x64 - m) / np.sqrt(v + 1e-5)
        ).max()
        > 1.0
    )


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_standardize_output_is_rounded_once_from_its_statistics(jit):
    """With mean and variance given: y = RN32((x - m) RN32(1 / sqrt(v + eps))), the bits
    of the exact oracle on every machine (XLA's rsqrt differs in the last bit between
    CPUs: the docstring's example printed 1.2247449 where 1.2247448 is nearest)."""
    rng = np.random.default_rng(41)
    x = rng.normal(3.0, 2.0, (64, 24)).astype(np.float32)
    mean = rng.normal(3.0, 0.1, (1, 24)).astype(np.float32)
    variance = rng.uniform(0.01, 50.0, (1, 24)).astype(np.float32)
    fn = (
        (lambda a: jax.jit(jax_kernel.standardize, static_argnums=1)(a, 0, mean, variance))
        if jit
        else (lambda a: jax_kernel.standardize(a, 0, mean, variance))
    )
    got = np.asarray(fn(x))
    r = x - mean  # float32 subtraction: IEEE in numpy and XLA alike
    t = oracle_rsqrt32(variance + np.float32(1e-5))
    want = np.vectorize(lambda a, b: np.float32(float(Fraction(float(a)) * Fraction(float(b)))))(
        r, t
    )
    want = want.astype(np.float32)  # the exact product of two float32, rounded once
    np.testing.assert_array_equal(bits(got), bits(want))


def test_standardize_follows_jax_on_benign_data_and_given_statistics():
    x = np.random.default_rng(9).normal(0.5, 2.0, (8, 16)).astype(np.float32)
    np.testing.assert_allclose(
        jax_kernel.standardize(x), jax.nn.standardize(x), rtol=1e-5, atol=1e-5
    )

    def loss(f, v):
        return jnp.sum(jnp.sin(3.0 * f(v)))

    g = jax.grad(lambda v: loss(jax_kernel.standardize, v))(x)
    h = jax.grad(lambda v: loss(jax.nn.standardize, v))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-4)
    mean, variance = np.float32(0.25), np.float32(3.0)
    for kwargs in ({"mean": mean}, {"variance": variance}, {"mean": mean, "variance": variance}):
        for algorithm in ("fast", "stable"):
            want = jax.nn.standardize(x, algorithm=algorithm, **kwargs)
            got = jax_kernel.standardize(x, algorithm=algorithm, **kwargs)
            tol = 1e-5 if "mean" in kwargs else 1e-4  # no mean given: ours, certified
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    ints = np.arange(12).reshape(3, 4)
    assert jax_kernel.standardize(ints).dtype == jax.nn.standardize(ints).dtype


def test_standardize_rejects_bad_arguments_naming_them():
    with pytest.raises(
        ValueError, match=r"standardize: algorithm must be one of .* got algorithm='exact'"
    ):
        jax_kernel.standardize(np.ones((2, 3), np.float32), algorithm="exact")
    with pytest.raises(TypeError, match=r"standardize: x must be real; got dtype complex64"):
        jax_kernel.standardize(np.ones((2, 3), np.complex64))
    with pytest.raises(TypeError, match=r"standardize: axis must be an int .* got axis=1\.5"):
        jax_kernel.standardize(np.ones((2, 3), np.float32), axis=1.5)
