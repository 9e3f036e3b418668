"""Accuracy against the exact oracle and bitwise identity across every mode."""

import functools

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
def test_the_exact_paths_integer_steps_match_python_integers(backend):
    """normalise carries without changing the value; divide by two divisors in one loop
    gives floor(v / (a b)) and whether a remainder is left (moments_core/_exact.py)."""
    rng = np.random.default_rng(3)
    raw = rng.integers(-(2**62), 2**62, (12, 9))
    raw[:4, :-1] = 0xFFFF  # carries that ripple through every digit
    raw[:4, 0] = [1, 0x10000, -1, 0]
    num = rng.integers(0, 2**16, (12, 9))
    num[:, -1] = rng.integers(0, 3, 12)
    a, b = rng.integers(1, 2**46, 12), rng.integers(1, 2**46, 12)
    a[:3], b[:3] = 1, [1, 2, 3]
    ops, wrap = (jax_ops, jnp.asarray) if backend == "jax" else (tf_ops.PLAIN, tf.constant)
    with jax.enable_x64(backend == "jax"):
        norm = np.asarray(_exact.normalise(ops, wrap(raw)))
        q, inexact = _exact.divide(ops, wrap(num), [wrap(a), wrap(b)])
        q, inexact = np.asarray(q), np.asarray(inexact)
    for i in range(12):
        assert _digit_value(norm[i]) == _digit_value(raw[i])
        assert ((norm[i, :-1] >= 0) & (norm[i, :-1] < 2**16)).all()
        v, d = _digit_value(num[i]), int(a[i]) * int(b[i])
        assert _digit_value(q[i]) == v // d
        assert bool(inexact[i]) == (v % d != 0)
