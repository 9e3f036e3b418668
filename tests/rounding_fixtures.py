"""Adversarial rounding fixtures: data whose exact mean or variance sits on or next to a
rounding boundary of its format, where only a correctly rounded result passes.

`fixtures()` maps a readable name to ``(array, axes, ddof)``; `claims()` maps the same
names to what each fixture is built to be, and tests/test_rounding_fixtures_selfcheck.py
verifies every claim with the exact oracle (tf_stable_moments/_oracle.py) alone.  A
rounding midpoint is the number halfway between two adjacent floats of the format; a
*tie* is an exact value equal to one (round-half-even decides it), a *near-tie* one
within a relative distance 2**-k of one (a result computed to fewer than k bits cannot
decide it).

Everything is built deterministically from fixed seeds by exact constructions (integer
searches, an integer square root, and "tuning" elements: elements set one after another,
each about 2**-p of the previous one, so that the exact statistic lands at a chosen
distance from a midpoint); nothing is stored on disk (the data depend on numpy's
default_rng streams; the self-check would catch a change).  Building all fixtures takes
about a second.  `near_midpoint_slice` and `near_midpoint_mean_slice` build one such
slice from a seed, for property tests.

The oracle is loaded from its file, so that this module does not import TensorFlow.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
import zlib
from fractions import Fraction
from pathlib import Path

import numpy as np


def _load_oracle():
    name = "tf_stable_moments._oracle"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "tf_stable_moments" / "_oracle.py"
    spec = importlib.util.spec_from_file_location("_rounding_fixtures_oracle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


oracle = _load_oracle()

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
C64, C128 = np.dtype(np.complex64), np.dtype(np.complex128)
BF16 = next((d for d in oracle._INFO if d.name == "bfloat16"), None)  # None without ml_dtypes


# ---------------------------------------------------------------- exact helpers


def _info(dtype):
    return oracle._INFO[np.dtype(dtype)]


def _exponent(a):
    """floor(log2(a)) of a positive Fraction."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e - 1 if a < Fraction(2) ** e else e


def slices(x, axes):
    """The slices of x over `axes` as rows: reduced axes moved last, row-major."""
    kept = [a for a in range(x.ndim) if a not in axes]
    n = int(np.prod([x.shape[a] for a in axes]))
    return np.transpose(x, kept + list(axes)).reshape(-1, n)


def stacked(named):
    """{(dtype name, n, ddof): (rows [m, n], the name of each row)} of named (x, axes, ddof).

    The slices of all entries with one dtype, slice length and ddof, stacked as rows of
    one array (reduce it over axis 1): one XLA compilation per group.
    """
    groups = {}
    for name in sorted(named):
        x, axes, ddof = named[name]
        rows = slices(x, axes)
        key = (np.dtype(x.dtype).name, rows.shape[1], ddof)
        groups.setdefault(key, []).append((rows, [name] * rows.shape[0]))
    return {
        key: (np.concatenate([r for r, _ in parts]), [n for _, names in parts for n in names])
        for key, parts in groups.items()
    }


def group_id(key):
    dtype, n, ddof = key
    return f"{dtype}-n{n}-ddof{ddof}"


def exact_stats(values, dtype=None, ddof=0):
    """(mean, var) of one real slice as Fractions, inputs flushed as the oracle does."""
    values = np.asarray(values)
    return oracle.exact_value(values, dtype or values.dtype, ddof)


def _nearest_midpoint(value, dtype):
    """The rounding midpoint of `dtype` nearest to |value| (a normal-range Fraction)."""
    p, emin, _ = _info(dtype)
    a = abs(Fraction(value))
    e = max(_exponent(a), emin)
    ulp = Fraction(2) ** (e - p + 1)
    k = a // ulp
    best = (k + Fraction(1, 2)) * ulp
    if k == 2 ** (p - 1) and e > emin:  # just above a power of two: the one below may be nearer
        below = Fraction(2) ** e - ulp / 4
        if abs(a - below) < abs(a - best):
            best = below
    return best


def midpoint_distance(value, dtype):
    """Signed relative distance (|value| - m) / m to the nearest rounding midpoint m of dtype.

    0 for a tie; positive when |value| lies above the midpoint.
    """
    m = _nearest_midpoint(value, dtype)
    return (abs(Fraction(value)) - m) / m


def is_midpoint(value, dtype):
    """True when the Fraction `value` is exactly halfway between two normal floats of dtype."""
    p, emin, emax = _info(dtype)
    a = abs(Fraction(value))
    if a == 0 or a.denominator & (a.denominator - 1):
        return False
    num = a.numerator
    odd = num >> ((num & -num).bit_length() - 1)
    return odd.bit_length() == p + 1 and Fraction(2) ** emin <= a < Fraction(2) ** emax


def _representable(value, dtype):
    """value (a Fraction) as a float of dtype, or None when it is not one (or not normal)."""
    ftype = np.dtype(dtype).type
    f = ftype(float(value))
    if Fraction(float(f)) != value:
        return None
    if value != 0 and abs(value) < Fraction(2) ** _info(dtype)[1]:
        return None
    return f


def _rng(name):
    return np.random.default_rng(zlib.crc32(name.encode()))


# ---------------------------------------------------------------- searches and constructions


def _var_of_ints(ints, ddof):
    n = len(ints)
    s1, s2 = sum(ints), sum(i * i for i in ints)
    return Fraction(n * s2 - s1 * s1, n * (n - ddof))


def _find_var_tie(rng, dtype, n, ddof, zero_at=None, odd_side=None):
    """Integer data (exact in dtype) whose exact variance is a rounding midpoint.

    odd_side: if "up"/"down", the even neighbour (where the tie rounds) must be the
    lower/upper one, so that a push in that direction changes the rounding.
    """
    p = _info(dtype)[0]
    for _ in range(200_000):
        bits = int(rng.integers(p // 2, p // 2 + 3))
        ints = [int(v) for v in rng.integers(-(2**bits), 2**bits, n)]
        if zero_at is not None:
            ints[zero_at] = 0
        v = _var_of_ints(ints, ddof)
        if not is_midpoint(v, dtype):
            continue
        if odd_side is not None:
            r = Fraction(float(oracle.round_rational(v, dtype)))
            if (odd_side == "up") != (r < v) or sum(ints) == 0:
                continue
        return np.array(ints, dtype)
    raise RuntimeError("no variance tie found")


def _find_mean_tie(rng, dtype, n, zero_at=None, odd_side=None):
    """Data of mixed binary scales (exact in dtype) whose exact mean is a rounding midpoint."""
    p = _info(dtype)[0]
    for _ in range(200_000):
        vals = [
            Fraction(int(rng.integers(2 ** (p - 1), 2**p)) * int(rng.choice([-1, 1, 1])))
            / 2 ** int(rng.integers(0, 4))
            for _ in range(n)
        ]
        if zero_at is not None:
            vals[zero_at] = Fraction(0)
        mean = sum(vals) / n
        if not is_midpoint(mean, dtype):
            continue
        if odd_side is not None:
            r = Fraction(float(oracle.round_rational(mean, dtype)))
            if (odd_side == "up") != (abs(r) < abs(mean)):
                continue
        return np.array([float(v) for v in vals], dtype)
    raise RuntimeError("no mean tie found")


def _near_var_pair(rng, dtype, ddof, bound_log2, accept=None):
    """[a, b] with the exact variance within 2**bound_log2 (relative, nonzero) of a midpoint.

    d = a - b is an integer square root (2p bits) of 2 (2 - ddof) M for a random midpoint
    M; a is d rounded to the format and b the exact remainder, about 2**-p of a.
    """
    p, emin, _ = _info(dtype)
    m = 2 - ddof
    for _ in range(100_000):
        e = int(rng.integers(-8, 12))
        odd = int(rng.integers(2**p, 2 ** (p + 1))) | 1
        target = Fraction(odd) * Fraction(2) ** (e - p)  # a midpoint in [2**e, 2**(e+1))
        x = 2 * m * target
        g = Fraction(2) ** ((_exponent(x) >> 1) - 2 * p + 1)
        root4 = math.isqrt(int(x / (g * g) * 4))
        d = Fraction((root4 + 1) // 2) * g
        a = np.dtype(dtype).type(float(d))
        b = _representable(Fraction(float(a)) - d, dtype)
        if b is None:
            continue
        pair = [a, b] if rng.random() < 0.5 else [b, a]
        if rng.random() < 0.5:
            pair = [-pair[0], -pair[1]]
        x = np.array(pair, dtype)
        v = exact_stats(x, dtype, ddof)[1]
        dist = midpoint_distance(v, dtype)
        if dist != 0 and abs(dist) < Fraction(2) ** bound_log2 and (accept is None or accept(v)):
            return x
    raise RuntimeError("no near-tie pair found")


def _solve_tuner(x, pos, target, stat, dtype, ddof):
    """The real value t of element `pos` (now 0) that puts the exact stat at `target`."""
    mean, var = exact_stats(x, dtype, ddof)
    n = x.size
    if stat == "mean":
        return (target - mean) * n
    m = n - ddof
    s1 = mean * n
    # var(t) - target = a t**2 + b t + c, with the root near 0 (Newton from 0, exact)
    a, b, c = Fraction(n - 1, n * m), -2 * s1 / (n * m), var - target
    t = -c / b
    for _ in range(60):
        step = (a * t * t + b * t + c) / (2 * a * t + b)
        t = Fraction(float(t - step))  # keep the Fractions small
        if abs(step) <= abs(t) * Fraction(1, 2**60):
            break
    return t


def _tuned(x, positions, stat, dtype, ddof, offset=None, target=None):
    """Set x[positions] (each first 0) in turn so the exact stat approaches a midpoint.

    The target is the midpoint M nearest to the stat with all tuners 0, times
    (1 + offset) when an offset (a Fraction) is given.  Each tuner rounds to the
    format, about 2**-p of the previous residual.
    """
    x = np.array(x, dtype)
    x[list(positions)] = 0
    if target is None:
        mean, var = exact_stats(x, dtype, ddof)
        value = mean if stat == "mean" else var
        target = _nearest_midpoint(value, dtype) * (1 if value > 0 else -1)
        if offset is not None:
            target *= 1 + offset
    for pos in positions:
        t = _solve_tuner(x, pos, target, stat, dtype, ddof)
        x[pos] = np.dtype(dtype).type(float(t))
        if x[pos] != 0 and abs(float(x[pos])) < 2.0 ** _info(dtype)[1]:
            x[pos] = 0  # would be flushed: leave it
    return x


def _scaled_below(x, target, ddof, dtype):
    """x times the power of two that puts its exact variance in [target / 4, target)."""
    x = np.asarray(x, np.float64)
    var = exact_stats(x, F64, ddof)[1]
    e = _exponent(Fraction(target) / var)  # var * 2**e in [target / 2, target)
    e -= 1 if e % 2 else 2  # an even power: scale the data by 2**(e / 2)
    return (x * 2.0 ** (e // 2)).astype(dtype)


def _stat(x, stat, dtype, ddof):
    mean, var = exact_stats(x, dtype, ddof)
    return mean if stat == "mean" else var


def _ints_with_value(rng, n, ddof, target, radius):
    """Integers y (|y| <= radius except the last, y[0] = 0) with exact variance `target`.

    The last element solves a quadratic with an integer square root; the others are
    random (vectorised; the sums must fit in int64).
    """
    m = n - ddof
    big_t = n * m * Fraction(target)
    if big_t.denominator != 1:
        raise ValueError("target * n * (n - ddof) must be an integer")
    for _ in range(200):
        ys = rng.integers(-radius, radius + 1, (100_000, n - 1))
        ys[:, 0] = 0
        s1, s2 = ys.sum(axis=1), (ys * ys).sum(axis=1)
        # n (s2 + c^2) - (s1 + c)^2 = n m target: (n-1) c^2 - 2 s1 c + (n s2 - s1^2 - T) = 0
        disc = s1 * s1 - (n - 1) * (n * s2 - s1 * s1 - big_t.numerator)
        r = np.sqrt(np.maximum(disc, 0).astype(np.float64)).astype(np.int64)
        for i in np.flatnonzero(disc >= 0):
            d, y1 = int(disc[i]), int(s1[i])
            root = math.isqrt(d)
            if root * root != d:
                continue
            for num in (y1 + root, y1 - root):
                if num % (n - 1) == 0:
                    return [int(v) for v in ys[i]] + [num // (n - 1)]
        del r
    raise RuntimeError("no integers with that variance found")


# ---------------------------------------------------------------- the fixtures


def _add(out, claims, name, x, axes, ddof, *claim):
    out[name] = (x, tuple(axes), ddof)
    claims[name] = tuple(claim)


def _ties(out, cl):
    """(a) exact ties of the variance and of the mean."""
    _add(out, cl, "var_tie_f32_0_4097", np.array([0, 4097], F32), (0,), 0, ("var", "tie"))
    for dtype, tag in ((F32, "f32"), (F64, "f64")):
        for n in (2, 3, 4, 7):
            for ddof in (0, 1):
                name = f"var_tie_{tag}_n{n}_ddof{ddof}"
                x = _find_var_tie(_rng(name), dtype, n, ddof)
                scale = 2.0 ** int(_rng(name + "s").integers(-40, 40))
                _add(out, cl, name, (x * scale).astype(dtype), (0,), ddof, ("var", "tie"))
        for n in (2, 3, 4, 7):
            name = f"mean_tie_{tag}_n{n}"
            x = _find_mean_tie(_rng(name), dtype, n)
            _add(out, cl, name, x, (0,), 0, ("mean", "tie"))
    # ties on an offset: x = 1e6 + y / 16 (every value exact, same binade), the variance of y/16
    for n, ddof in ((7, 1), (4, 0)):
        name = f"var_tie_f32_n{n}_ddof{ddof}_offset1e6"
        y = _find_var_tie(_rng(name), F32, n, ddof).astype(np.float64)
        _add(out, cl, name, (1e6 + y / 16).astype(F32), (0,), ddof, ("var", "tie"))
    name = "var_tie_f64_n3_ddof0_offset1e15"
    y = _find_var_tie(_rng(name), F64, 3, 0).astype(np.float64)
    _add(out, cl, name, 1e15 + y / 8, (0,), 0, ("var", "tie"))
    # a mean tie on an offset: 1e6 + y/16 with the mean an odd multiple of 2**-5
    name = "mean_tie_f32_n4_offset1e6"
    rng = _rng(name)
    while True:
        y = rng.integers(-4000, 4000, 4)
        x = (1e6 + y / 16).astype(F32)
        if is_midpoint(exact_stats(x)[0], F32):
            break
    _add(out, cl, name, x, (0,), 0, ("mean", "tie"))
    # batched: many tie slices in one array, reduced over different layouts
    name = "var_ties_f32_n3_ddof1_x64slices_axis0"
    rng = _rng(name)
    cols = [_find_var_tie(rng, F32, 3, 1) for _ in range(64)]
    _add(out, cl, name, np.stack(cols, axis=1), (0,), 1, ("var", "tie"))
    name = "var_ties_f64_n4_ddof0_x32slices_axis1"
    rng = _rng(name)
    rows = [_find_var_tie(rng, F64, 4, 0) * 2.0 ** int(rng.integers(-100, 100)) for _ in range(32)]
    _add(out, cl, name, np.stack(rows, axis=0), (1,), 0, ("var", "tie"))
    name = "mean_ties_f32_n4_x6slices_axes02"
    rng = _rng(name)
    sl = [_find_mean_tie(rng, F32, 4) for _ in range(6)]
    x = np.stack(sl, axis=0).reshape(6, 2, 2).transpose(1, 0, 2)  # slice j is x[:, j, :]
    _add(out, cl, name, np.ascontiguousarray(x), (0, 2), 0, ("mean", "tie"))


def _near(out, cl):
    """(b) near-ties: the exact value within 2**-50 (float32) or less of a midpoint.

    float64 cases sit within 2**-80 or less: every float64 value is within 2**-53 of some
    midpoint, so a bound of 2**-50 would say nothing there; below 2**-98 even a
    double-double evaluation (docs/algorithm.md, section 9) cannot decide.
    """
    f32_var_bound = -50
    # pairs found by an integer-square-root search: [a, b], |b| about 2**-24 |a|
    for ddof, letters in ((0, "abc"), (1, "ab")):
        for letter in letters:
            name = f"var_near_f32_pair_ddof{ddof}_{letter}"
            x = _near_var_pair(_rng(name), F32, ddof, f32_var_bound)
            _add(out, cl, name, x, (0,), ddof, ("var", "near", f32_var_bound))
    for ddof, letter in ((0, "a"), (1, "b")):
        name = f"var_near_f64_pair_ddof{ddof}_{letter}"
        x = _near_var_pair(_rng(name), F64, ddof, -100)
        _add(out, cl, name, x, (0,), ddof, ("var", "near", -100))

    # tuned slices: N(mu, sigma) data, the tuners (first 0) set so the exact value lands at
    # M (1 + s 2**-k) for the nearest midpoint M.  (dtype, n, ddof, mu, sigma, tuners, s, k)
    var_cases = [
        (F32, 3, 0, 1.0, 1.0, 2, +1, 51),
        (F32, 3, 1, -5.0, 2.0, 2, -1, 51),
        (F32, 8, 0, 1.0, 1.0, 2, +1, 55),
        (F32, 8, 1, 3.0, 1.0, 2, -1, 60),
        (F32, 16, 0, 100.0, 50.0, 2, -1, 52),
        (F32, 64, 1, -2.0, 1.0, 2, +1, 64),
        (F32, 1000, 0, 1.0, 1.0, 2, -1, 53),
        (F32, 4000, 1, 0.5, 0.25, 2, +1, 70),
        (F64, 3, 0, 1.0, 1.0, 2, +1, 100),
        (F64, 16, 1, 1e3, 1e3, 2, -1, 110),
        (F64, 1000, 0, -1.0, 1.0, 2, +1, 120),
        (F64, 64, 0, 1.0, 1.0, 2, -1, 80),
    ]
    mean_cases = [
        (F32, 3, 1.0, 1.0, 2, +1, 51),
        (F32, 3, -1e3, 10.0, 2, -1, 60),
        (F32, 4, 1.0, 1.0, 2, -1, 52),
        (F32, 5, 1e6, 1.0, 2, +1, 55),
        (F32, 8, 3.0, 1.0, 2, +1, 64),
        (F32, 16, -7.0, 3.0, 2, -1, 51),
        (F32, 100, 1e4, 1.0, 2, +1, 58),
        (F32, 1000, 1.0, 0.1, 2, -1, 53),
        (F32, 4000, 2.0, 1.0, 2, +1, 70),
        (F32, 7, 1e-20, 1e-21, 2, -1, 54),
        (F64, 3, 1.0, 1.0, 2, +1, 100),
        (F64, 7, -1e10, 1.0, 2, -1, 110),
        (F64, 16, 1.0, 1.0, 2, +1, 99),
        (F64, 1000, 1e6, 1.0, 2, -1, 104),
        (F64, 64, 3.0, 1.0, 2, +1, 120),
    ]
    for dtype, n, ddof, mu, sigma, tuners, s, k in var_cases:
        tag = "f32" if dtype == F32 else "f64"
        side = "above" if s > 0 else "below"
        name = f"var_near_{tag}_n{n}_ddof{ddof}_2m{k}_{side}"
        rng = _rng(name)
        x = rng.normal(mu, sigma, n).astype(dtype)
        pos = [int(i) for i in rng.choice(n, tuners, replace=False)]
        x = _tuned(x, pos, "var", dtype, ddof, offset=Fraction(s, 2**k))
        _add(out, cl, name, x, (0,), ddof, ("var", "near", -k + 1))
    for dtype, n, mu, sigma, tuners, s, k in mean_cases:
        tag = "f32" if dtype == F32 else "f64"
        side = "above" if s > 0 else "below"
        name = f"mean_near_{tag}_n{n}_mu{mu:g}_2m{k}_{side}".replace("+", "")
        rng = _rng(name)
        x = rng.normal(mu, sigma, n).astype(dtype)
        pos = [int(i) for i in rng.choice(n, tuners, replace=False)]
        x = _tuned(x, pos, "mean", dtype, 0, offset=Fraction(s, 2**k))
        _add(out, cl, name, x, (0,), 0, ("mean", "near", -k + 1))


def _issue(out, cl):
    """(c) the cases from the issue, with their correctly rounded values."""
    _add(
        out,
        cl,
        "issue_var_f32_1.677e14_-3.59e6",
        np.array([167722113564672.0, -3592536.0], F32),
        (0,),
        0,
        ("var", "equals", np.float32(7.0326774e27)),
    )
    _add(
        out,
        cl,
        "issue_var_f64_4.66e31_4.16e15",
        np.array([4.656686094279298e31, 4159084424402055.0], F64),
        (0,),
        0,
        ("var", "equals", np.float64(5.421181345163544e62)),
        ("mean", "equals", np.float64(2.328343047139649e31)),
    )
    _add(
        out,
        cl,
        "issue_mean_f32_1_-1_1e-20",
        np.array([1.0, -1.0, 1e-20], F32),
        (0,),
        0,
        ("mean", "equals", np.float32(3.3333333e-21)),
    )
    _add(
        out,
        cl,
        "issue_mean_f32_pm1e30_x2_1",
        np.array([1e30, -1e30, 1e30, -1e30, 1.0], F32),
        (0,),
        0,
        ("mean", "equals", np.float32(0.2)),
        ("var", "equals", np.float32(np.inf)),
    )
    z = (1e18 + 1j * 1e-3 * np.array([1, -1, 0.5, 0.25])).astype(C64)
    _add(
        out,
        cl,
        "issue_c64_1e18_imag_1e-3",
        z,
        (0,),
        0,
        ("cvar", "equals", np.float32(5.429688e-07)),
        ("cmean", "equals", (np.float32(1e18), np.float32(1.875e-4))),
    )


def _huge_n():
    """2**20 values N(1e4, 1) in float32, each moved by at most a few ulps so that both the
    exact mean and the exact variance are ties.

    All values lie in [8192, 16384) (ulp 2**-10); with X_i = x_i * 2**10 integers and
    n = 2**20 the mean is S1 * 2**-30 and the variance (n S2 - S1**2) * 2**-60.  One-ulp
    moves of |D| elements make S1 = 2**19 mod 2**20 (mean an odd multiple of 2**-11);
    then moves X_j += 1, X_l -= 1 (S1 unchanged) change the variance by
    (X_j - X_l + 1) * 2**-39, to the nearest midpoint (a multiple of 2**-39).
    """
    rng = _rng("huge_n")
    n = 2**20
    x = rng.normal(1e4, 1.0, n).astype(F32)
    big_x = (x.astype(np.float64) * 1024).astype(np.int64)
    assert big_x.min() >= 8192 * 1024 and big_x.max() < 16384 * 1024
    d = (2**19 - int(big_x.sum())) % 2**20
    d = d - 2**20 if d > 2**19 else d
    idx = rng.choice(n, abs(d), replace=False)
    big_x[idx] += 1 if d > 0 else -1
    s1 = int(big_x.sum())
    assert s1 % 2**20 == 2**19
    hi, lo = big_x >> 12, big_x & 4095
    s2 = (int((hi * hi).sum()) << 24) + (int((hi * lo).sum()) << 13) + int((lo * lo).sum())
    var = Fraction(n * s2 - s1 * s1, 2**60)
    k = (_nearest_midpoint(var, F32) - var) * 2**39
    assert k.denominator == 1
    k = int(k)
    values = {}
    for i in range(0, n, 97):  # a sample of the values: value -> one index
        values.setdefault(int(big_x[i]), i)
    centre = int(np.median(big_x))
    while k:
        step = max(-3000, min(3000, k))  # X_j - X_l + 1 of this move
        diff = step - 1
        for lo_val in range(centre - diff // 2 - 300, centre - diff // 2 + 300):
            j, low = values.get(lo_val + diff), values.get(lo_val)
            if j is not None and low is not None and j != low:
                break
        else:
            raise RuntimeError("no pair found")
        big_x[j] += 1
        big_x[low] -= 1
        values.pop(lo_val + diff)
        values.pop(lo_val, None)
        k -= step
    return (big_x.astype(np.float64) / 1024).astype(F32)


def _hard(out, cl):
    """(d) cases a fast approximation cannot decide."""
    rng = _rng("cancel")
    x = rng.normal(0, 1, 64)
    x[:16] = [1e30, -1e30] * 8  # they cancel exactly: the mean is that of the small ones
    _add(
        out,
        cl,
        "cancel_pm1e30_f32_n64",
        x.astype(F32),
        (0,),
        0,
        ("mean", "finite_nonzero"),
        ("var", "equals", np.float32(np.inf)),
    )
    x = rng.normal(0, 1, (256, 4))
    x[0::4] = 1e15  # 64 of +1e15 and 64 of -1e15 per slice, among N(0, 1) values
    x[1::4] = -1e15
    _add(
        out,
        cl,
        "cancel_pm1e15_f32_256x4",
        x.astype(F32),
        (0,),
        1,
        ("var", "finite"),
        ("mean", "finite_nonzero"),
    )
    x = rng.normal(0, 1, 1000)
    x[::10] = rng.choice([-1e150, 1e150], 100)
    _add(out, cl, "cancel_pm1e150_f64_n1000", x, (0,), 0, ("var", "finite"))
    x = rng.normal(0, 1, 1000)
    x[0] = 1e12
    _add(out, cl, "outlier_first_1e12_f32_n1000", x.astype(F32), (0,), 0, ("var", "finite"))
    x = rng.normal(0, 1, 1000)
    x[0] = 1e100
    _add(out, cl, "outlier_first_1e100_f64_n1000", x, (0,), 1, ("var", "finite"))
    _add(
        out,
        cl,
        "huge_n_f32_2p20_mean_tie_var_tie",
        _huge_n(),
        (0,),
        0,
        ("mean", "tie"),
        ("var", "tie"),
    )

    # a tie with one element 0; that element set to a tiny normal number decides the rounding
    for dtype, tag, stat, ddof, n, tiny_exp in (
        (F32, "f32", "var", 0, 4, -120),
        (F32, "f32", "var", 1, 3, -126),
        (F32, "f32", "mean", 0, 3, -120),
        (F64, "f64", "var", 0, 4, -1020),
        (F64, "f64", "mean", 0, 3, -1022),
    ):
        name = f"{stat}_tie_decided_by_tiny_2m{-tiny_exp}_{tag}_n{n}_ddof{ddof}"
        rng = _rng(name)
        pos = int(rng.integers(n))
        if stat == "var":
            x = _find_var_tie(rng, dtype, n, ddof, zero_at=pos, odd_side="up")
        else:
            x = _find_mean_tie(rng, dtype, n, zero_at=pos, odd_side="up")
        mean = exact_stats(x, dtype, ddof)[0]
        # var moves by (-2 s1 t + (n-1) t^2) / (n m): up when t has the sign opposite to s1
        sign = (-1 if mean > 0 else 1) if stat == "var" else (1 if mean > 0 else -1)
        x[pos] = sign * 2.0**tiny_exp
        below = {F32: -127, F64: -1023}[dtype]  # far below max|x| * 2**(emin - 1)
        assert abs(float(x[pos])) < np.max(np.abs(x)) * 2.0**below
        _add(out, cl, name, x, (0,), ddof, (stat, "decided_by", pos), (stat, "near", -60))
    # the same, with the tiny element about 2**-55 of the others: a near-tie (2**-5x) it decides
    for stat, ddof, n in (("var", 0, 7), ("var", 1, 4), ("mean", 0, 4)):
        name = f"{stat}_near_decided_by_small_f32_n{n}_ddof{ddof}"
        rng = _rng(name)
        pos = int(rng.integers(n))
        if stat == "var":
            x = _find_var_tie(rng, F32, n, ddof, zero_at=pos, odd_side="up")
        else:
            x = _find_mean_tie(rng, F32, n, zero_at=pos, odd_side="up")
        mean = exact_stats(x, F32, ddof)[0]
        sign = (-1 if mean > 0 else 1) if stat == "var" else (1 if mean > 0 else -1)
        x[pos] = sign * 2.0 ** (int(np.floor(np.log2(np.max(np.abs(x))))) - 55)
        _add(out, cl, name, x, (0,), ddof, (stat, "decided_by", pos), (stat, "near", -50))

    # 1e38 next to 1e-38 (1e-38 itself is subnormal in float32: it counts as 0)
    x = np.array([1e38, 2e-38, -1e38, 3e-38, 5e-38, 4e-38, 1e38, -1e38, 1e-38], F32)
    _add(
        out,
        cl,
        "mix_1e38_2e-38_f32_mean_1.55e-38",
        x,
        (0,),
        0,
        ("mean", "finite_nonzero"),
        ("var", "equals", np.float32(np.inf)),
    )
    x = np.array([3e38, 3e38, 3e38, 2e-38, 3.4e38], F32)
    _add(
        out,
        cl,
        "mix_3e38_2e-38_f32_sum_overflows",
        x,
        (0,),
        0,
        ("mean", "finite_nonzero"),
        ("var", "equals", np.float32(np.inf)),
    )
    x = np.array([[1.5e-38, 1e-38, 1.2e-38, 3e-38], [1e38, 1e38, -1e38, 1e38]], F32).T
    _add(out, cl, "mix_1e-38_and_1e38_slices_f32", x, (0,), 0, ("mean", "finite_nonzero"))
    # the overflow boundary: exact variance 2**128 - 2**103 (halfway between the largest
    # float32 and 2**128) rounds to even, i.e. to inf; a little less is the largest float32
    top = Fraction(2**128 - 2**103)
    y = _ints_with_value(_rng("f32_overflow_tie"), 4, 0, top / 2**102, 2**15)
    x = np.array(y, np.float64) * 2.0**51
    _add(
        out,
        cl,
        "var_tie_f32_overflow_boundary_inf",
        x.astype(F32),
        (0,),
        0,
        ("var", "tie"),
        ("var", "equals", np.float32(np.inf)),
    )
    rng = _rng("f32_overflow_near")
    x = _scaled_below(rng.normal(0, 1, 8), top, 1, F32)
    x = _tuned(x, [2, 5, 6], "var", F32, 1, target=top * (1 - Fraction(1, 2**40)))
    _add(
        out,
        cl,
        "var_near_f32_overflow_boundary_max",
        x,
        (0,),
        1,
        ("var", "near", -39),
        ("var", "equals", np.finfo(np.float32).max),
    )
    # the underflow boundary: exact variance just below 2**-126 rounds up to it (not 0);
    # a little lower still rounds below the normal range and is flushed to 0
    tiny = Fraction(2) ** -126
    base = _scaled_below(_rng("f32_tiny_var").normal(0, 1, 16), tiny, 0, F32)
    x = _tuned(base, [3, 9, 12], "var", F32, 0, target=tiny * (1 - Fraction(1, 2**30)))
    _add(
        out,
        cl,
        "var_just_below_tiny_rounds_to_tiny_f32",
        x,
        (0,),
        0,
        ("var", "exact_lt", np.float32(2.0**-126)),
        ("var", "equals", np.float32(2.0**-126)),
    )
    x = _tuned(base, [3, 9, 12], "var", F32, 0, target=tiny * (1 - Fraction(1, 2**20)))
    _add(
        out,
        cl,
        "var_below_tiny_flushed_f32",
        x,
        (0,),
        0,
        ("var", "exact_gt", np.float32(2.0**-127)),
        ("var", "equals", np.float32(0.0)),
    )
    x = np.array([1.5e-38, -1.2e-38, 1.3e-38, -1.4e-38], F32)
    _add(out, cl, "mean_below_tiny_flushed_f32", x, (0,), 0, ("mean", "equals", np.float32(0.0)))
    # a subnormal input counts as zero, and that decides a tie
    rng = _rng("f32_subnormal_decides")
    x = _find_var_tie(rng, F32, 3, 0, zero_at=1, odd_side="up")
    mean = exact_stats(x, F32)[0]
    x[1] = (-1 if mean > 0 else 1) * 1e-40
    _add(
        out,
        cl,
        "var_tie_subnormal_element_flushed_f32",
        x,
        (0,),
        0,
        ("var", "tie"),
        ("var", "ftz_decides", 1),
    )


def _half(out, cl):
    """(e) float16 (and bfloat16, with ml_dtypes): ties, double rounding, overflow."""
    _add(
        out,
        cl,
        "var_tie_f16_0_47",
        np.array([0, 47], F16),
        (0,),
        0,
        ("var", "tie"),
        ("var", "equals", np.float16(552.0)),
    )
    formats = [(F16, "f16")] + ([(BF16, "bf16")] if BF16 is not None else [])
    for dtype, tag in formats:
        for n, ddof in ((3, 1), (4, 0)):
            name = f"var_tie_{tag}_n{n}_ddof{ddof}"
            x = _find_var_tie(_rng(name), dtype, n, ddof)
            _add(out, cl, name, x, (0,), ddof, ("var", "tie"))
        name = f"mean_tie_{tag}_n4"
        x = _find_mean_tie(_rng(name), dtype, 4)
        _add(out, cl, name, x, (0,), 0, ("mean", "tie"))

        # exact value within 2**-25 of a midpoint: float32 rounds it onto the midpoint, and
        # float32 -> dtype then goes the other way than rounding once
        def double(v, dtype=dtype):
            once = oracle.round_rational(v, dtype)
            twice = np.float32(oracle.round_rational(v, F32)).astype(dtype)
            return once != twice

        # (pairs need 2p bits of d = a - b: enough for float16's 11, not bfloat16's 8)
        for ddof, letter in ((0, "a"), (1, "b")) if dtype == F16 else ():
            name = f"var_double_rounding_{tag}_pair_ddof{ddof}_{letter}"
            x = _near_var_pair(_rng(name), dtype, ddof, -25, accept=double)
            _add(out, cl, name, x, (0,), ddof, ("var", "near", -25), ("var", "double_rounding"))
        # tuners: two for float16 (11 bits each), four for bfloat16 (8 bits)
        tuners = [1, 3] if dtype == F16 else [1, 2, 3, 4]
        n = 5 if dtype == F16 else 7
        for ddof in (0,) if dtype == F16 else (0, 1):
            name = f"var_double_rounding_{tag}_n{n}_ddof{ddof}_tuned"
            rng = _rng(name)
            for _ in range(1000):
                x = rng.normal(60, 150, n).astype(dtype)
                off = Fraction(int(rng.choice([-1, 1])), 2**30)
                x = _tuned(x, tuners, "var", dtype, ddof, offset=off)
                v = _stat(x, "var", dtype, ddof)
                if v < 60000 and double(v):
                    break
            else:
                raise RuntimeError("no double-rounding variance found")
            _add(out, cl, name, x, (0,), ddof, ("var", "near", -25), ("var", "double_rounding"))
        name = f"mean_double_rounding_{tag}_n{n}_tuned"
        rng = _rng(name)
        for _ in range(1000):
            x = rng.normal(3000, 100, n).astype(dtype)
            off = Fraction(int(rng.choice([-1, 1])), 2**26)  # the last tuner stays normal
            x = _tuned(x, tuners, "mean", dtype, 0, offset=off)
            if double(_stat(x, "mean", dtype, 0)):
                break
        else:
            raise RuntimeError("no double-rounding mean found")
        _add(out, cl, name, x, (0,), 0, ("mean", "near", -25), ("mean", "double_rounding"))

    _add(
        out,
        cl,
        "var_overflow_f16_pm256",
        np.array([-256, 256], F16),
        (0,),
        0,
        ("var", "equals", np.float16(np.inf)),
        ("mean", "equals", np.float16(0)),
    )
    # exact variance 65520, halfway between 65504 (the largest float16) and 2**16: inf
    # (with n = 4, ddof = 0 there is no integer solution: ddof = 1)
    y = _ints_with_value(_rng("f16_overflow_tie"), 4, 1, Fraction(65520 // 4), 150)
    x = np.array(y, F16) * F16.type(2)
    _add(
        out,
        cl,
        "var_tie_f16_overflow_boundary_inf",
        x,
        (0,),
        1,
        ("var", "tie"),
        ("var", "equals", np.float16(np.inf)),
    )
    x = np.array([65504, 65504, 65504, 65504], F16)
    _add(
        out,
        cl,
        "mean_f16_65504_sum_overflows",
        x,
        (0,),
        0,
        ("mean", "equals", np.float16(65504)),
        ("var", "equals", np.float16(0)),
    )
    # a float16 subnormal input counts as zero, and that decides a tie
    rng = _rng("f16_subnormal_decides")
    x = _find_var_tie(rng, F16, 3, 0, zero_at=2, odd_side="up")
    mean = exact_stats(x, F16)[0]
    x[2] = (-1 if mean > 0 else 1) * 2.0**-20
    _add(
        out,
        cl,
        "var_tie_subnormal_element_flushed_f16",
        x,
        (0,),
        0,
        ("var", "tie"),
        ("var", "ftz_decides", 2),
    )


def _complex(out, cl):
    """Complex slices: the variance of both parts rounded once."""
    # a tie of the sum of both parts' variances, whose parts rounded separately and added
    # in the part format give another value
    for dtype, part, tag in ((C64, F32, "c64"), (C128, F64, "c128")):
        for n, ddof in ((4, 0), (3, 1)):  # (n = 2 never gives one)
            name = f"cvar_tie_single_rounding_{tag}_n{n}_ddof{ddof}"
            rng = _rng(name)
            p = _info(part)[0]
            for _ in range(200_000):
                bits = int(rng.integers(p // 2, p // 2 + 3))
                re = [int(v) for v in rng.integers(-(2**bits), 2**bits, n)]
                im = [int(v) for v in rng.integers(-(2 ** (bits - 2)), 2 ** (bits - 2), n)]
                vr, vi = _var_of_ints(re, ddof), _var_of_ints(im, ddof)
                if not is_midpoint(vr + vi, part):
                    continue
                rr, ri = oracle.round_rational(vr, part), oracle.round_rational(vi, part)
                if rr + ri != oracle.round_rational(vr + vi, part):
                    break
            else:
                raise RuntimeError("no single-rounding complex tie found")
            z = (np.array(re, np.float64) + 1j * np.array(im, np.float64)).astype(dtype)
            _add(out, cl, name, z, (0,), ddof, ("cvar", "tie"), ("cvar", "single_rounding"))
    # a real-part variance tie, pushed off the midpoint by a tiny imaginary part
    name = "cvar_near_decided_by_imag_c64_n4"
    rng = _rng(name)
    re = _find_var_tie(rng, F32, 4, 0, odd_side="up").astype(np.float64)
    im = np.zeros(4)
    im[1] = 2.0 ** (int(np.floor(np.log2(np.max(np.abs(re))))) - 30)
    z = (re + 1j * im).astype(C64)
    _add(out, cl, name, z, (0,), 0, ("cvar", "near", -55), ("cvar", "imag_decides"))
    name = "cmean_ties_c64_n2"
    rng = _rng(name)
    z = (_find_mean_tie(rng, F32, 2) + 1j * _find_mean_tie(rng, F32, 2)).astype(C64)
    _add(out, cl, name, z, (0,), 0, ("cmean", "tie"))


@functools.cache
def _build():
    out, cl = {}, {}
    _ties(out, cl)
    _near(out, cl)
    _issue(out, cl)
    _hard(out, cl)
    _half(out, cl)
    _complex(out, cl)
    return out, cl


def fixtures() -> dict[str, tuple[np.ndarray, tuple[int, ...], int]]:
    """Name -> (array, axes, ddof); arrays are fresh copies."""
    return {k: (x.copy(), axes, ddof) for k, (x, axes, ddof) in _build()[0].items()}


def claims() -> dict[str, tuple[tuple, ...]]:
    """Name -> the properties the fixture is built to have, each a tuple (stat, kind, *arg).

    stat is "mean", "var" (real slices), "cmean" or "cvar" (complex slices); every slice
    of the array has the property:

    * ("var", "tie"): the exact value is a rounding midpoint;
    * ("var", "near", k): 0 < |relative distance to the nearest midpoint| < 2**k;
    * ("var", "equals", v): the oracle's correctly rounded value is v;
    * ("var", "finite") / ("mean", "finite_nonzero"): the oracle's value is finite (nonzero);
    * ("var", "exact_lt", v) / ("var", "exact_gt", v): the exact value is below / above v;
    * ("var", "decided_by", i): element i (tiny) changes the rounding: with it set to 0 the
      exact value is a tie and rounds to the other neighbour;
    * ("var", "ftz_decides", i): element i is subnormal (counts as 0, leaving a tie); counted
      as its real value it would round to the other neighbour;
    * ("var", "double_rounding"): rounding to float32 first, then to the 16-bit format, gives
      another value than rounding once;
    * ("cvar", "single_rounding"): the parts' variances rounded separately and added in the
      part format give another value than the single rounding of their exact sum;
    * ("cvar", "imag_decides"): with the imaginary parts set to 0 the rounding differs.
    """
    return dict(_build()[1])


# ---------------------------------------------------------------- for property tests


def _check_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype not in (F32, F64):
        raise TypeError(f"float32 or float64, not {dtype}")
    return dtype


def _near_slice(seed, dtype, n, stat, ddof):
    dtype = _check_dtype(dtype)
    if n < 2 or n - ddof < 1:
        raise ValueError("n >= 2 and n - ddof >= 1")
    p = _info(dtype)[0]
    for attempt in range(100):
        rng = np.random.default_rng([seed % 2**64, attempt, n, ddof, p, int(stat == "mean")])
        sigma = 2.0 ** int(rng.integers(-20, 21) if dtype == F32 else rng.integers(-200, 201))
        mu = float(rng.choice([-1, 1])) * float(rng.uniform(0.5, 4.0)) * sigma
        x = rng.normal(mu, sigma, n).astype(dtype)
        pos = int(rng.integers(n))
        k = int(rng.integers(42, 60) if dtype == F32 else rng.integers(60, 110))
        offset = Fraction(int(rng.choice([-1, 1])), 2**k)
        x = _tuned(x, [pos], stat, dtype, ddof, offset=offset)
        value = _stat(x, stat, dtype, ddof)
        bound = Fraction(1, 2**40 if dtype == F32 else 2**59)
        if value != 0 and abs(midpoint_distance(value, dtype)) < bound:
            return x
    raise RuntimeError("no near-midpoint slice found")  # pragma: no cover


def near_midpoint_slice(seed: int, dtype, n: int, ddof: int = 0) -> np.ndarray:
    """n values (n >= 2) of dtype (float32/float64) whose exact variance (with ddof) lies
    within 2**-40 (float32) or 2**-59 (float64) relative of a rounding midpoint of dtype;
    deterministic in the arguments.

    n - 1 values are N(mu, sigma) for random sigma = 2**j and 0.5 <= |mu| / sigma <= 4;
    the remaining one, at a random position, is small (about 2**-p of the others) and
    set so that the exact variance is M (1 +- 2**-k) for the nearest midpoint M, k random
    in [42, 60) (float32) or [60, 110) (float64), up to its own rounding (below about
    2**-47, resp. 2**-105).  (Every float64 value is within 2**-53 of a midpoint, so
    only a bound well below that means anything there.)
    """
    return _near_slice(seed, dtype, n, "var", ddof)


def near_midpoint_mean_slice(seed: int, dtype, n: int) -> np.ndarray:
    """n values (n >= 2) of dtype whose exact mean lies within 2**-40 (float32) or 2**-59
    (float64) relative of a rounding midpoint of dtype; deterministic in the arguments
    (built as `near_midpoint_slice`, the small element tuning the mean).
    """
    return _near_slice(seed, dtype, n, "mean", 0)
