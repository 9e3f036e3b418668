"""Accuracy against the exact oracle and bitwise identity across every mode."""

import functools
from fractions import Fraction

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rounding_fixtures
import tensorflow as tf
from modes import CHEAP_MODES, SLICE_MODES, XLA_MODES, assert_oracle, bits, run, stacked_oracle

from jax_kernel import _ops as jax_ops
from moments_core import _exact
from tf_stable_moments import _ops as tf_ops
from tf_stable_moments._oracle import exact_moments, exact_value

DATA = datasets.all_datasets()
F32_EPS = 2.0**-24
CASES = [(n, m) for n in sorted(DATA) for m in SLICE_MODES]
# The modes that compile per shape (seconds each on 2 cores) get the data sets' slices
# stacked as rows of one array per slice length (as tests/test_certification.py does
# for the rounding fixtures): one compilation per group.  The CI budget allows the
# groups that hold these data sets (both layouts, the extremes of offset and spread,
# large n, specials, several axes), and every other data set of the same slice length.
XLA_DATA = (
    "D2",
    "offset_1e+38",
    "n_65537",
    "cancelling_large",
    "huge_overflowing_variance",
    "axes_0_2_strided",
)
XLA_GROUPS = {
    key: group
    for key, group in rounding_fixtures.stacked(
        {k: (x, axes, 0) for k, (x, axes, _) in DATA.items()}
    ).items()
    if set(group[1]) & set(XLA_DATA)
}
MODES = CHEAP_MODES + XLA_MODES


@functools.cache
def oracle(name):
    x, axes, _ = DATA[name]
    rows = datasets.slices(x, axes)
    out = [exact_moments(r, np.float32) for r in rows]
    shape = [x.shape[a] for a in range(x.ndim) if a not in axes]
    mean = np.array([m for m, _ in out], np.float32).reshape(shape)
    var = np.array([v for _, v in out], np.float32).reshape(shape)
    return mean, var


@functools.cache
def result(name, mode):
    x, axes, _ = DATA[name]
    return run(mode, x, axes)


@pytest.mark.parametrize("name, mode", CASES)
def test_variance_correctly_rounded(name, mode):
    _, var = result(name, mode)
    _, exact = oracle(name)
    wrong = np.flatnonzero(bits(var).ravel() != bits(exact).ravel())
    assert wrong.size == 0, (
        f"{wrong.size} slices not correctly rounded, e.g. "
        f"{var.ravel()[wrong[:3]]} vs {exact.ravel()[wrong[:3]]}"
    )


@pytest.mark.parametrize("name, mode", CASES)
def test_mean_correctly_rounded(name, mode):
    mean, _ = result(name, mode)
    exact, _ = oracle(name)
    wrong = np.flatnonzero(bits(mean).ravel() != bits(exact).ravel())
    assert wrong.size == 0, (
        f"{wrong.size} means not correctly rounded, e.g. "
        f"{mean.ravel()[wrong[:3]]} vs {exact.ravel()[wrong[:3]]}"
    )


@pytest.mark.parametrize("mode", XLA_MODES)
@pytest.mark.parametrize("key", sorted(XLA_GROUPS), ids=rounding_fixtures.group_id)
def test_every_data_set_is_correctly_rounded_under_xla(key, mode):
    rows, names = XLA_GROUPS[key]
    assert_oracle(run(mode, rows, (1,)), stacked_oracle(names, oracle), labels=names)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("value", [1e10, 7.5e10, 1e15, 1e38, -3.4e38, 1e-30], ids=str)
def test_identical_values_give_exactly_zero(value, mode):
    x = datasets.identical(value)
    mean, var = run(mode, x, (0,))
    assert bits(var) == bits(np.float32(0.0))
    assert mean == np.float32(value)


@pytest.mark.parametrize("mode", MODES)
def test_design_note_complex_check(mode):
    z = np.array([1 + 1j, 2 + 3j, -1 + 0.5j, 4 - 2j], np.complex64)
    mean, var = run(mode, z, (0,))
    assert var == np.float32(6.421875) and var.dtype == np.float32
    assert mean == np.complex64(1.5 + 0.625j)


def test_variance_ulp_error_is_at_most_half_on_design_note_data():
    """The acceptance figure: max ulp error of the variance on D1-D4, default mode."""
    from tf_stable_moments._oracle import ulp_error

    worst = 0.0
    for name in ("D1", "D2", "D3", "D4"):
        x, axes, _ = DATA[name]
        _, var = result(name, "tf_eager")
        for row, v in zip(datasets.slices(x, axes), var.ravel()):
            worst = max(worst, ulp_error(v, exact_value(row, np.float32)[1], np.float32))
    assert worst <= 0.5


def _digit_value(row):
    return sum(int(v) << (16 * i) for i, v in enumerate(row))


@pytest.mark.parametrize("backend", ["jax", "tf"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_the_exact_paths_integer_steps_match_python_integers(backend, dtype):
    """normalise carries without changing the value; magnitudes gives |value| and its
    sign; to_float rounds num / (a b) * 2**offset once, as the oracle rounds the
    fraction (moments_core/_exact.py)."""
    from moments_core._formats import FORMATS
    from tf_stable_moments._oracle import round_rational

    fmt = FORMATS[dtype]
    np_dtype = jnp.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(3)
    raw = rng.integers(-(2**62), 2**62, (12, 9))
    raw[:4, :-1] = 0xFFFF  # carries that ripple through every digit
    raw[:4, 0] = [1, 0x10000, -1, 0]
    num = rng.integers(0, 2**16, (16, 9))
    num[:, -1] = rng.integers(0, 3, 16)
    num[8:10, :] = 0  # zero
    num[10, :-1], num[10, -1] = 0, 1  # a power of two
    num[11, :] = [0] * 8 + [0]
    num[11, 0] = 1  # one
    num[12:, :4] = 0  # short numbers
    a, b = rng.integers(1, 2**46, 16), rng.integers(1, 2**46, 16)
    a[:3], b[:3] = 1, [1, 2, 3]
    a[12:], b[12:] = [3, 5, 7, 1], [1, 1, 9, 1]
    num[15] = [0, 0, 0, 0, 0, 1, 0x8000, 0, 0]  # a tie after division by 1
    num[15, 0] = 0
    offset = rng.integers(-300, 100, 16) if fmt.precision == 53 else rng.integers(-160, -40, 16)
    negative = rng.integers(0, 2, 16).astype(bool)
    ops, wrap = (jax_ops, jnp.asarray) if backend == "jax" else (tf_ops.PLAIN, tf.constant)
    with jax.enable_x64(backend == "jax"):
        norm = np.asarray(_exact.normalise(ops, wrap(raw)))
        mag, neg = (np.asarray(v) for v in _exact.magnitudes(ops, wrap(raw)))
        out = _exact.to_float(ops, wrap(num), [wrap(a), wrap(b)], wrap(offset), fmt, wrap(negative))
        out = np.asarray(out)
    for i in range(12):
        value = _digit_value(raw[i])
        assert _digit_value(norm[i]) == value
        assert ((norm[i, :-1] >= 0) & (norm[i, :-1] < 2**16)).all()
        assert _digit_value(mag[i]) == abs(value) and bool(neg[i]) == (value < 0)
        assert ((mag[i, :-1] >= 0) & (mag[i, :-1] < 2**16)).all() and mag[i, -1] >= 0
    width = {16: np.uint16, 32: np.uint32, 64: np.uint64}[fmt.bits]
    signed = {16: np.int16, 32: np.int32, 64: np.int64}[fmt.bits]
    for i in range(16):
        exact = Fraction(_digit_value(num[i]), int(a[i]) * int(b[i])) * Fraction(2) ** int(
            offset[i]
        )
        want = round_rational(-exact if negative[i] else exact, np_dtype)
        want = np.asarray(want, np_dtype).view(width)
        got = np.asarray(out[i]).astype(signed).view(width)
        if exact == 0:  # +0: the sign is set only on a nonzero result
            want = np.asarray(0, width)
        assert got == want, (i, exact)


def _pairs(rng, size):
    """Normalised float64 pairs (h, l), |l| <= u |h|: TwoSum of random values, and values
    whose 26-bit split leaves the largest low halves (the products `two_prod` rounds)."""
    a = rng.normal(size=size) * 2.0 ** rng.integers(-30, 30, size)
    b = rng.normal(size=size) * 2.0 ** rng.integers(-60, -50, size) * a
    h = a + b
    low = b - (h - a)  # exact where |a| >= |b|
    worst = (1.0 + 2.0**-27 * (1.0 - 2.0**-20)) * 2.0 ** rng.integers(-20, 20, size)
    quarter = size // 4
    h[:quarter] = worst[:quarter]
    low[:quarter] = worst[:quarter] * rng.uniform(-1, 1, quarter) * 2.0**-53
    return h, low


@pytest.mark.parametrize("mode", ("jax_eager", "jax_jit"))
def test_pair_arithmetic_within_its_documented_bounds(mode):
    """`df_mul` within 26 u**2 |a b| and `df_add` within 8 u**2 (|a| + |b|) (their
    docstrings count the roundings), against exact rational arithmetic; the sums with
    cancellation (b near -a) included.  Under jit XLA may contract products into fused
    multiply-adds: fewer roundings, the same bounds."""
    from moments_core import _kernel

    rng = np.random.default_rng(2612)
    u2 = Fraction(1, 2**106)
    ah, al = _pairs(rng, 400)
    bh, bl = _pairs(rng, 400)
    ch, cl = -ah * (1.0 + 2.0**-40), -al  # cancellation in the sum
    with jax.enable_x64(True):

        def both(ah, al, bh, bl, ch, cl):
            return (
                _kernel.df_mul(jax_ops, ah, al, bh, bl),
                _kernel.df_add(ah, al, bh, bl),
                _kernel.df_add(ah, al, ch, cl),
            )

        fn = jax.jit(both) if mode == "jax_jit" else both
        out = [tuple(np.asarray(v) for v in pair) for pair in fn(ah, al, bh, bl, ch, cl)]
    products, sums, cancelled = out
    worst_mul = worst_add = Fraction(0)
    for i in range(ah.size):
        a = Fraction(float(ah[i])) + Fraction(float(al[i]))
        b = Fraction(float(bh[i])) + Fraction(float(bl[i]))
        c = Fraction(float(ch[i])) + Fraction(float(cl[i]))
        got = Fraction(float(products[0][i])) + Fraction(float(products[1][i]))
        worst_mul = max(worst_mul, abs(got - a * b) / (u2 * abs(a * b)))
        for (sh, sl), other in ((sums, b), (cancelled, c)):
            got = Fraction(float(sh[i])) + Fraction(float(sl[i]))
            worst_add = max(worst_add, abs(got - (a + other)) / (u2 * (abs(a) + abs(other))))
    assert worst_mul <= 26, float(worst_mul)
    assert worst_add <= 8, float(worst_add)
