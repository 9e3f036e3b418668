"""moments_core/_affine.py: the layers' output formulas against exact rational
arithmetic, in every way they run (docs/algorithm.md section 14).

Each formula's value is defined exactly (RN32: to the nearest float32, ties to even;
RN64 likewise for float64): rsqrt32 = RN32(v**-1/2), div32 = RN32(a / s), times32 =
RN32(a b), affine32 = RN32(RN64(r f + b)), blend32 = RN32(RN64(a wa + b wb)), round32 =
RN32.  The oracle computes those values with Python fractions; every mode (JAX eager
and jit, TF eager, tf.function and jit_compile) must give them bit for bit.
"""

import functools
import itertools
import math
from fractions import Fraction

import jax
import numpy as np
import pytest
import tensorflow as tf
from datasets import oracle_rsqrt32

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
    _assert_bits(_run(mode, _affine.rsqrt32, v), oracle_rsqrt32(v))


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
def test_every_nan_result_is_the_quiet_nan(mode):
    """NaN inputs of either sign and any payload, and NaNs that the operations make
    (inf * 0, inf - inf, 1/sqrt of a negative), leave every formula as 0x7FC00000: the
    sign and payload of a NaN follow the machine's operand order otherwise."""
    payloads = np.array([0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001], np.uint64)
    a = np.concatenate([payloads.view(np.float64), [np.inf, -np.inf]])
    want = np.full(3, 0x7FC00000, np.uint32)
    got = _run(mode, lambda ops, x: _affine.round32(ops, x), a[:3])
    np.testing.assert_array_equal(got.view(np.uint32), want)
    r, f, b = _f32([np.inf, -np.inf, 1.0]), _f32([0.0, 1.0, -2.0]), _f32([1.0, np.inf, 0.0])
    got = _run(mode, _affine.affine32, r, f, b)  # inf * 0; -inf + inf; 1 * -2 + 0
    np.testing.assert_array_equal(got.view(np.uint32)[:2], want[:2])
    got = _run(mode, _affine.rsqrt32, _f32([-1.0, -np.inf, 4.0]))
    np.testing.assert_array_equal(got.view(np.uint32)[:2], want[:2])


@pytest.mark.parametrize("mode", MODES)
def test_rounded_results_stay_rounded_when_widened(mode):
    """A consumer that widens a formula's float32 result again in the same compiled
    computation (the next layer's statistics) sees the rounded values: XLA removes a
    conversion pair float64 -> float32 -> float64 feeding a reduction ("excess
    precision": a plain conversion here gives a maximum difference of about 3e-7 under
    jax.jit and jit_compile), and `round32`'s select on the encoding stands between the
    two conversions.  A [256, 128] BatchNormalization-shaped output, the difference to
    the values rounded by numpy: 0 in any order."""
    r = _rng.standard_normal((256, 128)).astype(np.float32)
    f, b = (_rng.standard_normal(128).astype(np.float32) for _ in range(2))
    expected = (r.astype(np.float64) * f + b.astype(np.float64)).astype(np.float32)

    def widened(ops, r, f, b, e):
        d = ops.cast(_affine.affine32(ops, r, f, b), "float64") - ops.cast(e, "float64")
        return ops.max(ops.abs(d), 0)

    assert np.max(_run(mode, widened, r, f, b, expected)) == 0.0


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


def test_plain_float64_multiply_add_is_contracted_under_xla():
    """The float64 hazard (docs section 14b): r * f + b differs between TF eager and XLA."""
    r, f, b = (_signed64(), _signed64(), _signed64(0.1))
    tensors = [tf.constant(a) for a in (r, f, b)]
    eager = (tensors[0] * tensors[1] + tensors[2]).numpy()
    xla = tf.function(lambda r, f, b: r * f + b, jit_compile=True)(*tensors).numpy()
    assert np.count_nonzero(eager.view(np.uint64) != xla.view(np.uint64)) > 0


# ------------------------------------------------------------- float64 (section 14b)
def _signed64(scale=1.0):
    return _rng.normal(0, scale, 2 * N) * 2.0 ** _rng.integers(-20, 20, 2 * N)


def _positive64():
    values = np.concatenate(
        [_rng.uniform(0, 4, N), 2.0 ** _rng.uniform(-1000, 1000, N), [1, 4, 0.25, 2, 9, 2.0**-1000]]
    )
    return values[values > 2.0**-1022]


def _split_reference(x, rounded):
    """(h, l): h the leading 26 significant bits of x (truncated toward zero, or rounded
    half to even), l = x - h, with Python's integers."""
    m, e = math.frexp(x)  # x = m 2**e, 1/2 <= |m| < 1
    scaled = Fraction(m) * 2**26
    k = round(scaled) if rounded else math.trunc(scaled)
    h = float(k * Fraction(2) ** (e - 26))
    return h, float(Fraction(x) - Fraction(h))


def _oracle_affine64(r, f, b):
    """The defined float64 formula, evaluated with Python floats (each operation one IEEE
    rounding, nothing contracted): RN(RN(rh fh + b) + RN(RN(rh fl + rl fh) + rl fl))."""
    out = []
    for x, y, z in zip(r.tolist(), f.tolist(), b.tolist()):
        (rh, rl), (fh, fl) = _split_reference(x, False), _split_reference(y, True)
        out.append((rh * fh + z) + ((rh * fl + rl * fh) + rl * fl))
    return np.array(out)


def _oracle_blend64(a, wa, b, wb):
    out = []
    for p, q, u, w in zip(a.tolist(), wa.tolist(), b.tolist(), wb.tolist()):
        (ph, pl), (qh, ql) = _split_reference(p, True), _split_reference(q, True)
        (uh, ul), (wh, wl) = _split_reference(u, True), _split_reference(w, True)
        low_a, low_b = (ph * ql + pl * qh) + pl * ql, (uh * wl + ul * wh) + ul * wl
        out.append((ph * qh + uh * wh) + (low_a + low_b))
    return np.array(out)


def _oracle_rsqrt64(v):
    out = []
    for x in v.tolist():
        t = 1 / math.sqrt(x)
        candidates = [t]
        for _ in range(2):
            candidates = [np.nextafter(candidates[0], 0.0), *candidates]
            candidates.append(np.nextafter(candidates[-1], np.inf))
        for c in candidates:  # 1/sqrt(x) between c's midpoints: m_low**2 x < 1 < m_high**2 x
            low = (Fraction(float(np.nextafter(c, 0.0))) + Fraction(float(c))) / 2
            high = (Fraction(float(c)) + Fraction(float(np.nextafter(c, np.inf)))) / 2
            if low**2 * Fraction(x) < 1 < high**2 * Fraction(x):
                out.append(c)
                break
    assert len(out) == len(v)
    return np.array(out)


_NAMES = itertools.count()


def _run64(mode, fn, *arrays):
    """`_run`, with TensorFlow graphs as the layers run the float64 formulas: an XLA
    computation of their own (tf_stable_moments/_output.py `_run64`).  As plain graph
    operations TensorFlow's graph optimizer regroups their sums (measured: 795 of 3,000
    affine64 results changed under tf.function)."""
    if mode != "tf_function":
        return _run(mode, fn, *arrays)
    from tf_stable_moments import _output

    tensors = [tf.constant(a) for a in arrays]
    name = f"test_{next(_NAMES)}"  # (an id could be reused by the next function)
    return tf.function(lambda *a: _output._run64(name, fn, a))(*tensors).numpy()


def _assert_bits64(result, expected):
    assert result.dtype == np.float64
    differing = np.flatnonzero(result.view(np.uint64) != expected.view(np.uint64))
    assert differing.size == 0, (differing[:5], result[differing[:5]], expected[differing[:5]])


@pytest.mark.parametrize("mode", MODES)
def test_rsqrt64_and_div64_are_correctly_rounded(mode):
    """Float64 correct rounding checked with Python fractions (float(Fraction) is RN64)."""
    v = _positive64()
    _assert_bits64(_run64(mode, _affine.rsqrt64, v), _oracle_rsqrt64(v))
    a, s = _signed64(), _signed64()
    expected = np.array([float(Fraction(x) / Fraction(y)) for x, y in zip(a.tolist(), s.tolist())])
    _assert_bits64(_run64(mode, _affine.div64, a, s), expected)


@pytest.mark.parametrize("mode", MODES)
def test_float64_affine_and_blend_have_their_defined_roundings(mode):
    """affine64 and blend64 in every mode: the defined formula's bits (the hazard above
    does not reach them: every product in them is exact), within an ulp of the exact
    values here; the splits are exact."""
    r, f, b = _signed64(1e3), _signed64(), _signed64(1e3)
    got = _run64(mode, _affine.affine64, r, f, b)
    _assert_bits64(got, _oracle_affine64(r, f, b))
    exact = [Fraction(x) * Fraction(y) + Fraction(z) for x, y, z in zip(r, f, b)]
    ulps = [abs(Fraction(g) - e) / Fraction(float(np.spacing(abs(g)))) for g, e in zip(got, exact)]
    assert max(ulps) <= 1, float(max(ulps))
    wa, wb = np.full_like(r, 0.99), np.full_like(r, 1 - 0.99)
    _assert_bits64(_run64(mode, _affine.blend64, r, wa, b, wb), _oracle_blend64(r, wa, b, wb))
    _assert_bits64(_run64(mode, _affine.times64, r, f), r * f)
    for rounded in (False, True):

        def part(ops, x, i, rounded=rounded):
            return _affine.split64(ops, x, rounded)[i]

        h, l = (_run64(mode, functools.partial(part, i=i), r) for i in (0, 1))
        assert all(Fraction(x) == Fraction(p) + Fraction(q) for x, p, q in zip(r, h, l))


@pytest.mark.parametrize("mode", MODES)
def test_float64_special_values(mode):
    v = np.array([0.0, np.inf, -1.0, np.nan])
    rsqrt = _run64(mode, _affine.rsqrt64, v)
    np.testing.assert_array_equal(rsqrt, np.array([np.inf, 0, np.nan, np.nan]))
    recip = _run64(mode, _affine.div64, np.ones_like(v), v)
    np.testing.assert_array_equal(recip, np.array([np.inf, 0, -1, np.nan]))


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


@pytest.mark.native
@pytest.mark.parametrize("layout", ["bn", "bn_channels_first", "ln"])
def test_native_formula_ops_cut_between_threads_keep_the_bits(layout):
    """Tensors large enough that TensorFlow's thread pool cuts StableScaleShift's and
    StableBlend's rows between its threads (2**20 elements: 2 or 6 cycles an element,
    far above the pool's 10**5 cycles a piece), each piece starting mid-tensor: every
    bit that of the formulas compiled by XLA (the per-channel loop and the strided one)."""
    from tf_stable_moments import _native, _output

    rng = np.random.default_rng(7)
    r = _f32(rng.normal(3.0, 2.0, (64, 128, 128)))
    scales = _f32(rng.uniform(0.5, 2.0, 128))
    g, b = _f32(rng.normal(0, 1, 128)), _f32(rng.normal(0, 1, 128))
    shared = layout != "ln"
    if layout == "bn":
        v = scales
    elif layout == "bn_channels_first":
        r, v, g, b = r.transpose(0, 2, 1).copy(), scales[:, None], g[:, None], b[:, None]
    else:  # per sample, the LayerNormalization case (the strided loop)
        v = _f32(rng.uniform(0.5, 2.0, (64, 1, 1)))
    args = [tf.constant(a) for a in (r, v, g, b)]
    assert _native.formula_op("scale_shift", args[0]) is not None
    eager = _output.scale_shift(*args, shared=shared).numpy()
    xla = tf.function(lambda *a: _output.scale_shift(*a, shared=shared), jit_compile=True)
    _assert_bits(eager, xla(*args).numpy())
    a, c = args[0], tf.reverse(args[0], [0])
    blend_xla = tf.function(lambda a, c: _output.blend(a, 0.9, c, 0.1), jit_compile=True)
    _assert_bits(_output.blend(a, 0.9, c, 0.1).numpy(), blend_xla(a, c).numpy())


@pytest.mark.native
def test_native_rsqrt_custom_call_is_correctly_rounded():
    """Under jit_compile on the CPU the layers take the per-channel t = rsqrt32(var + eps)
    of their output formulas from one custom call (tf_stable_moments_rsqrt): the oracle's
    bits, and those of the formula compiled by XLA on special values (NaN's too)."""
    from tf_stable_moments import _native

    assert _native.xla_available()  # loads the library, which registers the call
    call = tf.function(_native.xla_rsqrt, jit_compile=True)
    v = _positive()
    _assert_bits(call(tf.constant(v)).numpy(), oracle_rsqrt32(v))
    special = _f32([0, -0.0, 1e-45, 1e-40, 2.0**-126, 1, np.inf, -np.inf, -1, np.nan, 3e38])
    _assert_bits(
        call(tf.constant(special.reshape(1, -1))).numpy().reshape(-1),
        _run("jax_jit", _affine.rsqrt32, special),
    )


@pytest.mark.native
def test_jax_native_rsqrt_ffi_call_is_correctly_rounded():
    """On JAX the layers' t = rsqrt32(var + eps) (jax_kernel._output) is one FFI call in a
    computation lowered for the CPU (StableRsqrt, moments.h `rsqrt32`): the oracle's bits,
    and those of the XLA formula on special values (NaN's too), jitted, eagerly, under
    disable_jit and vmap; lowered for a device or exported, the XLA formula."""
    from jax_kernel import _native as jax_native
    from jax_kernel import _output as jax_output

    jitted = jax.jit(jax_output.rsqrt)
    assert f"@{jax_native.RSQRT_TARGET}" in jitted.trace(np.ones(3, np.float32)).lower().as_text()
    v = _positive()
    _assert_bits(np.asarray(jitted(v)), oracle_rsqrt32(v))
    special = _f32([0, -0.0, 1e-45, 1e-40, 2.0**-126, 1, np.inf, -np.inf, -1, np.nan, 3e38, 4])
    want = _run("jax_jit", _affine.rsqrt32, special)
    _assert_bits(np.asarray(jitted(special)), want)
    _assert_bits(np.asarray(jax_output.rsqrt(jax.numpy.asarray(special))), want)
    with jax.disable_jit():
        _assert_bits(np.asarray(jax_output.rsqrt(jax.numpy.asarray(special))), want)
    _assert_bits(np.asarray(jax.vmap(jitted)(special.reshape(3, 4))).reshape(-1), want)
    for platforms in (("cuda",), ("tpu",)):
        lowered = jitted.trace(special).lower(lowering_platforms=platforms).as_text()
        assert "custom_call" not in lowered, platforms
    exported = jax.export.export(jitted, platforms=("cpu", "cuda"))(special)
    assert "custom_call" not in exported.mlir_module()
    _assert_bits(np.asarray(exported.call(special)), want)


def test_native_scale_shift_rejects_operands_that_do_not_broadcast():
    from tf_stable_moments import _native

    x = tf.ones([4, 3])
    op = _native.formula_op("scale_shift", x)
    if op is None:  # native kernel off: the layers take the XLA formulas (tested above)
        assert _native.op() is None
        return
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"operand 1 of shape \[2\]"):
        op(x, tf.ones([2]), tf.ones([]), tf.ones([]), has_gamma=False, has_beta=False, shared=True)
