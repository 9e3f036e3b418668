"""benchmarks/speed.py's decided-fraction function, on small inputs (a smoke test)."""

import importlib
import math
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
speed = importlib.import_module("speed")


def _halfway(v):
    """Whether the rational v lies exactly halfway between two adjacent float32 numbers."""
    if v == 0:
        return False
    e = math.frexp(float(abs(v)))[1] - 1  # 2**e <= |v| < 2**(e + 1)
    q = abs(v) / Fraction(2) ** (e - 24)  # float32 values are even multiples of 2**(e - 24)
    return q.denominator == 1 and q.numerator % 2 == 1


def _ties(x):
    """Rows of x whose exact mean or variance (ddof 0) is a float32 tie."""
    out = []
    for row in x:
        r = [Fraction(float(v)) for v in row]
        mean = sum(r) / len(r)
        var = sum((a - mean) ** 2 for a in r) / len(r)
        out.append(_halfway(mean) or _halfway(var))
    return np.array(out)


def test_decided_fractions():
    # float32 N(1e6, 1) slices of n = 64 have an exactly halfway mean in about 1 of 64
    # slices (seed 0 along axis 1 has two; the fast path rightly leaves them undecided):
    # this seed has none, so the fast path must decide every slice.
    x = np.random.default_rng(3).normal(1e6, 1.0, (64, 64)).astype(np.float32)
    assert not _ties(x).any()
    # One slice [0, 4097, 0, 4097, ...]: mean 2048.5, variance 2048.5**2, halfway between
    # two float32 numbers (same shape as x: no compile of its own for the fast path).
    tie = x.copy()
    tie[5] = np.resize(np.float32([0, 4097]), 64)
    assert _ties(tie[5:6]).all()
    got = speed.decided_fractions({"N(1e6, 1)": (x, (1,)), "tie": (tie, (1,))})
    assert set(got) == {"N(1e6, 1)", "tie"}
    for fractions in got.values():  # TF and JAX (native kernels), XLA kernel
        assert len(fractions) == 3 and all(0.0 <= f <= 1.0 for f in fractions)
    assert got["N(1e6, 1)"] == (1.0, 1.0, 1.0)
    # only the tie slice is left to the exact path by the native kernels (n = 64: its
    # lattice, 2**-22 / 64**2, is too fine for the bound of docs section 5); the XLA
    # kernel's bounds may decide it, nothing else
    assert got["tie"][:2] == (63 / 64, 63 / 64) and got["tie"][2] in (63 / 64, 1.0)


def test_size_sweep_plot_is_written(tmp_path):
    # The plot of benchmarks/speed.py --sweep from made-up timings (no timing here): every
    # implementation of the sweep drawn, jit_compile at some sizes only, a PNG written.
    import matplotlib  # noqa: F401  (a test dependency: never skipped)

    names = list(speed.sweep_implementations())
    rows = [
        {
            "elements": 2**k,
            "median_s": {
                n: 1e-4 * (i + 1) * 2 ** (k - 10)
                for i, n in enumerate(names)
                if n != speed.SWEEP_XLA or k in speed.SWEEP_XLA_POWERS
            },
        }
        for k in speed.QUICK_SWEEP_POWERS
    ]
    path = tmp_path / "speed.png"
    speed.plot_sweep(rows, str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
