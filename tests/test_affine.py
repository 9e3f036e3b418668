"""moments_core/_affine.py: the layers' output formulas against exact rational
arithmetic, in every way they run (docs/algorithm.md section 14).

Each formula's value is defined exactly (RN32: to the nearest float32, ties to even;
RN64 likewise for float64): rsqrt32 = RN32(v**-1/2), div32 = RN32(a / s), times32 =
RN32(a b), affine32 = RN32(RN64(r f + b)), blend32 = RN32(RN64(a wa + b wb)), round32 =
RN32.  The oracle computes those values with Python fractions; every mode (JAX eager
and jit, TF eager, tf.function and jit_compile) must give them bit for bit.
"""

import math
from fractions import Fraction

import jax
import numpy as np
import pytest
import tensorflow as tf

from jax_kernel import _ops as jax_ops
from moments_core import _affine
from tf_stable_moments._ops import PLAIN as tf_ops

MODES = ("jax_eager", "jax_jit", "tf_eager", "tf_function", "tf_jit_compile")
_rng = np.random.default_rng(27)
N = 1500


def _f32(values):
    return np.asarray(values, np.float64).astype(np.float32)


def _positive():
    """Variances and scales: near 1, spread over the float32 normal range, and exact
    powers of two and squares (where 1/sqrt is exact)."""
    values = np.concatenate(
        [
            _f32(_rng.uniform(0, 4, N)),
            _f32(2.0 ** _rng.uniform(-120, 120, N)),
            _f32([1, 4, 0.25, 2, 0.5, 9, 2.0**-100, 2.0**100, 1 + 2**-23]),
        ]
    )
    return values[values > 2.0**-126]


def _signed(scale=1.0):
    values = _rng.normal(0, scale, 2 * N) * 2.0 ** _rng.integers(-20, 20, 2 * N)
    return _f32(values)


def _nearest_float32(q):
    """RN32 of a rational q (normal range): the nearest of the float32 values around
    float32(float(q)) (float(q) is correctly rounded, but float32 of it may double round)."""
    t = np.float32(float(q))
    candidates = [np.nextafter(t, np.float32(-np.inf)), t, np.nextafter(t, np.float32(np.inf))]
    return min(candidates, key=lambda c: abs(Fraction(float(c)) - q))


def _oracle_rsqrt(v):
    out = []
    for x in v:
        t = np.float32(1 / math.sqrt(float(x)))
        below, above = np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))
        m_low = (Fraction(float(below)) + Fraction(float(t))) / 2
        m_high = (Fraction(float(t)) + Fraction(float(above))) / 2
        x = Fraction(float(x))
        # 1/sqrt(x) > m  <=>  m**2 x < 1
        out.append(above if m_high**2 * x < 1 else below if m_low**2 * x > 1 else t)
    return np.array(out, np.float32)


def _oracle_div(a, s):
    return np.array(
        [_nearest_float32(Fraction(float(x)) / Fraction(float(y))) for x, y in zip(a, s)],
        np.float32,
    )


def _oracle_affine(r, f, b):
    """RN32(RN64(r f + b)): float() of a Fraction is correctly rounded (RN64), numpy's
    float64 -> float32 conversion is RN32."""
    exact = (
        Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)) for x, y, z in zip(r, f, b)
    )
    return np.array([np.float32(float(q)) for q in exact], np.float32)


def _oracle_blend(a, wa, b, wb):
    pairs = zip(a, wa, b, wb)
    exact = (
        Fraction(float(p)) * Fraction(float(q)) + Fraction(float(u)) * Fraction(float(w))
        for p, q, u, w in pairs
    )
    return np.array([np.float32(float(q)) for q in exact], np.float32)


def _run(mode, fn, *arrays):
    """fn(ops, *arrays) in one mode, as numpy."""
    if mode.startswith("jax"):
        with jax.enable_x64(True):
            run = (lambda *a: fn(jax_ops, *a)) if mode == "jax_eager" else None
            run = run or jax.jit(lambda *a: fn(jax_ops, *a))
            return np.asarray(run(*arrays))
    tensors = [tf.constant(a) for a in arrays]
    if mode == "tf_eager":
        return fn(tf_ops, *tensors).numpy()
    compiled = tf.function(lambda *a: fn(tf_ops, *a), jit_compile=mode == "tf_jit_compile")
    return compiled(*tensors).numpy()


def _assert_bits(result, expected):
    assert result.dtype == np.float32
    differing = np.flatnonzero(result.view(np.uint32) != expected.view(np.uint32))
    assert differing.size == 0, (differing[:5], result[differing[:5]], expected[differing[:5]])


@pytest.mark.parametrize("mode", MODES)
def test_rsqrt32_is_correctly_rounded(mode):
    v = _positive()
    _assert_bits(_run(mode, _affine.rsqrt32, v), _oracle_rsqrt(v))


@pytest.mark.parametrize("mode", MODES)
def test_div32_and_recip32_are_correctly_rounded(mode):
    a, s = _signed(), _signed()
    _assert_bits(_run(mode, _affine.div32, a, s), _oracle_div(a, s))
    ones = np.ones_like(s)
    _assert_bits(_run(mode, _affine.recip32, s), _oracle_div(ones, s))


@pytest.mark.parametrize("mode", MODES)
def test_times_affine_blend_have_their_defined_roundings(mode):
    r, f, b = _signed(), _signed(), _signed(0.1)
    exact_products = (r.astype(np.float64) * f).astype(np.float32)  # exact, then RN32
    _assert_bits(_run(mode, _affine.times32, r, f), exact_products)
    _assert_bits(_run(mode, _affine.affine32, r, f, b), _oracle_affine(r, f, b))
    wa, wb = np.full_like(r, np.float32(0.99)), np.full_like(r, np.float32(1.0 - 0.99))
    _assert_bits(_run(mode, _affine.blend32, r, wa, b, wb), _oracle_blend(r, wa, b, wb))


@pytest.mark.parametrize("mode", MODES)
def test_round32_rounds_to_nearest_even(mode):
    """On the encoding: ties (exact float32 midpoints), carries into the next binade and
    past the float32 range (inf), infinities and NaN."""
    k = _rng.integers(0, 2**23, N).astype(np.float64)
    ties = (2.0**23 + k + 0.5) * 2.0 ** _rng.integers(-100, 100, N).astype(np.float64)
    top = float(np.finfo(np.float32).max)
    special = [np.inf, -np.inf, 0.0, -0.0, top, top * (1 + 2**-25), top * (1 + 2**-23), 2 - 2**-30]
    a = np.concatenate([_rng.normal(0, 1e3, N), ties, -ties, special])
    with np.errstate(over="ignore"):
        expected = a.astype(np.float32)
    _assert_bits(_run(mode, lambda ops, x: _affine.round32(ops, x), a), expected)
    nan = _run(mode, lambda ops, x: _affine.round32(ops, x), np.array([np.nan]))
    assert np.isnan(nan).all()


@pytest.mark.parametrize("mode", MODES)
def test_special_values(mode):
    """0, inf, negative and NaN operands give what the plain expressions give."""
    v = np.array([0, np.inf, -1, np.nan], np.float32)
    rsqrt = _run(mode, _affine.rsqrt32, v)
    np.testing.assert_array_equal(rsqrt, np.array([np.inf, 0, np.nan, np.nan], np.float32))
    recip = _run(mode, _affine.recip32, v)
    np.testing.assert_array_equal(recip, np.array([np.inf, 0, -1, np.nan], np.float32))


def test_plain_multiply_add_is_contracted_under_xla():
    """The hazard the formulas remove, on this machine: XLA evaluates r * f + b in float32
    with one rounding (a fused multiply-add) where eager TensorFlow rounds twice."""
    r, f, b = _signed(), _signed(), _signed(0.1)
    tensors = [tf.constant(a) for a in (r, f, b)]
    eager = (tensors[0] * tensors[1] + tensors[2]).numpy()
    xla = tf.function(lambda r, f, b: r * f + b, jit_compile=True)(*tensors).numpy()
    assert np.count_nonzero(eager.view(np.uint32) != xla.view(np.uint32)) > 0


# ------------------------------------------- the native CPU ops (stable_moments_op.cc)
def _native_scale_shift_cases():
    """(name, r, v, gamma, beta, shared): the layers' layouts (BN per channel, BN with
    channels first, LN per sample, no gamma, no beta), operands with the sign of zero,
    subnormals, infinities and NaN among them."""
    special = _f32([0, -0.0, 1e-45, -1e-45, 1e-40, 2.0**-126, 1, 3, 1e30, 3e38])
    special = np.concatenate([special, _f32([np.inf, -np.inf, np.nan, -1, 2.5e-30])])
    r = np.concatenate([special, _signed()[: 16 * 64 - special.size]]).reshape(16, 4, 16)
    v = np.concatenate([_f32([0, 1e-45, np.inf, np.nan, -1]), _positive()[:11]])
    g, b = _signed()[:16], np.concatenate([special[:6], _signed(0.1)[:10]])
    per_sample = _positive()[:16].reshape(16, 1, 1)
    return [
        ("bn", r, v, g, b, True),
        (
            "bn_channels_first",
            r.transpose(0, 2, 1).copy(),
            v[:, None],
            g[:, None],
            b[:, None],
            True,
        ),
        ("bn_no_gamma", r, v, None, b, True),
        ("bn_no_beta", r, v, g, None, True),
        ("ln", r, per_sample, g, b, False),
        ("ln_no_beta", r, per_sample, g, None, False),
        ("ln_no_gamma", r, per_sample, None, b, False),
    ]


@pytest.mark.parametrize("case", _native_scale_shift_cases(), ids=lambda c: c[0])
def test_native_formula_ops_give_the_xla_formulas_bits(case):
    """Outside XLA on the CPU the layers run StableScaleShift and StableBlend (one op each,
    nothing compiled per shape): every bit (NaN's too) that of the formulas compiled by
    XLA, which test_times_affine_blend_have_their_defined_roundings ties to the oracle."""
    from tf_stable_moments import _native, _output

    _, r, v, g, b, shared = case
    args = [None if a is None else tf.constant(a) for a in (r, v, g, b)]
    native = _native.formula_op("scale_shift", args[0])
    assert (native is not None) == (_native.op() is not None)  # served where it exists
    eager = _output.scale_shift(*args, shared=shared).numpy()
    xla = tf.function(lambda *a: _output.scale_shift(*a, shared=shared), jit_compile=True)
    np.testing.assert_array_equal(eager.view(np.uint32), xla(*args).numpy().view(np.uint32))
    from jax_kernel import _output as jax_output  # JAX composes the same formulas

    jax_args = [None if a is None else jax.numpy.asarray(a) for a in (r, v, g, b)]
    jitted = jax.jit(lambda *a: jax_output.scale_shift(*a, shared=shared))
    np.testing.assert_array_equal(
        eager.view(np.uint32), np.asarray(jitted(*jax_args)).view(np.uint32)
    )
    a, c = args[0], tf.reverse(args[0], [0])
    blend_eager = _output.blend(a, 0.9, c, 0.1).numpy()
    blend_xla = tf.function(lambda a, c: _output.blend(a, 0.9, c, 0.1), jit_compile=True)
    np.testing.assert_array_equal(
        blend_eager.view(np.uint32), blend_xla(a, c).numpy().view(np.uint32)
    )


def test_native_scale_shift_rejects_operands_that_do_not_broadcast():
    from tf_stable_moments import _native

    x = tf.ones([4, 3])
    op = _native.formula_op("scale_shift", x)
    if op is None:  # native kernel off: the layers take the XLA formulas (tested above)
        assert _native.op() is None
        return
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"operand 1 of shape \[2\]"):
        op(x, tf.ones([2]), tf.ones([]), tf.ones([]), has_gamma=False, has_beta=False, shared=True)
