"""benchmarks/reproduce.py --quick runs, and shows this project's kernels exact on its data."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_note_kernel = importlib.import_module("_note_kernel")

OURS = ("jax_kernel", "tf_stable_moments")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run the script once with --quick; return its output folder."""
    out = tmp_path_factory.mktemp("results")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "reproduce.py"), "--quick", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def results(quick_run):
    return json.loads((quick_run / "results.json").read_text())


def _ours(rows, results):
    """The rows of this project's kernels; tf_stable_moments' when it was importable."""
    mine = [r for r in rows if r["impl"] in OURS]
    expected = {"jax_kernel"}
    if results["environment"]["tf_stable_moments"] == "available":
        expected.add("tf_stable_moments")
    assert {r["impl"] for r in mine} == expected
    return mine


def test_our_kernels_correctly_rounded_on_d1_to_d4(results):
    rows = _ours(results["section3"], results)
    assert {r["dataset"] for r in rows} == {"D1", "D2", "D3", "D4"}
    for r in rows:
        assert r["correctly_rounded_pct"] == 100.0, r
        assert r["max_ulp_err"] <= 0.5, r


def test_our_kernels_exactly_zero_on_identical_values(results):
    rows = _ours(results["identical_values"], results)
    assert len({r["input"] for r in rows}) == 5
    for r in rows:
        assert r["variance"] == 0.0, r


def test_ablation_and_sweep_recorded(results):
    variants = {r["impl"] for r in results["ablation"]["variants"]}
    assert {"reference", "note_kernel", "no_shift", "kahan", "jax_kernel"} <= variants
    assert len(results["offset_sweep"]["points"]) >= 2
    for key in ("python", "tensorflow", "jax", "numpy", "cpu_model", "XLA_FLAGS"):
        assert key in results["environment"]


def test_plot_written(quick_run):
    png = quick_run / "offset_sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "steps",
    [
        _note_kernel.NOTE,
        _note_kernel.NOTE._replace(shift=False),
        _note_kernel.NOTE._replace(summation="tree"),
        _note_kernel.NOTE._replace(summation="kahan"),
        _note_kernel.NOTE._replace(two_term=False),
        _note_kernel.Steps(exact_squares=True, range_scaling=True),
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s._asdict().items()),
)
def test_note_kernel_variants_compute_the_variance(steps):
    x = np.random.default_rng(3).normal(5.0, 2.0, (37, 3)).astype(np.float32)
    var = np.asarray(jax.jit(_note_kernel.variance, static_argnums=(1, 2))(x, 0, steps))
    np.testing.assert_allclose(var, np.var(x.astype(np.float64), axis=0), rtol=1e-5)
    if steps.shift:
        z = np.full((2, 5), 7.5e10 + 7.5e10j, np.complex64)
        assert np.all(np.asarray(_note_kernel.variance(z, 1, steps)) == 0)


def test_fixed_spread_sweep_shows_who_breaks(results):
    """N(offset, 1): ours within half an ulp at every offset; tf.nn.moments (keras BN on the
    TensorFlow backend) and jnp.var (keras BN on JAX) lose digits as the offset grows."""
    sweep = results["fixed_spread_sweep"]
    assert sweep["spread"] == 1.0 and len(sweep["points"]) >= 3
    assert sweep["keras_bn"] == {
        "tf.nn.moments": "keras BN, TF backend",
        "jnp.var": "keras BN, JAX backend",
    }
    ours = [k for k in sweep["points"][0] if k.split("/")[0] in OURS]
    assert ours
    for point in sweep["points"]:
        for key in ours:
            assert point[key]["max_ulp_err"] <= 0.5, (point["offset"], key)
    for theirs in ("tf.nn.moments", "jnp.var"):
        for mode in ("eager", "jit"):
            worst = max(p[f"{theirs}/{mode}"]["max_ulp_err"] for p in sweep["points"])
            assert worst > 1e3, (theirs, mode, worst)
