"""benchmarks/speed.py times the kernel's own passes: they compute the kernel's bits."""

import importlib
import sys
from pathlib import Path

import numpy as np
import numpy_mirror
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
speed = importlib.import_module("speed")

CASES = [  # (shape, axes): the layouts of the benchmark's power-of-two cases
    ((64, 256), (1,)),
    ((256, 64), (0,)),
    ((8, 4, 4, 16), (0, 1, 2)),
    ((4, 16, 8), (0, 2)),  # laid out by a transpose
]


def _slices(x, axes):
    """The [slices, n] view the numpy mirror takes."""
    kept = [a for a in range(x.ndim) if a not in axes]
    n = int(np.prod([x.shape[a] for a in axes]))
    return np.transpose(x, kept + list(axes)).reshape(-1, n)


def _mirror_sy(slices):
    m = numpy_mirror.Mirror(np.float32)
    amax = np.maximum(np.abs(slices.max(axis=1)), np.abs(slices.min(axis=1)))
    e = m.scale_exponent(amax)
    with np.errstate(all="ignore"):
        return e, m.part_sums(slices, e[:, None], slices.shape[1])[2]


@pytest.mark.parametrize(("shape", "axes"), CASES, ids=lambda c: str(c))
def test_stages_compute_the_kernel_steps(shape, axes):
    x = np.random.default_rng(1).normal(1e6, 1.0, shape).astype(np.float32)
    x.flat[3] = 1e-30  # a value the scaling drops
    stages = speed.stages(axes)
    assert set(stages) == {"stage XLA: max and min", "stage XLA: shift pass", "stage XLA: one tree"}
    e, sy = _mirror_sy(_slices(x, axes))
    got_e = np.asarray(stages["stage XLA: max and min"][1](x)).ravel()
    np.testing.assert_array_equal(got_e, e)
    got = [np.asarray(v).view(np.uint32) for v in stages["stage XLA: shift pass"][1](x)]
    for g, want in zip(got, sy):
        np.testing.assert_array_equal(g, want.view(np.uint32))
    h, l = stages["stage XLA: one tree"][1](x)
    assert np.asarray(h).shape == np.asarray(l).shape == (x.size // _slices(x, axes).shape[1],)
