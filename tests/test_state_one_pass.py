"""The state in one pass against the digits of every element (`from_rows`, the state's
definition, written once more): the same canonical state, bit for bit.  Two one-pass
implementations (docs section 13, "The state in one pass"):

- the XLA one pass (moments_core/_state.py `from_one_pass`), for inputs of at most 24
  bits: JAX off the CPU's native kernel (and masked), TensorFlow inside XLA (and outside
  from `ONE_PASS_MIN` elements when the native op does not serve);
- the native kernel's (moments.h `state`: the TF op StableState and the JAX FFI call),
  every dtype, on the CPU outside XLA, without a mask.

Each array holds one kind of data per column, so that a layout compiles once: values on an
offset, ranges wider than the pass's 2**42 (the branch that adds the digits of the inputs
below it; the native kernel's bins below its window), magnitudes rising along the slice
(the native kernel's window raised again and again), NaN and infinities, subnormals
(flushed), zeros, columns with every element masked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from datasets import oracle
from modes import bits

import jax_kernel
import tf_stable_moments
from jax_kernel import _native as jax_native
from jax_kernel import _ops as jax_ops
from jax_kernel import _state as jax_state
from moments_core import _kernel, _state
from moments_core._formats import FORMATS
from tf_stable_moments import _moments as tf_moments
from tf_stable_moments import _native as tf_native
from tf_stable_moments import _ops as tf_ops
from tf_stable_moments import _state as tf_state

DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": jnp.bfloat16,
    "complex64": np.complex64,
}
KINDS = ("normal", "offset", "wide", "special", "subnormal", "zeros", "one_tiny", "ties", "rising")


def _column(rng, kind, n):
    if kind == "normal":
        return rng.normal(0, 1, n)
    if kind == "offset":
        return rng.normal(1e4, 1, n)
    if kind == "wide":  # |x| from about 2**-90 to 2**90: more than 2**42 in one slice
        return rng.choice([-1.0, 1.0], n) * np.exp(rng.normal(0, 20, n))
    if kind == "special":
        x = rng.normal(0, 1, n)
        x[rng.permutation(n)[:3]] = [np.nan, np.inf, -np.inf]
        return x
    if kind == "subnormal":  # float32 subnormals and normals near 2**-126
        return rng.normal(0, 1, n) * 2.0**-125
    if kind == "zeros":
        return np.zeros(n)
    if kind == "one_tiny":  # one input 2**-60 below the rest: the branch for one element
        x = rng.normal(0, 1, n)
        x[n // 2] = 2.0**-60
        return x
    if kind == "rising":  # |x| from 2**-60 to 2**60 along the slice, signs mixed
        return rng.choice([-1.0, 1.0], n) * np.exp2(np.linspace(-60, 60, n))
    return rng.integers(-3, 4, n) * 0.5  # many equal values


def _data(dtype, n, layout, seed):
    """[n, kinds] (layout 0) or [kinds, n] (layout 1) of `dtype`, and a mask whose last
    column is all False."""
    rng = np.random.default_rng(seed)
    x = np.stack([_column(rng, k, n) for k in KINDS], 1)
    if np.dtype(dtype).kind == "c":
        imag = np.stack([_column(rng, k, n) for k in reversed(KINDS)], 1)
        x = x.astype(np.complex128)
        x.imag = imag
    with np.errstate(all="ignore"):
        x = x.astype(dtype)
    where = rng.random(x.shape) < 0.7
    where[:, -1] = False
    return (x, where) if layout == 0 else (x.T.copy(), where.T.copy())


def _tf_one_pass(x, where, axis):
    """The one pass of TensorFlow operations inside XLA, on a 2-D x reduced along axis."""
    fmt = FORMATS[tf_moments._compute_dtype(x.dtype).name]

    @tf.function(jit_compile=True, autograph=False)
    def run(x, where):
        parts = tf_moments._parts(x)
        return _state.from_one_pass(tf_ops.XLA, parts, where, fmt, axis)

    return run(x, where).numpy().astype(np.int32)


# Each dtype in both layouts, one of them masked (CI budget: a case compiles in 1-3 s).
CASES = [(d, layout, layout == k % 2) for k, d in enumerate(DTYPES) for layout in (0, 1)]
CASES += [("float32", "4d", True), ("float32", "empty", False)]


@pytest.mark.parametrize(
    "dtype,layout,masked",
    CASES,
    ids=[f"{d}-{lay}-{'where' if m else 'all'}" for d, lay, m in CASES],
)
def test_one_pass_gives_the_state_of_every_elements_digits(dtype, layout, masked):
    if layout == "4d":
        x, where = _data(DTYPES[dtype], 384, 0, 4)
        x, where = x.reshape(4, 96, 3, 3), where.reshape(4, 96, 3, 3)  # nine kinds
        axes = (0, 1)
    elif layout == "empty":
        x, where = np.zeros([0, 3], np.float32), np.zeros([0, 3], bool)
        axes = (0,)
    else:
        x, where = _data(DTYPES[dtype], 700, layout, 7 + layout)
        axes = (layout,)
    mask = where if masked else None
    whole = jax_state._state_values(jnp.asarray(x), mask, axes, False)  # every element's digits
    want = np.asarray(whole).reshape(-1, whole.shape[-1])
    one_pass = jax_state._state_values(jnp.asarray(x), mask, axes, True)
    np.testing.assert_array_equal(
        np.asarray(one_pass).reshape(want.shape), want, err_msg="JAX one pass vs digits"
    )
    state = jax_kernel.moments_state(x, axes, where=mask)  # the native kernel's if unmasked
    got = np.asarray(state.values).reshape(want.shape)
    np.testing.assert_array_equal(got, want, err_msg="JAX moments_state vs digits")
    if layout == "empty":  # n = 0: NaN, as moments gives (section 8)
        assert np.isnan(np.asarray(jax_kernel.state_moments(state))).all()
    elif mask is None:  # the exact oracle, through state_moments
        for ddof in (0, 1):
            ours = jax_kernel.state_moments(state, ddof)
            for g, w in zip(ours, oracle(x, axes, ddof)):
                np.testing.assert_array_equal(bits(np.asarray(g)), bits(np.asarray(w)))
    if x.ndim == 2 and dtype != "bfloat16":  # TensorFlow: the 2-D layouts, numpy dtypes
        tf_got = _tf_one_pass(tf.constant(x), None if mask is None else tf.constant(mask), axes[0])
        np.testing.assert_array_equal(tf_got, want, err_msg="TF one pass (XLA)")
        with tf_stable_moments.portable():  # no native op: small, so the plain digits
            plain = tf_stable_moments.moments_state(x, list(axes), where=mask)
        np.testing.assert_array_equal(plain.values.numpy(), want, err_msg="TF plain digits")


def test_tf_moments_state_runs_the_one_pass_from_its_size_and_gives_the_same_bits():
    """Where the native op does not serve, a float32 input of ONE_PASS_MIN elements takes
    TensorFlow's one-pass XLA computation (on zero-padded buckets, with the true count); its
    state, merged with a small shard's state (plain digits), equals the state of the whole
    from JAX, and its moments are those of `moments`."""
    rng = np.random.default_rng(3)
    rows = tf_state.ONE_PASS_MIN // 64 + 5  # not a bucket size: padded
    x = rng.normal(1e6, 1, [rows + 3, 64]).astype(np.float32)
    x[5, 7] = 2.0**-100  # one slice through the branch below the pass's range
    with tf_stable_moments.portable():  # not the native op
        big = tf_stable_moments.moments_state(x[:rows], [0])
        small = tf_stable_moments.moments_state(x[rows:], [0])
    merged = tf_stable_moments.merge_states(big, small)
    whole = jax_kernel.moments_state(x, 0)
    np.testing.assert_array_equal(merged.values.numpy(), np.asarray(whole.values))
    for got, want in zip(
        tf_stable_moments.state_moments(merged), tf_stable_moments.moments(x, [0])
    ):
        np.testing.assert_array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))


def test_one_pass_counts_whole_blocks_of_special_values():
    """The first pass counts NaN, +inf and -inf per block of 256 inputs in 9-bit fields of
    one int32: blocks of one special value only (each field's largest count), blocks of
    several, and a slice through the branch below the pass give the digits' state (JAX
    and TensorFlow inside XLA)."""
    n = 3 * 256 + 40
    x = np.ones([n, 5], np.float32)
    x[:, 0], x[:, 1], x[:, 2] = np.nan, np.inf, -np.inf
    x[:256, 3], x[256:512, 3], x[512:, 3] = -np.inf, np.nan, np.inf
    x[::3, 4], x[1::3, 4] = -np.inf, np.nan
    x[5, 4] = 2.0**-100  # below the pass's range: the branch runs too
    want = np.asarray(jax_state._state_values(jnp.asarray(x), None, (0,), False))
    got = jax_state._state_values(jnp.asarray(x), None, (0,), True)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg="JAX one pass")
    np.testing.assert_array_equal(_tf_one_pass(tf.constant(x), None, 0), want, err_msg="TF")


def test_one_pass_buffers_stay_near_the_size_of_its_input():
    """The branch below the pass takes more passes, so the compiled one pass needs
    temporary buffers of about its input's size, whatever that size (the digits of every
    element at once were 27 times the input: 432 MB for float32 [65536, 64], allocated on
    every call whether the branch ran or not; a |x| that XLA hoisted out of the branch's
    loop, 88 MB)."""
    for shape, axes in (((65536, 64), (0,)), ((64, 32768), (1,))):
        spec = jax.ShapeDtypeStruct(shape, np.float32)
        compiled = jax_state._state_values.lower(spec, None, axes, True).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        assert temp <= 2 * 4 * np.prod(shape), (shape, temp)


@pytest.mark.parametrize("dtype,axis", [("float32", 0), ("complex64", 1)])
def test_the_exact_path_sums_long_slices_by_the_one_pass(dtype, axis):
    """Slices of `_kernel.ONE_PASS_ROWS` elements or more take the kernel's exact path
    through `_state.digit_sums` (the one pass over the gathered slice, cut into parts
    and merged) instead of every element's digits: every slice sent there (the exact-only
    switch) has the oracle's bits, for both layouts, ranges beyond the pass's 2**42
    (a second and a third pass), NaN and Inf, a complex input, and the extremes of the
    pass's unit: sums near float32's largest values (the highest digits of the signed
    fields, negative) and among its smallest normal ones."""
    n = _kernel.ONE_PASS_ROWS + 5
    assert _kernel._one_pass_rows(n, FORMATS["float32"])
    rng = np.random.default_rng(23)
    locs, scales = [1e3, 0, -2, -3e38, 0], [1, 1, 3, 1e31, 1e-37]
    x = np.stack([rng.normal(m, s, n) for m, s in zip(locs, scales)], 1)
    if dtype == "complex64":
        x = x + 1j * np.stack([rng.normal(m, s, n) for m, s in zip(locs[::-1], scales[::-1])], 1)
    x = x.astype(dtype)
    x[7, 1], x[8, 1], x[9, 2] = 2.0**-60, 2.0**-110, np.inf  # passes below; a special value
    x = x if axis == 0 else x.T.copy()
    parts = [x.real, x.imag] if dtype == "complex64" else [x]

    @jax.jit
    def exact(*ps):
        with jax.enable_x64(True):
            fmt = FORMATS["float32"]
            wide = [p.astype(jnp.float64) for p in ps]
            means, var, _ = _kernel.slice_moments(jax_ops, wide, axis, 1, fmt, None, True)
            return means, var

    means, var = exact(*parts)
    want_mean, want_var = oracle(x, (axis,), 1)
    got_mean = means[0] if len(means) == 1 else np.asarray(means[0]) + 1j * np.asarray(means[1])
    np.testing.assert_array_equal(bits(np.asarray(var, np.float32)), bits(want_var))
    np.testing.assert_array_equal(
        bits(np.asarray(got_mean).astype(want_mean.dtype)), bits(want_mean)
    )


def test_the_wide_mean_of_a_float32_state_is_the_mean_of_the_widened_data():
    """`_wide_moments` (StableNormalization.adapt's second part of the mean) rounds a float32
    state's exact sums to float64: the bits of the state of the data widened to float64
    (its own digits of every element) and of the oracle, NaN and infinities as there."""
    from fractions import Fraction

    rng = np.random.default_rng(11)
    x = rng.normal(1e6, 3, [257, 6]).astype(np.float32)
    x[:, 1] = rng.normal(0, 1e-3, 257)
    x[3, 2], x[4, 3], x[5, 3] = np.nan, np.inf, -np.inf
    x[:, 4] = 2.0**-120  # small, normal in float32
    got = tf_state._wide_moments(tf_stable_moments.moments_state(x, [0]))[0].numpy()
    wide = tf_stable_moments.moments_state(x.astype(np.float64), [0])
    want = tf_stable_moments.state_moments(wide)[0].numpy()
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    for j in (0, 1, 4, 5):
        exact = float(sum(Fraction(float(v)) for v in x[:, j]) / len(x))
        assert got[j] == exact, (j, got[j], exact)


# ------------------------------------------------------------- the native kernel's one pass
# Whether the native library is built and on (TF_STABLE_MOMENTS_NATIVE=0 is the fallback):
# the tests below expect its calls where it serves, and the same bits either way.
NATIVE_TF = tf_native.op() is not None
NATIVE_JAX = jax_native.available()
NATIVE_DTYPES = {**DTYPES, "float64": np.float64, "complex128": np.complex128}
# (shape of the data before the kinds are laid out, axes): columns (eight-lane vectors and a
# scalar tail; "lanes": the kinds three times, through sixteen-lane vectors where the
# machine has AVX-512), long rows (read as eight columns) and short ones (bins), non-adjacent
# reduced axes (transposed first), and more rows than the window sums hold between spills
# (2**15).
NATIVE_LAYOUTS = {
    "columns": 700,
    "lanes": 700,  # every kind in a group of 16 columns, in one of 8 and in the scalar tail
    "long_rows": 700,
    "short_rows": 100,
    "3d": 96,
    "spill": 33000,
}
NATIVE_CASES = [("float32", lay) for lay in NATIVE_LAYOUTS]  # (CI budget: about 1 s each)
NATIVE_CASES += [("float16", "long_rows"), ("float16", "spill"), ("bfloat16", "columns")]
NATIVE_CASES += [("complex64", "columns"), ("complex64", "long_rows")]
NATIVE_CASES += [("float64", "columns"), ("float64", "short_rows"), ("complex128", "3d")]


def _native_data(dtype, layout, seed):
    x, _ = _data(NATIVE_DTYPES[dtype], NATIVE_LAYOUTS[layout], 0, seed)  # [n, kinds]
    if layout in ("long_rows", "short_rows"):
        return x.T.copy(), (1,)
    if layout == "3d":  # [4, kinds, 24] reduced over (0, 2)
        return x.reshape(4, 24, -1).transpose(0, 2, 1).copy(), (0, 2)
    if layout == "lanes":  # 27 columns: 16 in one vector (AVX-512), 8 in another, 3 scalar
        return np.tile(x, (1, 3)), (0,)
    return x, (0,)


@pytest.mark.parametrize(
    "dtype,layout", NATIVE_CASES, ids=[f"{d}-{lay}" for d, lay in NATIVE_CASES]
)
def test_native_state_gives_the_state_of_every_elements_digits(dtype, layout):
    """The native kernel's state (TF op in eager mode, JAX FFI call under jit) is the state
    of every element's digits, bit for bit, for every dtype and layout."""
    x, axes = _native_data(dtype, layout, 21)
    with jax.enable_x64(x.dtype in (np.float64, np.complex128)):  # JAX keeps float64 data
        want = np.asarray(jax_state._state_values(jnp.asarray(x), None, axes, False))
        native = jax.jit(lambda v: jax_kernel.moments_state(v, axes).values)
        assert (jax_native.STATE_TARGET in native.lower(x).as_text()) is NATIVE_JAX
        np.testing.assert_array_equal(np.asarray(native(x)), want, err_msg="JAX native")
    if dtype != "bfloat16":  # TensorFlow: numpy dtypes
        got = tf_stable_moments.moments_state(x, list(axes)).values.numpy()
        np.testing.assert_array_equal(got, want, err_msg="TF native op")


def test_native_state_is_chosen_per_platform_and_never_exported():
    """The native kernel serves the CPU: a TF graph holds the StableState op (none under
    `portable`), a TF XLA computation its custom call; a JAX computation lowered for the
    CPU holds the FFI call, one exported for CPU and CUDA holds none and gives the same
    bits; vmap batches it."""
    x = np.random.default_rng(5).normal(1e3, 1, [300, 3, 2]).astype(np.float32)
    fn = tf.function(lambda v: tf_stable_moments.moments_state(v, [0]).values)
    spec = tf.TensorSpec(x.shape, tf.float32)
    ops = {op.type for op in fn.get_concrete_function(spec).graph.get_operations()}
    assert ("StableState" in ops) is NATIVE_TF
    with tf_stable_moments.portable():
        fn = tf.function(lambda v: tf_stable_moments.moments_state(v, [0]).values)
        ops = {op.type for op in fn.get_concrete_function(spec).graph.get_operations()}
    assert not any(t.startswith("Stable") for t in ops), ops
    # Inside a user's XLA computation: the native kernel as a custom call, the same bits.
    xla = tf.function(lambda v: tf_stable_moments.moments_state(v, [0]).values, jit_compile=True)
    graph = xla.get_concrete_function(spec).graph
    targets = {
        op.get_attr("call_target_name")
        for op in graph.get_operations()
        if op.type == "XlaCustomCallV2"
    }
    assert targets == ({b"tf_stable_moments_state"} if NATIVE_TF else set()), targets
    np.testing.assert_array_equal(
        xla(x).numpy(), tf_stable_moments.moments_state(x, [0]).values.numpy()
    )
    state = jax.jit(lambda v: jax_kernel.moments_state(v, 0).values)
    exported = jax.export.export(state, platforms=("cpu", "cuda"))(x)
    assert jax_native.STATE_TARGET not in exported.mlir_module()
    want = np.asarray(state(x))
    np.testing.assert_array_equal(np.asarray(exported.call(x)), want)
    batched = jax.vmap(lambda v: jax_kernel.moments_state(v, 0).values, in_axes=2)(x)
    np.testing.assert_array_equal(np.asarray(batched), np.moveaxis(want, 1, 0))


def test_native_state_splits_long_slices_between_threads_with_the_same_bits():
    """A slice of 2**20 + 3 float32 inputs, 3 columns of 2**19 + 5 rows and 20 of
    2**16 + 5 (fewer work items than threads: the rows are cut into chunks, all columns
    in each, summed apart and added), and 200 columns of 2**13 + 1 rows (items of 64
    columns), a NaN and ranges beyond the window included: the native state (TF op, JAX
    FFI) is the XLA one pass's, bit for bit."""
    rng = np.random.default_rng(17)
    for shape in ((2**20 + 3,), (2**19 + 5, 3), (2**16 + 5, 20), (2**13 + 1, 200)):
        x = rng.normal(1e3, 1, shape) * rng.choice(
            [1.0, 1e-30, 1e20, 0.0], shape, p=[0.7] + [0.1] * 3
        )
        x = x.astype(np.float32)
        x.reshape(-1)[12345] = np.nan
        want = np.asarray(jax_state._state_values(jnp.asarray(x), None, (0,), True))
        got = tf_stable_moments.moments_state(x, [0]).values.numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"TF {shape}")
        np.testing.assert_array_equal(
            np.asarray(jax_kernel.moments_state(x, 0).values), want, err_msg=f"JAX {shape}"
        )
