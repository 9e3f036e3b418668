"""Shape buckets and padded slices: bounded XLA compilations and the same bits.

These are properties of the XLA kernel's own dispatch (the native kernel takes any
shape without compiling): the native kernel is switched off here.
"""

import datasets
import numpy as np
import pytest
import tensorflow as tf
from modes import bits

import tf_stable_moments
from tf_stable_moments import _moments as tf_moments


@pytest.fixture(autouse=True)
def xla_kernel(monkeypatch):
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")


@pytest.fixture
def compiled_shapes(monkeypatch):
    """The concrete shapes that reach the XLA computation (one compilation each)."""
    shapes = []
    real = tf_moments._slice_moments_xla

    def record(axis, ddof, parts, n=None, lo=False):
        def note(shape):
            shapes.append(tuple(int(d) for d in shape.numpy()))
            return shape

        tf.py_function(note, [tf.shape(parts[0])], tf.int32)
        return real(axis, ddof, parts, n, lo)

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
    in_graph = tf.function(lambda v: tf_moments._bucket(v, steps), autograph=False)
    assert int(in_graph(tf.constant(m, tf.int64))) == expected


def test_buckets_bound_the_padding():
    for steps, limit in ((8, 1.125), (1, 2.0)):
        for m in range(1, 3000):
            b = tf_moments._bucket(m, steps)
            assert m <= b < limit * m + 1, (m, steps, b)


@pytest.mark.parametrize(
    "axis,kept,expected",
    [
        (0, 300, [3, 18, 104, 1, 36, 36, 36, 64]),
        (1, 8, [3, 18, 104, 1, 36, 36, 36, 64]),
    ],
    ids=["axis0", "axis1"],
)
def test_dynamic_lengths_compile_once_per_bucket_with_the_same_bits(
    axis, kept, expected, compiled_shapes
):
    """A tf.function with an unknown length: one trace, one XLA shape per bucket."""
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
        want_mean, want_var = datasets.oracle(x, (axis,))
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


# Each case compiles the XLA kernel for several shapes: three cases cover both layouts,
# both ddof and the three kinds of data (CI budget).
@pytest.mark.parametrize(
    "axis, ddof, dtype",
    [(0, 0, np.float32), (1, 1, np.float64), (1, 0, np.complex64)],
    ids=["axis0-ddof0-float32", "axis1-ddof1-float64", "axis1-ddof0-complex64"],
)
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
    tf_moments._context_cache()["exact_shapes"].clear()  # a fresh budget of exact shapes
    exact = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [axis], ddof=ddof)]
    monkeypatch.setattr(tf_moments, "EXACT_SHAPES", 0)
    tf_moments._context_cache()["exact_shapes"].clear()
    bucketed = [bits(v.numpy()) for v in tf_stable_moments.moments(x, [axis], ddof=ddof)]
    for b, e in zip(bucketed, exact, strict=True):
        np.testing.assert_array_equal(b, e)
    # the budget-less call buckets both axes in 8 steps per octave (37 -> 40; 21 -> 22,
    # raised to the floor of slices of 40 elements, 1024)
    assert tf_moments._kept_floor(40) == 1024
    assert compiled_shapes == ([(21, 37), (1024, 40)] if axis == 1 else [(37, 21), (40, 1024)])


def test_empty_slices_with_an_unknown_length_give_nan(compiled_shapes):
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def f(x):
        return tf_stable_moments.moments(x, [0])

    mean, var = f(np.zeros((0, 3), np.float32))
    assert np.all(np.isnan(mean.numpy())) and np.all(np.isnan(var.numpy()))
    assert compiled_shapes == [(1, 3)]


@pytest.mark.parametrize("n", [1, 2, 5, 37, 128, 129, 1000, 4096, 65536, 100000])
def test_the_kept_floor_holds_about_floor_elements(n):
    floor = tf_moments._kept_floor(n)
    assert floor & (floor - 1) == 0  # a power of two: a bucket of every octave step
    if floor < tf_moments.FLOOR_SLICES:
        assert floor * n >= tf_moments.FLOOR_ELEMENTS or floor == 1
    assert floor == 1 or floor * n < 2 * tf_moments.FLOOR_ELEMENTS
    assert tf_moments._kept_floor(tf.constant(n, tf.int64)) == 1  # a length unknown: none


def test_an_unknown_kept_length_is_bucketed_above_a_floor_of_slices(compiled_shapes):
    """Small batches share the floor's one compilation; above it, 8 steps per octave."""

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float32)])
    def f(x):
        return tf_stable_moments.moments(x, [1])

    for rows in (17, 18, 19, 100, 5000):
        x = np.random.default_rng(rows).normal(7.0, 1e-3, (rows, 5)).astype(np.float32)
        mean, var = f(x)
        want_mean, want_var = datasets.oracle(x, (1,))
        np.testing.assert_array_equal(bits(var.numpy()), bits(want_var))
        np.testing.assert_array_equal(bits(mean.numpy()), bits(want_mean))
        assert mean.shape == (rows,)
    assert tf_moments._kept_floor(5) == 4096
    assert compiled_shapes == [(4096, 5)] * 4 + [(5120, 5)]


@pytest.mark.parametrize(
    "shape, axes",
    [((131072, 64), (0,)), ((100, 32, 32, 64), (0, 1, 2)), ((4096, 4096), (1,))],
    ids=["131072x64-axis0", "conv-100x32x32x64-axes012", "4096x4096-axis1"],
)
def test_xla_kernel_temporaries_stay_within_the_input_size(shape, axes):
    """The XLA kernel's temporary buffers (XLA's own buffer assignment, exact) take at
    most the input's size (#3).  A compiled loop's buffers are allocated at every call:
    the exact path's batch shrinks for long slices (`_kernel._batch`; with 8 slices of
    131072 elements the temporaries were 115 MiB for a 32 MiB input)."""
    import jax
    import jax.numpy as jnp

    from jax_kernel import _moments as jax_moments

    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    kernel = jax.jit(lambda v: jax_moments._moments(v, axes, False, 0, False, False))
    temp = kernel.lower(spec).compile().memory_analysis().temp_size_in_bytes
    assert temp <= int(np.prod(shape)) * 4, (temp, shape)


def _graph_ops(fn, *specs):
    graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
    return graph.get_operations()


def test_graph_call_sites_add_one_call_not_a_cond_each():
    """In a graph the XLA kernel's steps and their tf.cond are one function per variant,
    traced once (as are the bucket sizes and the stall check): each call site, known or
    unknown lengths, adds calls of the same functions and no tf.cond of its own; the
    results have the bits of eager calls."""
    rng = np.random.default_rng(3)
    xs = [rng.normal(1e4, 1.0, s).astype(np.float32) for s in ((64, 3), (40, 3))]

    def two_sites(a, b):
        return tf_stable_moments.moments(a, [0]) + tf_stable_moments.moments(b, [0])

    for specs in (
        [tf.TensorSpec(x.shape, tf.float32) for x in xs],
        [tf.TensorSpec([None, x.shape[1]], tf.float32) for x in xs],
    ):
        ops = _graph_ops(two_sites, *specs)
        assert not [op.name for op in ops if op.type in ("If", "StatelessIf")]
        called = [op.get_attr("f").name for op in ops if op.type.endswith("PartitionedCall")]
        assert called and all(called.count(name) == 2 for name in called), called
        graph_out = tf.function(two_sites, input_signature=specs)(*xs)
        eager_out = two_sites(*xs)
        for g, e in zip(graph_out, eager_out):
            assert np.array_equal(bits(g.numpy()), bits(e.numpy()))

    layer = tf_stable_moments.StableBatchNormalization()
    layer.build((None, 3))
    ops = _graph_ops(lambda v: layer(v, training=True), tf.TensorSpec([64, 3], tf.float32))
    assert not [op.name for op in ops if op.type in ("If", "StatelessIf")]
