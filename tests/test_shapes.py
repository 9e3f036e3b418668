"""Shape buckets and padded slices: bounded XLA compilations, fast lengths that are not
powers of two, and the same bits."""

import jax
import numpy as np
import numpy_mirror
import pytest
import tensorflow as tf
from modes import bits

import jax_kernel
import tf_stable_moments
from tf_stable_moments import _moments as tf_moments


@pytest.fixture
def compiled_shapes(monkeypatch):
    """The concrete shapes that reach the XLA computation (one compilation each)."""
    shapes = []
    real = tf_moments._slice_moments_xla

    def record(axis, ddof, parts, count=None):
        def note(shape):
            shapes.append(tuple(int(d) for d in shape.numpy()))
            return shape

        tf.py_function(note, [tf.shape(parts[0])], tf.int32)
        return real(axis, ddof, parts, count)

    monkeypatch.setattr(tf_moments, "_slice_moments_xla", record)
    return shapes


@pytest.mark.parametrize(
    "m,steps,expected",
    [
        (0, 8, 1),
        (1, 8, 1),
        (8, 8, 8),
        (9, 8, 9),
        (16, 8, 16),
        (17, 8, 18),
        (33, 8, 36),
        (100, 8, 104),
        (1000, 8, 1024),
        (1025, 8, 1152),
        (0, 1, 1),
        (3, 1, 4),
        (33, 1, 64),
        (1000, 1, 1024),
        (4096, 1, 4096),
    ],
    ids=lambda v: str(v),
)
def test_bucket_rounds_up_to_steps_per_octave(m, steps, expected):
    assert tf_moments._bucket(m, steps) == expected
    assert int(tf_moments._bucket(tf.constant(m, tf.int64), steps)) == expected


def test_buckets_bound_the_padding():
    for steps, limit in ((8, 1.125), (1, 2.0)):
        for m in range(1, 3000):
            b = tf_moments._bucket(m, steps)
            assert m <= b < limit * m + 1, (m, steps, b)


@pytest.mark.parametrize(
    "axis,kept,expected",
    [
        (0, 300, [4, 32, 128, 1, 64, 64, 64, 64]),
        (1, 8, [4, 32, 128, 1, 64, 64, 64, 64]),
    ],
    ids=["axis0", "axis1"],
)
def test_dynamic_lengths_compile_once_per_bucket_with_the_same_bits(
    axis, kept, expected, compiled_shapes
):
    """A tf.function with an unknown length: one trace, one XLA shape per power of two."""
    spec = [None, kept] if axis == 0 else [kept, None]

    @tf.function(input_signature=[tf.TensorSpec(spec, tf.float32)])
    def f(x):
        return tf_stable_moments.moments(x, [axis])

    sizes = (3, 17, 100, 1, 33, 34, 35, 64)
    for n in sizes:
        shape = (n, kept) if axis == 0 else (kept, n)
        x = np.random.default_rng(n).normal(1e4, 1, shape).astype(np.float32)
        x[0, 0] = np.inf if n == 17 else x[0, 0]  # an infinite first element is padding too
        mean, var = f(x)
        want_mean, want_var = numpy_mirror.moments(x, (axis,))
        np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))
        np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
    lengths = [s[axis] for s in compiled_shapes]
    assert lengths == expected
    assert all(s[1 - axis] == kept for s in compiled_shapes)  # a static kept axis stays exact
    assert f.experimental_get_tracing_count() == 1


def _special_rows(rng, shape, dtype):
    x = rng.normal(3e4, 2.0, shape).astype(dtype)
    x[1, :] = x[1, 0]  # constant slice
    x[2, 3] = np.nan
    x[3, 0] = np.inf  # an infinite first element
    x[4, 0] = np.nan  # a NaN first element
    x[5, 2], x[5, 4] = np.inf, -np.inf
    x[6, :] *= np.asarray(1e-30, dtype)  # tiny values
    x[7, :] = np.linspace(-3e38, 3e38, shape[1]).astype(dtype)  # near overflow
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("axis", [0, 1])
def test_eager_calls_past_the_exact_shape_budget_are_bucketed_with_the_same_bits(
    dtype, ddof, axis, compiled_shapes, monkeypatch
):
    rng = np.random.default_rng(3)
    x = _special_rows(rng, (21, 37), np.float32 if dtype == np.complex64 else dtype)
    if dtype == np.complex64:
        z = np.empty(x.shape, dtype)
        z.real, z.imag = x, _special_rows(rng, x.shape, np.float32)
        x = z
    x = x if axis == 1 else x.T.copy()
    monkeypatch.setattr(tf_moments, "_exact_shapes", {})  # a fresh budget of exact shapes
    exact = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [axis], ddof=ddof)]
    monkeypatch.setattr(tf_moments, "EXACT_SHAPES", 0)
    monkeypatch.setattr(tf_moments, "_exact_shapes", {})
    bucketed = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [axis], ddof=ddof)]
    for b, e in zip(bucketed, exact, strict=True):
        np.testing.assert_array_equal(b, e)
    # the exact call pads slices along axis 1 to a power of two; the budget-less call also
    # buckets the kept axis (21 -> 22) and, along axis 0, slices in 8 steps per octave (37 -> 40)
    assert compiled_shapes == ([(21, 64), (22, 64)] if axis == 1 else [(37, 21), (40, 22)])


def test_empty_slices_with_an_unknown_length_give_nan(compiled_shapes):
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def f(x):
        return tf_stable_moments.moments(x, [0])

    mean, var = f(np.zeros((0, 3), np.float32))
    assert np.all(np.isnan(mean.numpy())) and np.all(np.isnan(var.numpy()))
    assert compiled_shapes == [(1, 3)]


@pytest.mark.parametrize(
    "shape,axis,compiled",
    [
        ((40, 1000), 1, (40, 1024)),  # along axis 1: a power of two
        ((20000, 64), 0, (32768, 64)),  # narrow rows, over 2**20 elements
        ((3000, 300), 0, (3000, 300)),  # wide rows: exact
        ((1000, 64), 0, (1000, 64)),  # small: exact
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_static_shapes_pad_slices_to_a_power_of_two_where_xla_is_slow(
    shape, axis, compiled, compiled_shapes, monkeypatch
):
    monkeypatch.setattr(tf_moments, "_exact_shapes", {})
    x = np.random.default_rng(7).normal(-2e5, 3.0, shape).astype(np.float32)
    first = x[0, :] if axis == 0 else x[:, 0]  # a view: the slices' first elements
    first[:3], first[3:6] = np.inf, np.nan  # padding copies of inf and NaN
    mean, var = tf_stable_moments.moments(x, [axis])
    want_mean, want_var = numpy_mirror.moments(x, (axis,))
    np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))
    np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
    assert compiled_shapes == [compiled]


@pytest.mark.parametrize(
    "shape,axes,dtype",
    [
        ((21, 37), (1,), np.float32),
        ((21, 37), (1,), np.float64),
        ((21, 37), (1,), np.complex64),
        ((21, 37), (1,), np.float16),
        ((9, 7, 41), (1, 2), np.float32),
        ((16400, 64), (0,), np.float32),
    ],
    ids=lambda v: getattr(v, "__name__", str(v).replace(" ", "")),
)
@pytest.mark.parametrize("ddof", [0, 1])
def test_jax_padded_slices_give_the_bits_of_unpadded_ones(shape, axes, dtype, ddof, monkeypatch):
    from jax_kernel import _moments as jax_moments

    n = int(np.prod([shape[a] for a in axes]))
    axis = 0 if axes[0] == 0 else 1
    assert jax_moments._padded_length(n, np.prod(shape) // n, axis) == 1 << (n - 1).bit_length()
    rng = np.random.default_rng(9)
    part = np.float32 if dtype in (np.complex64, np.float16) else dtype
    x = _special_rows(rng, (np.prod(shape) // n, n), part)  # one slice per row
    if dtype == np.complex64:
        z = np.empty(x.shape, dtype)
        z.real, z.imag = x, _special_rows(rng, x.shape, part)
        x = z
    if dtype == np.float16:
        x = np.where(np.abs(x) > 6e4, 1e4, x).astype(dtype)  # float16 range
    x = x.reshape(shape) if axis == 1 else np.ascontiguousarray(x.T).reshape(shape)
    padded = jax_kernel.moments(x, axes, ddof=ddof)
    monkeypatch.setattr(jax_moments, "_padded_length", lambda n, kept, axis: n)
    with jax.disable_jit():  # traced anew, op by op, without padding
        unpadded = jax_kernel.moments(x, axes, ddof=ddof)
    for p, u in zip(padded, unpadded, strict=True):
        assert p.dtype == u.dtype and p.shape == u.shape
        np.testing.assert_array_equal(bits(np.asarray(p)), bits(np.asarray(u)))


def test_an_unknown_kept_length_is_bucketed_in_eight_steps_per_octave(compiled_shapes):
    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float32)])
    def f(x):
        return tf_stable_moments.moments(x, [1])

    for rows in (17, 18, 19, 100):
        x = np.random.default_rng(rows).normal(7.0, 1e-3, (rows, 5)).astype(np.float32)
        mean, var = f(x)
        want_mean, want_var = numpy_mirror.moments(x, (1,))
        np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))
        np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
        assert mean.shape == (rows,)
    assert compiled_shapes == [(18, 8), (18, 8), (20, 8), (104, 8)]
