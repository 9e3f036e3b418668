"""Every rounding fixture has the property it claims, checked with the exact oracle alone.

No kernel is called.  Midpoints are found here independently of the fixture module: the
oracle's rounded value r and its neighbour towards the exact value (one step of the bit
pattern) bracket the exact value, and their mean is the nearest midpoint.  Small slices
are also checked against a two-pass Fraction formula, independent of the oracle's sums.
"""

import functools
import itertools
import time
from fractions import Fraction

import numpy as np
import pytest
import rounding_fixtures as rf

oracle = rf.oracle
FIXTURES = rf.fixtures()
CLAIMS = rf.claims()
PARTS = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.float64}
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _tiny(dtype):
    return 2.0 ** oracle._INFO[np.dtype(dtype)][1]


def _bits(value, dtype):
    return int(np.array(value, dtype).view(UINT[np.dtype(dtype).itemsize]))


def _from_bits(bits, dtype):
    return np.array(bits, UINT[np.dtype(dtype).itemsize]).view(dtype)[()]


def _value(f, dtype):
    """A float of dtype as a Fraction; inf stands for 2**emax (where rounding goes on overflow)."""
    f = float(f)
    return Fraction(2) ** oracle._INFO[np.dtype(dtype)][2] if f == np.inf else Fraction(f)


def _midpoint(exact, dtype):
    """(r, mid): |exact| rounded once, and the midpoint between r and its neighbour towards it."""
    a = abs(exact)
    r = oracle.round_rational(a, dtype)
    assert float(r) > 0, f"{float(a)} is below the normal range"
    step = 1 if a > _value(r, dtype) else -1
    neighbour = _from_bits(_bits(r, dtype) + step, dtype)
    return r, (_value(r, dtype) + _value(neighbour, dtype)) / 2


def _two_pass(row, dtype, ddof):
    """mean and var of a real slice by the textbook two-pass formula, in Fractions."""
    tiny = _tiny(dtype)
    vals = [Fraction(0) if abs(float(v)) < tiny else Fraction(float(v)) for v in row]
    mean = sum(vals) / len(vals)
    return mean, sum((v - mean) ** 2 for v in vals) / (len(vals) - ddof)


@functools.cache
def exact(name):
    """Per slice: (exact values, rounded values), keyed by stat."""
    x, axes, ddof = FIXTURES[name]
    out = []
    for row in rf.slices(x, axes):
        if x.dtype in PARTS:
            mre, mim, var = oracle.exact_complex_value(row, x.dtype, ddof)
            rre, rim, rvar = oracle.exact_complex_moments(row, x.dtype, ddof)
            out.append({"cmean": ((mre, mim), (rre, rim)), "cvar": (var, rvar)})
        else:
            mean, var = oracle.exact_value(row, x.dtype, ddof)
            rounded = (oracle.round_rational(mean, x.dtype), oracle.round_rational(var, x.dtype))
            if len(row) <= 4000:  # (exact_moments rounds the same values; 2**20 takes seconds)
                assert all(map(_same, oracle.exact_moments(row, x.dtype, ddof), rounded))
            out.append({"mean": (mean, rounded[0]), "var": (var, rounded[1])})
    return out


def _part(dtype):
    return PARTS.get(np.dtype(dtype), np.dtype(dtype))


def _values(name, stat):
    """(exact, rounded) pairs of one stat over all slices; cmean is split into both parts."""
    pairs = [s[stat] for s in exact(name)]
    if stat == "cmean":
        return [(e[i], r[i]) for e, r in pairs for i in (0, 1)]
    return pairs


def _same(a, b):
    a, b = float(a), float(b)
    return (np.isnan(a) and np.isnan(b)) or (a == b and np.signbit(a) == np.signbit(b))


def test_sizes_and_dtypes():
    allowed = {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
    total = 0
    for name, (x, axes, ddof) in FIXTURES.items():
        assert x.dtype.name in allowed, name
        n = int(np.prod([x.shape[a] for a in axes]))
        assert 2 <= n <= 4000 or (name.startswith("huge_n") and n == 2**20), name
        assert 0 <= ddof < n and CLAIMS[name], name
        total += x.nbytes
    assert len(FIXTURES) >= 100 and total < 8 * 2**20
    assert set(FIXTURES) == set(CLAIMS)


def test_enough_near_ties():
    def count(prefix, k_max):
        return sum(
            1
            for name, claims in CLAIMS.items()
            if name.startswith(prefix) and any(c[1] == "near" and c[2] <= k_max for c in claims)
        )

    assert count("var_near_f32", -50) >= 10 and count("mean_near_f32", -50) >= 10
    assert count("var_near_f64", -79) >= 5 and count("mean_near_f64", -79) >= 5
    assert count("var_near_f64", -98) >= 4 and count("mean_near_f64", -98) >= 4


def test_deterministic():
    rf._build.cache_clear()
    again = rf.fixtures()
    for name, (x, axes, ddof) in FIXTURES.items():
        y, axes2, ddof2 = again[name]
        assert axes == axes2 and ddof == ddof2
        np.testing.assert_array_equal(
            x.view(UINT[x.itemsize]) if x.dtype.kind == "f" else x,
            (y.view(UINT[y.itemsize]) if y.dtype.kind == "f" else y),
            err_msg=name,
        )


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_claims(name):
    x, axes, ddof = FIXTURES[name]
    rows = rf.slices(x, axes)
    part = _part(x.dtype)
    if x.dtype not in PARTS and rows.shape[1] <= 64:  # the oracle against a two-pass formula
        for row, s in zip(rows, exact(name)):
            assert _two_pass(row, x.dtype, ddof) == (s["mean"][0], s["var"][0])
    for stat, kind, *arg in CLAIMS[name]:
        values = _values(name, stat)
        if kind == "tie":
            for e, rounded in values:
                r, mid = _midpoint(e, part)
                assert abs(e) == mid, f"{stat} {float(e)} is no midpoint"
                assert _same(abs(rounded), r) and _bits(r, part) % 2 == 0, "not rounded to even"
        elif kind == "near":
            for e, rounded in values:
                r, mid = _midpoint(e, part)
                dist = abs(abs(e) - mid) / mid
                assert 0 < dist < Fraction(2) ** arg[0], f"{stat}: distance {float(dist)}"
                assert _same(abs(rounded), r)
        elif kind == "equals":
            wants = arg[0] if stat == "cmean" else itertools.repeat(arg[0])
            for (_, rounded), want in zip(values, wants):
                assert _same(rounded, want), f"{stat} {rounded!r} != {want!r}"
        elif kind in ("finite", "finite_nonzero"):
            for _, rounded in values:
                assert np.isfinite(float(rounded)), stat
                assert kind == "finite" or float(rounded) != 0, stat
        elif kind in ("exact_lt", "exact_gt"):
            for e, _ in values:
                assert (e < Fraction(float(arg[0]))) == (kind == "exact_lt"), float(e)
        elif kind == "decided_by":
            (i,) = arg
            for row, (e, rounded) in zip(rows, values):
                assert abs(float(row[i])) >= _tiny(x.dtype), "the deciding element is normal"
                zeroed = row.copy()
                zeroed[i] = 0
                e0 = _two_pass(zeroed, x.dtype, ddof)[stat == "var"]
                assert abs(e0) == _midpoint(e0, part)[1], "without it, a tie"
                r0 = oracle.round_rational(e0, part)
                assert e != e0 and not _same(rounded, r0), "it changes the rounding"
        elif kind == "ftz_decides":
            (i,) = arg
            for row, (_, rounded) in zip(rows, values):
                assert 0 < abs(float(row[i])) < _tiny(x.dtype), "the element is subnormal"
                vals = [Fraction(float(v)) for v in row]  # no flushing
                mean = sum(vals) / len(vals)
                raw = (
                    mean
                    if stat == "mean"
                    else sum((v - mean) ** 2 for v in vals) / (len(vals) - ddof)
                )
                assert not _same(oracle.round_rational(raw, part), rounded)
        elif kind == "double_rounding":
            for e, rounded in values:
                twice = np.array(oracle.round_rational(e, np.float32)).astype(part)
                assert _same(oracle.round_rational(e, part), rounded)
                assert not _same(twice, rounded), "rounding via float32 gives the same"
        elif kind == "single_rounding":
            for row, (e, rounded) in zip(rows, values):
                vr = oracle.exact_value(row.real, part, ddof)[1]
                vi = oracle.exact_value(row.imag, part, ddof)[1]
                assert vr + vi == e
                summed = oracle.round_rational(vr, part) + oracle.round_rational(vi, part)
                assert not _same(summed, rounded), "separate roundings give the same"
        elif kind == "imag_decides":
            for row, (_, rounded) in zip(rows, values):
                real_only = oracle.exact_complex_moments(row.real.astype(x.dtype), x.dtype, ddof)
                assert not _same(real_only[2], rounded)
        else:
            raise AssertionError(f"unknown claim {kind}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["var", "mean"])
def test_near_midpoint_slices(dtype, which):
    build = rf.near_midpoint_slice if which == "var" else rf.near_midpoint_mean_slice
    start = time.perf_counter()
    calls = 0
    for seed in range(12):
        for n in (2, 3, 8, 64):
            for ddof in (0, 1) if which == "var" else (0,):
                x = build(seed, dtype, n, ddof) if which == "var" else build(seed, dtype, n)
                calls += 1
                assert x.dtype == dtype and x.shape == (n,)
                mean, var = oracle.exact_value(x, dtype, ddof)
                e = var if which == "var" else mean
                _, mid = _midpoint(e, dtype)
                bound = Fraction(1, 2**40 if dtype == np.float32 else 2**59)
                assert abs(abs(e) - mid) / mid < bound, (seed, n, ddof)
    assert (time.perf_counter() - start) / calls < 0.05
    again = build(5, dtype, 8)
    np.testing.assert_array_equal(again, build(5, dtype, 8))
    assert not np.array_equal(again, build(6, dtype, 8))
