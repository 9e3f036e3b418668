"""Named test data: the design note's D1-D4 and stress data, all float32.

Each entry maps a readable name to (array, axes, mean_cancels).  mean_cancels
marks data whose mean is itself the result of cancellation, where the mean is
held to an absolute bound instead of one ulp.
"""

import math
from fractions import Fraction

import numpy as np

from tf_stable_moments._report import design_note_datasets


def design_note():
    """D1-D4 exactly as the design note draws them (the main job's own generator)."""
    d = list(design_note_datasets().values())
    cancels = (False, False, True, False)
    return {f"D{i + 1}": (x, axes, c) for i, ((x, axes), c) in enumerate(zip(d, cancels))}


def stress():
    rng = np.random.default_rng(1234)
    f32 = np.float32
    out = {}
    for offset in (1e10, 1e20, 1e30, 1e38):
        x = rng.normal(offset, offset * 2.0**-20, (200, 8))
        out[f"offset_{offset:.0e}"] = (np.clip(x, -3e38, 3e38).astype(f32), (0,), False)
    for spread in (1e-19, 1e-10, 1e10, 1e18):
        out[f"spread_{spread:.0e}"] = (rng.normal(0, spread, (300, 8)).astype(f32), (0,), True)
    out["spread_1e-19_at_1e-12"] = (rng.normal(1e-12, 1e-19, (300, 8)).astype(f32), (0,), False)
    for n in (1, 2, 3, 5, 7, 1001):
        out[f"n_{n}"] = (rng.normal(3.0, 0.5, (n, 16)).astype(f32), (0,), False)
    out["n_65536"] = (rng.normal(1e5, 3.0, (2, 65536)).astype(f32), (1,), False)
    out["n_65537"] = (rng.normal(-7e4, 0.25, (65537, 2)).astype(f32), (0,), False)
    big = rng.choice([-1e30, 1e30, -3e20, 3e20], (512, 8)) + rng.normal(0, 1, (512, 8))
    out["cancelling_large"] = (big.astype(f32), (0,), True)
    outlier = rng.normal(0, 1, (4096, 4))
    outlier[0] = 1e12  # the shift K is an outlier: the local centring must recover
    out["first_element_outlier"] = (outlier.astype(f32), (0,), False)
    out["heavy_tail_cauchy"] = (rng.standard_cauchy((2000, 8)).astype(f32), (0,), True)
    out["heavy_tail_pareto"] = ((rng.pareto(1.1, (2000, 8)) + 1).astype(f32), (0,), False)
    sparse = np.where(rng.random((4000, 8)) < 0.01, rng.lognormal(-20, 8, (4000, 8)), 0.0)
    out["gradient_sparse"] = ((sparse * rng.choice([-1, 1], sparse.shape)).astype(f32), (0,), True)
    tiny = rng.normal(3e-38, 1e-38, (256, 4))
    tiny[::7] = 1e-41  # subnormal inputs count as zero
    out["tiny_with_subnormals"] = (tiny.astype(f32), (0,), False)
    out["huge_overflowing_variance"] = (
        rng.choice([-3e38, 3e38], (64, 4)).astype(f32),
        (0,),
        True,
    )
    out["axes_0_1_2_conv"] = (rng.normal(50.0, 0.1, (8, 6, 5, 3)).astype(f32), (0, 1, 2), False)
    out["axes_0_2_strided"] = (rng.normal(-2e3, 0.01, (10, 3, 7)).astype(f32), (0, 2), False)
    out["axes_1_middle"] = (rng.normal(1e7, 1.0, (4, 33, 5)).astype(f32), (1,), False)
    return out


def all_datasets():
    return {**design_note(), **stress()}


def identical(value, n=3, dtype=np.float32):
    return np.full((n,), value, dtype)


def slices(x, axes):
    """The slices of x over `axes` as rows: reduced axes moved last, row-major."""
    kept = [a for a in range(x.ndim) if a not in axes]
    n = int(np.prod([x.shape[a] for a in axes]))
    return np.transpose(x, kept + list(axes)).reshape(-1, n)


def oracle(x, axes, ddof=0):
    """(mean, var) of x over axes from the exact oracle, each slice rounded once."""
    from tf_stable_moments._oracle import exact_complex_moments, exact_moments

    x = np.asarray(x)
    axes = tuple(a % x.ndim for a in axes)
    rows = slices(x, axes)
    shape = [x.shape[a] for a in range(x.ndim) if a not in axes]
    if np.iscomplexobj(x):
        part = np.float32 if x.dtype == np.complex64 else np.float64
        out = []
        for r in rows:
            if np.all(np.isfinite(r)) and r.size:
                out.append(exact_complex_moments(r, x.dtype, ddof))
            else:
                re, im = _special(r.real, part, ddof), _special(r.imag, part, ddof)
                out.append((re[0], im[0], part(np.nan)))
        mean = np.array([complex(float(a), float(b)) for a, b, _ in out], x.dtype)
        var = np.array([v for _, _, v in out], part)
    else:
        out = [
            exact_moments(r, x.dtype, ddof)
            if np.all(np.isfinite(r)) and r.size
            else _special(r, x.dtype, ddof)
            for r in rows
        ]
        mean = np.array([m for m, _ in out], x.dtype)
        var = np.array([v for _, v in out], x.dtype)
    return mean.reshape(shape), var.reshape(shape)


def _special(r, dtype, ddof):
    """The contract's special values (docs section 8): NaN or Inf in a slice, or no data."""
    from tf_stable_moments._oracle import exact_moments

    dtype = np.dtype(dtype).type
    nan, pos, neg = np.isnan(r).any(), (r == np.inf).any(), (r == -np.inf).any()
    if r.size == 0 or nan or (pos and neg):
        return dtype(np.nan), dtype(np.nan)
    if pos or neg:
        return dtype(np.inf if pos else -np.inf), dtype(np.nan)
    return exact_moments(r, dtype, ddof)


def mean_lo_cases():
    """(x, axes) cases for mean_lo implementations compared bit for bit: offsets, mixed
    magnitudes, inputs near both ends of each format's range, a NaN, complex64."""
    rng = np.random.default_rng(9)
    cases = []
    for dtype in (np.float32, np.float64, np.float16):
        offset = {np.float16: 1e3}.get(dtype, 1e6)
        tiny = {np.float32: 1e-40, np.float64: 1e-310, np.float16: 1e-6}[dtype]
        big = {np.float32: 1e37, np.float64: 1e300, np.float16: 1e4}[dtype]  # finite
        for shape, axes in (
            ((64, 33), (0,)),
            ((5, 7, 9), (0, 2)),
            ((12, 40), (1,)),
            ((3, 999), (1,)),
            # lengths of whole blocks of 16 x 16 and of 16 terms, whose sums JAX's XLA
            # kernel takes block by block (jax_kernel/_ops.py `exact_sum`), both layouts
            ((512, 24), (0,)),
            ((6, 96), (1,)),
        ):
            z = rng.standard_normal(shape)
            mixed = z * 10.0 ** rng.integers(-6, 6, shape)
            mixed = np.clip(mixed, -6e4, 6e4) if dtype == np.float16 else mixed  # finite
            for i, x in enumerate((z, offset + z, mixed, z * tiny, z * big)):
                x = x.astype(dtype)
                if i == 2:
                    x.flat[3] = np.nan  # that slice's mean_lo is 0, the others are kept
                cases.append((x, axes))
    z = np.random.default_rng(10).standard_normal((2, 16, 8))
    cases.append(((z[0] + 1j * z[1]).astype(np.complex64), (0,)))
    # 2**20 elements or more: the native call cuts them between threads (columns by rows,
    # contiguous slices by slices), each piece with totals of its own
    big = (1e4 + np.random.default_rng(11).standard_normal((1040, 1024))).astype(np.float32)
    cases += [(big, (0,)), (big, (1,))]
    return cases


def oracle_rsqrt32(v):
    """RN32(1 / sqrt(x)) for each positive float32 x of v (any shape), from exact
    comparisons: t is the nearest float32 iff the midpoints m_low < t < m_high to its
    neighbours satisfy m_low**2 x > 1 > m_high**2 x (1/sqrt(x) is never a midpoint); the
    float64 guess t is at most one float32 step off, so one step corrects it."""
    out = []
    for x in np.ravel(v):
        t = np.float32(1 / math.sqrt(float(x)))
        below, above = np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))
        m_low = (Fraction(float(below)) + Fraction(float(t))) / 2
        m_high = (Fraction(float(t)) + Fraction(float(above))) / 2
        x = Fraction(float(x))
        # 1/sqrt(x) > m  <=>  m**2 x < 1
        out.append(above if m_high**2 * x < 1 else below if m_low**2 * x > 1 else t)
    return np.array(out, np.float32).reshape(np.shape(v))
