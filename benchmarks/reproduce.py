"""Reproduce the tables of the design note on float32 variance, on the CPU.

Usage::

    python benchmarks/reproduce.py [--quick] [--out results]

The note is ``shared/seeds/001_0145c5a79a34801b.txt``.  This script prints and stores:

1. its Section 3: the maximum relative error, the maximum ulp error and the share of
   correctly rounded variances on the datasets D1-D4, for every implementation and mode,
   against the exact oracle ``tf_stable_moments._oracle`` (the note used numpy.var in
   float64 as reference);
2. the variance of three identical values (exact value 0);
3. its Section 4: the ablation of the note's kernel, one step at a time, with the speed
   ratio to the formula of reference on a [4096, 4096] array under jax.jit;
4. two sweeps of the data offset, plotted to ``<out>/offset_sweep.png``: at a fixed spread
   (N(offset, 1), offsets 1 to 1e7: the cancellation grows with the offset, the top panel)
   and at a fixed relative spread (N(offset, (offset * 2**-10)**2), offsets 1 to 1e38:
   range effects only, the bottom panel).

All numbers and the environment go to ``<out>/results.json``.

Modes (MODES below).  For JAX, "eager" is a plain call, dispatched op by op; the functions
that JAX jits internally (``jnp.mean``, ``jnp.var``, ``jax_kernel.moments``) still run as
one compiled program each, so ``jnp.var`` and ``jax_kernel`` give the same program as
"jit".  This is the note's "eager": it reproduces every eager cell of the note's CPU tables.
"disable_jit" runs every primitive on its own under ``jax.disable_jit()``, with no fusion
anywhere.  "jit" is ``jax.jit``.  For TensorFlow, "eager" is a plain call, "tf.function" a
graph without XLA, "jit" ``tf.function(jit_compile=True)``.  The ablation and the sweep
use the note's two modes, "eager" and "jit".
"""

import argparse
import datetime
import functools
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import _note_kernel  # benchmarks/, the folder of this script
import jax
import jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
import numpy as np

matplotlib.use("Agg")
jax.config.update("jax_platforms", "cpu")
# TensorFlow reads its log level when imported; the project packages, one folder up, are
# importable only once that folder is on the path (this file is run as a script).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = importlib.import_module("tensorflow")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
jax_kernel = importlib.import_module("jax_kernel")
oracle = importlib.import_module("tf_stable_moments._oracle")
design_note_datasets = importlib.import_module("tf_stable_moments._report").design_note_datasets
try:
    tf_stable_moments = importlib.import_module("tf_stable_moments").moments
except (ImportError, AttributeError) as error:  # the TensorFlow package may not exist yet
    tf_stable_moments = None
    TF_STABLE_MISSING = f"tf_stable_moments.moments is not importable ({error!r}); rows skipped"
else:
    TF_STABLE_MISSING = None

FLT_HALF_ULP = 2.0**-24  # half an ulp of 1, the bound of a correctly rounded result
PLOT_FLOOR = 1e-10  # where a zero error is drawn on the log axis
PLOT_CEILING = 1e3  # where an error of at least 1e3, inf or nan is drawn
RELATIVE_SPREAD = 2.0**-10  # of the data of the offset sweep (see offset_sweep)
FIXED_SPREAD = 1.0  # the standard deviation of the data of the fixed-spread sweep
# keras.layers.BatchNormalization takes its batch statistics from keras.ops.moments, which
# is tf.nn.moments on the TensorFlow backend and jnp.mean / jnp.var on the JAX backend
# (keras/src/backend/{tensorflow,jax}/nn.py): those rows are keras BN's variance.
KERAS_BN_NOTE = {"tf.nn.moments": "keras BN, TF backend", "jnp.var": "keras BN, JAX backend"}

# ---------------------------------------------------------------- the note's numbers (CPU)
# Section 3, CPU table: maximum relative error against numpy.var in float64.
NOTE_SECTION3 = {
    "D1": {
        ("naive", "eager"): 1.86e-04,
        ("reference", "eager"): 1.44e-07,
        ("note_kernel", "eager"): 1.17e-07,
        ("reference", "jit"): 1.18e-07,
        ("note_kernel", "jit"): 1.17e-07,
    },
    "D2": {
        ("naive", "eager"): 3.99e-06,
        ("reference", "eager"): 1.59e-07,
        ("note_kernel", "eager"): 1.15e-07,
        ("reference", "jit"): 1.59e-07,
        ("note_kernel", "jit"): 1.15e-07,
    },
    "D3": {
        ("naive", "eager"): 1.94e-07,
        ("reference", "eager"): 1.94e-07,
        ("note_kernel", "eager"): 1.36e-07,
        ("reference", "jit"): 1.94e-07,
        ("note_kernel", "jit"): 1.36e-07,
    },
    "D4": {
        ("naive", "eager"): 1.92e-02,
        ("reference", "eager"): 1.18e-07,
        ("note_kernel", "eager"): 1.22e-07,
        ("reference", "jit"): 9.97e-08,
        ("note_kernel", "jit"): 1.22e-07,
    },
}
# Section 3, identical values on the CPU: "eager / jit".
NOTE_IDENTICAL = {
    "[1e10]*3 float32": {
        "naive": "1.04858e+06 / 1.04858e+06",
        "reference": "0 / 0",
        "note_kernel": "0 / 0",
    },
    "[7.5e10]*3 float32": {
        "naive": "6.71089e+07 / 6.71089e+07",
        "reference": "0 / 0",
        "note_kernel": "0 / 0",
    },
    "[1e15]*3 float32": {
        "naive": "4.5036e+15 / 4.5036e+15",
        "reference": "0 / 0",
        "note_kernel": "0 / 0",
    },
    "[1e38]*3 float32": {"naive": "inf / inf", "reference": "nan / nan", "note_kernel": "0 / 0"},
    "complex64 [7.5e10+7.5e10j]*3": {
        "naive": "not run",
        "reference": "not run",
        "note_kernel": "0 / 0",
    },
}
# Section 4, CPU: at most equal (eager, jit), [1e38]*3 (eager / jit), speed median (range).
NOTE_ABLATION = {
    "reference": ("4/4", "4/4", "nan / nan", "1.00 (1.00-1.00)"),
    "note_kernel": ("3/4", "3/4", "0 / 0", "2.27 (2.24-2.35)"),
    "no_shift": ("4/4", "4/4", "0 / nan", "2.22 (2.11-2.28)"),
    "no_compensation": ("2/4", "0/4", "0 / 0", "1.82 (1.78-1.89)"),
    "no_two_term": ("3/4", "3/4", "0 / 0", "1.75 (1.65-1.80)"),
    "kahan": ("3/4", "3/4", "0 / 0", "1.62 (1.55-1.64)"),
}


# ---------------------------------------------------------------- implementations
class Impl(NamedTuple):
    """An implementation: modes maps a mode name to f(x: ndarray, axis: int) -> variance.

    jitted is jax.jit(f, static_argnums=1) of a JAX implementation (None for TensorFlow).
    """

    key: str
    label: str
    modes: dict
    jitted: Callable | None = None


def _abs2(d):
    """|d|**2, and d * d for real d."""
    return jnp.real(d * jnp.conj(d)) if jnp.iscomplexobj(d) else d * d


def naive_variance(x, axis):
    """mean((x - mean(x))**2)."""
    return jnp.mean(_abs2(x - jnp.mean(x, axis, keepdims=True)), axis)


def reference_variance(x, axis):
    """The note's formula of reference: m = mean(x); d = x - m; max(mean(d^2) - mean(d)^2, 0)."""
    d = x - jnp.mean(x, axis, keepdims=True)
    return jnp.maximum(jnp.mean(_abs2(d), axis) - _abs2(jnp.mean(d, axis)), 0)


def jax_kernel_variance(x, axis):
    """This project's JAX kernel."""
    return jax_kernel.moments(x, axis)[1]


def _jax_impl(key, label, fn):
    """A JAX implementation of fn(x, axis) in the modes "eager", "disable_jit" and "jit"."""
    jitted = jax.jit(fn, static_argnums=1)

    def unfused(x, axis):
        with jax.disable_jit():
            return np.asarray(fn(jnp.asarray(x), axis))

    modes = {
        "eager": lambda x, axis: np.asarray(fn(jnp.asarray(x), axis)),
        "disable_jit": unfused,
        "jit": lambda x, axis: np.asarray(jitted(x, axis)),
    }
    return Impl(key, label, modes, jitted)


def _tf_impl(key, label, fn, graph):
    """A TensorFlow implementation of fn(t, axis): "eager", "tf.function" (when graph), "jit"."""
    modes = {"eager": fn}
    if graph:
        modes["tf.function"] = tf.function(fn)
    modes["jit"] = tf.function(fn, jit_compile=True)
    modes = {
        name: (lambda x, axis, f=f: f(tf.constant(x), axis).numpy()) for name, f in modes.items()
    }
    return Impl(key, label, modes)


def implementations():
    """The implementations of the Section 3 table, in display order."""
    impls = [
        _jax_impl("naive", "naive mean((x-mean)^2), JAX", naive_variance),
        _jax_impl("reference", "note's formula of reference, JAX", reference_variance),
        _tf_impl(
            "tf.nn.moments",
            "tf.nn.moments",
            lambda t, axis: tf.nn.moments(t, axes=[axis])[1],
            graph=False,
        ),
        _jax_impl("jnp.var", "jnp.var", lambda x, axis: jnp.var(x, axis)),
        _jax_impl(
            "note_kernel", "note's kernel (benchmarks/_note_kernel.py)", _note_kernel.variance
        ),
        _jax_impl("jax_kernel", "this project: jax_kernel.moments", jax_kernel_variance),
    ]
    if tf_stable_moments is not None:
        impls.append(
            _tf_impl(
                "tf_stable_moments",
                "this project: tf_stable_moments.moments",
                lambda t, axis: tf_stable_moments(t, axes=[axis])[1],
                graph=True,
            )
        )
    return impls


MODES = {
    "JAX eager": "plain call, op by op (jnp functions jitted internally run compiled)",
    "JAX disable_jit": "under jax.disable_jit(): every primitive on its own",
    "JAX jit": "jax.jit",
    "TF eager": "plain call",
    "TF tf.function": "tf.function without XLA",
    "TF jit": "tf.function(jit_compile=True)",
}
NOTE_MODES = ("eager", "jit")  # the modes of the note, used by the ablation and the sweep

FULL = _note_kernel.Steps(exact_squares=True, range_scaling=True)
# (key, label, steps of the note kernel, or None for an implementation of Section 3)
ABLATION = (
    ("reference", "formula of reference (two-term, no shift, XLA's sums)", None),
    ("note_kernel", "note kernel: shift, centring, compensated tree, two-term", None),
    ("no_shift", "note kernel, no shift", _note_kernel.NOTE._replace(shift=False)),
    (
        "no_compensation",
        "note kernel, plain tree (no compensation)",
        _note_kernel.NOTE._replace(summation="tree"),
    ),
    ("no_two_term", "note kernel, no two-term", _note_kernel.NOTE._replace(two_term=False)),
    (
        "kahan",
        "note kernel, sequential Kahan scan instead of the tree",
        _note_kernel.NOTE._replace(summation="kahan"),
    ),
    ("full", "note kernel + exact squares + range scaling", FULL),
    (
        "no_exact_squares",
        "note kernel + range scaling (full, plain d*d)",
        FULL._replace(exact_squares=False),
    ),
    (
        "no_range_scaling",
        "note kernel + exact squares (full, no range scaling)",
        FULL._replace(range_scaling=False),
    ),
    ("jax_kernel", "this project's kernel (jax_kernel.moments)", None),
)


def ablation_implementations(table_impls):
    """The ablation variants as Impl objects, reusing those of the Section 3 table."""
    by_key = {impl.key: impl for impl in table_impls}
    impls = []
    for key, label, steps in ABLATION:
        if steps is None:
            impls.append(by_key[key]._replace(label=label))
        else:
            impls.append(
                _jax_impl(key, label, functools.partial(_note_kernel.variance, steps=steps))
            )
    return impls


# ---------------------------------------------------------------- data and the oracle
DATASET_NAMES = ("D1", "D2", "D3", "D4")
QUICK_SIZE = (128, 16)  # --quick: the first 128 samples of the first 16 slices of D1-D4

IDENTICAL = (
    ("[1e10]*3 float32", np.full(3, 1e10, np.float32)),
    ("[7.5e10]*3 float32", np.full(3, 7.5e10, np.float32)),
    ("[1e15]*3 float32", np.full(3, 1e15, np.float32)),
    ("[1e38]*3 float32", np.full(3, 1e38, np.float32)),
    ("complex64 [7.5e10+7.5e10j]*3", np.full(3, 7.5e10 + 7.5e10j, np.complex64)),
)


def make_datasets(quick):
    """D1-D4 exactly as the note draws them (the main job's generator, seed 0, in order).

    With quick, only the first QUICK_SIZE samples and slices of each (fewer tree levels
    and smaller programs to compile).
    """
    datasets = {}
    for label, (x, (axis,)) in design_note_datasets().items():
        if quick:
            n, kept = QUICK_SIZE
            x = x[:n, :kept] if axis == 0 else x[:kept, :n]
        datasets[label.split()[0]] = (x, axis)
    return datasets


class Exact(NamedTuple):
    """The exact variance of every slice: unrounded (Fractions) and correctly rounded."""

    fractions: list
    rounded: np.ndarray


def exact_variances(x, axis):
    """Exact variances of the slices of x along axis, in the order of the kept axes."""
    slices = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
    fractions = [oracle.exact_value(s, np.float32)[1] for s in slices]
    rounded = np.array([oracle.exact_moments(s, np.float32)[1] for s in slices], np.float32)
    return Exact(fractions, rounded)


def _overflow_error(computed, rounded):
    """Where the exact variance overflows float32 (rounded is inf): 0 for inf, else inf."""
    return 0.0 if float(computed) == float(rounded) else float("inf")


def relative_error(computed, exact, rounded):
    """|computed - exact| / |exact| of one variance; inf for inf and nan results.

    Where the exact value overflows float32, the correctly rounded result is inf and only
    inf is right: its error counts as 0, any other result's as inf.
    """
    if np.isinf(rounded):
        return _overflow_error(computed, rounded)
    computed = float(computed)
    if not np.isfinite(computed):
        return float("inf")
    if exact == 0:
        return 0.0 if computed == 0 else float("inf")
    return float(abs(Fraction(computed) - exact) / abs(exact))


def accuracy(var, exact):
    """Max relative error, max ulp error and % correctly rounded of variances `var`."""
    var = np.asarray(var, np.float32).reshape(-1)
    rel = [relative_error(v, f, r) for v, f, r in zip(var, exact.fractions, exact.rounded)]
    ulp = [
        _overflow_error(v, r) if np.isinf(r) else oracle.ulp_error(v, f, np.float32)
        for v, f, r in zip(var, exact.fractions, exact.rounded)
    ]
    same = var.view(np.uint32) == exact.rounded.view(np.uint32)
    return {
        "max_rel_err": max(rel),
        "max_ulp_err": max(ulp),
        "correctly_rounded_pct": 100.0 * float(np.mean(same)),
    }


# ---------------------------------------------------------------- the four experiments
def section3(impls, datasets, exact, modes=None):
    """Accuracy of every implementation on D1-D4, in `modes` (default: all its modes)."""
    rows = []
    for name, (x, axis) in datasets.items():
        for impl in impls:
            for mode in modes or impl.modes:
                stats = accuracy(impl.modes[mode](x, axis), exact[name])
                rows.append({"dataset": name, "impl": impl.key, "mode": mode, **stats})
    return rows


def _value(var):
    """A variance as a float; complex results (tf.nn.moments) must have a zero imaginary part."""
    var = np.asarray(var)
    if np.iscomplexobj(var):
        if np.any(var.imag != 0):
            raise ValueError(f"complex variance with a non-zero imaginary part: {var}")
        var = var.real
    return float(var)


def identical_values(impls, modes=None):
    """The variance of three identical values, in `modes` (default: all the modes)."""
    rows = []
    for label, x in IDENTICAL:
        for impl in impls:
            for mode in modes or impl.modes:
                try:
                    value = _value(impl.modes[mode](x, 0))
                except Exception as error:  # noqa: BLE001  (an unsupported input is a result)
                    value = f"error: {type(error).__name__}"
                rows.append({"input": label, "impl": impl.key, "mode": mode, "variance": value})
    return rows


def _at_most_equal(rows, key, mode):
    """Datasets on which `key` has a max relative error <= that of the reference formula."""
    err = {(r["impl"], r["dataset"]): r["max_rel_err"] for r in rows if r["mode"] == mode}
    return sum(err[key, name] <= err["reference", name] for name in DATASET_NAMES)


def time_variants(impls, shape, rounds):
    """Median times under jax.jit on `shape` along axis 1, interleaved round by round."""
    x = jnp.asarray(np.random.default_rng(1).normal(1e4, 1.0, shape).astype(np.float32))
    fns = {impl.key: impl.jitted for impl in impls}
    for fn in fns.values():
        fn(x, 1).block_until_ready()  # compile and warm up
    times = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotate the order
            start = time.perf_counter()
            fns[key](x, 1).block_until_ready()
            times[key].append(time.perf_counter() - start)
    ratios = {key: [t / ref for t, ref in zip(ts, times["reference"])] for key, ts in times.items()}
    return {
        key: {
            "median_ms": 1e3 * float(np.median(times[key])),
            "ratio_median": float(np.median(ratios[key])),
            "ratio_min": float(np.min(ratios[key])),
            "ratio_max": float(np.max(ratios[key])),
        }
        for key in keys
    }


def ablation(impls, datasets, exact, shape, rounds):
    """Section 4: accuracy counts, correctly rounded %, [1e38]*3 and the speed ratio."""
    rows = section3(impls, datasets, exact, NOTE_MODES)
    big = dict(IDENTICAL)["[1e38]*3 float32"]
    speed = time_variants(impls, shape, rounds)
    out = []
    for impl in impls:
        record = {"impl": impl.key, "label": impl.label}
        for mode in NOTE_MODES:
            mine = [r for r in rows if r["impl"] == impl.key and r["mode"] == mode]
            record[f"at_most_equal_{mode}"] = _at_most_equal(rows, impl.key, mode)
            record[f"correctly_rounded_pct_{mode}"] = float(
                np.mean([r["correctly_rounded_pct"] for r in mine])
            )
            record[f"var_1e38_{mode}"] = _value(impl.modes[mode](big, 0))
        record.update(speed[impl.key])
        out.append(record)
    return out, rows


def offset_sweep(impls, offsets, shape):
    """Accuracy of the variance of N(offset, (offset * RELATIVE_SPREAD)**2) data, per offset.

    The relative spread is fixed so that the cancellation (offset / spread, the condition
    of the variance) is the same at every offset and only the range changes: what the sweep
    shows are range effects (overflow of sums and squares), not the loss of digits that
    D1-D4 measure.  RELATIVE_SPREAD = 2**-10 leaves 14 of the 24 significant bits of float32
    to the spread: a milder condition (1024) than D1, D2, D4 (1e4 to 1e6), so that the
    plain formulas stay within a few ulps where the range does not hurt.  The same standard
    normal draws are used at every offset: the data differ only by their scale and their
    rounding to float32.  Beyond an offset of about 1.9e22 the exact variance exceeds the
    largest float32: the correctly rounded result is inf there (see relative_error).
    """
    z = np.random.default_rng(2).standard_normal(shape)
    points = []
    for offset in offsets:
        x = (offset * (1.0 + RELATIVE_SPREAD * z)).astype(np.float32)
        exact = exact_variances(x, 0)
        point = {"offset": float(offset), "exact_overflows": bool(np.isinf(exact.rounded).any())}
        for impl in impls:
            for mode in NOTE_MODES:
                point[f"{impl.key}/{mode}"] = accuracy(impl.modes[mode](x, 0), exact)
        points.append(point)
    return points


def fixed_spread_sweep(impls, offsets, shape):
    """Accuracy of the variance of N(offset, FIXED_SPREAD**2) data, per offset.

    The spread is fixed, so the condition of the variance (offset / spread) grows with the
    offset: this is the loss of digits of D1-D4, swept.  Float32 data at offset 1e7 are
    integers: the data are what they are after rounding, and their exact variance is the
    reference (beyond 2**26 all values round to the offset and every method returns 0).
    The same standard normal draws at every offset.
    """
    z = np.random.default_rng(3).standard_normal(shape)
    points = []
    for offset in offsets:
        x = (offset + FIXED_SPREAD * z).astype(np.float32)
        exact = exact_variances(x, 0)
        point = {"offset": float(offset)}
        for impl in impls:
            for mode in NOTE_MODES:
                point[f"{impl.key}/{mode}"] = accuracy(impl.modes[mode](x, 0), exact)
        points.append(point)
    return points


def _label(impl, mode):
    note = KERAS_BN_NOTE.get(impl.key)
    return f"{impl.key} {mode}" + (f" (= {note})" if note else "")


def _draw(ax, points, impls, metric):
    offsets = [p["offset"] for p in points]
    for i, impl in enumerate(impls):
        for mode, style in (("eager", "-"), ("jit", "--")):
            err = np.clip([p[f"{impl.key}/{mode}"][metric] for p in points], *_CLIP[metric])
            ax.plot(
                offsets,
                err,
                style,
                color=f"C{i}",
                marker="os^vDxP+"[i % 8],
                markersize=4,
                fillstyle="none",
                label=_label(impl, mode),
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    return offsets


_CLIP = {"max_rel_err": (PLOT_FLOOR, PLOT_CEILING), "max_ulp_err": (1e-2, 1e8)}


def plot_sweep(points, impls, shape, path, fixed_points=None):
    """Log-log plots of the sweeps: one colour per implementation, jit dashed.

    Top (when fixed_points): max ulp error at a fixed spread; bottom: max relative error at
    a fixed relative spread.
    """
    rows = 2 if fixed_points else 1
    fig, axes = plt.subplots(rows, 1, figsize=(11, 6 * rows), squeeze=False)
    if fixed_points:
        ax = axes[0, 0]
        offsets = _draw(ax, fixed_points, impls, "max_ulp_err")
        ax.axhline(0.5, color="k", lw=0.8)
        ax.text(offsets[0], 0.55, "half an ulp: correctly rounded", fontsize=8)
        ax.text(offsets[0], 1.3e-2, "floor: error 0 plotted at 1e-2", fontsize=8)
        ax.set_ylim(*(v * f for v, f in zip(_CLIP["max_ulp_err"], (0.5, 2))))
        ax.set_xlabel(
            f"offset (data N(offset, {FIXED_SPREAD:g}), float32, {list(shape)}, axis 0; "
            "ceiling 1e8 ulp)"
        )
        ax.set_ylabel("maximum ulp error of the variance")
        ax.set_title("Fixed spread: variance error vs data offset (CPU; solid eager, dashed jit)")
        ax.legend(fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax = axes[-1, 0]
    offsets = _draw(ax, points, impls, "max_rel_err")
    overflow = np.sqrt(float(np.finfo(np.float32).max)) / RELATIVE_SPREAD
    ax.axvspan(overflow, max(offsets), color="0.9", zorder=0)
    ax.text(
        overflow,
        1e-2,
        f" offset > {overflow:.2g}: exact variance\n > float32 max, correct result inf",
        fontsize=8,
    )
    ax.axhline(FLT_HALF_ULP, color="k", lw=0.8)
    ax.text(max(offsets), FLT_HALF_ULP / 2, "half an ulp, 2^-24", fontsize=8, ha="right")
    ax.axhline(PLOT_FLOOR, color="0.5", lw=0.8, ls=":")
    ax.text(offsets[0], PLOT_FLOOR * 1.5, "floor: error 0 plotted at 1e-10", fontsize=8)
    ax.axhline(PLOT_CEILING, color="0.5", lw=0.8, ls=":")
    ax.text(offsets[0], PLOT_CEILING / 3, "ceiling: >= 1e3, inf or nan plotted at 1e3", fontsize=8)
    ax.set_ylim(PLOT_FLOOR / 3, PLOT_CEILING * 3)
    ax.set_xlabel(
        f"offset (data N(offset, (offset * 2^{np.log2(RELATIVE_SPREAD):.0f})^2), float32, "
        f"{list(shape)}, axis 0)"
    )
    ax.set_ylabel("maximum relative error of the variance")
    ax.set_title("Relative spread: variance error vs data offset (CPU; solid eager, dashed jit)")
    if not fixed_points:
        ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- environment and output
def environment():
    """Versions, backends, CPU model and the XLA flags of this run."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "numpy": np.__version__,
        "tensorflow": tf.__version__,
        "jax": jax.__version__,
        "matplotlib": matplotlib.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "tf_devices": [d.name for d in tf.config.list_logical_devices()],
        "tf_stable_moments": "available" if tf_stable_moments else TF_STABLE_MISSING,
        **{
            var: os.environ.get(var)
            for var in ("XLA_FLAGS", "TF_XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS")
        },
        "jax_platforms": jax.config.jax_platforms,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _jsonable(value):
    """Replace non-finite floats by strings, so that the file is strict JSON."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def print_table(title, headers, rows):
    """Print rows under headers, columns padded to their widest cell."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for j, row in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def report_section3(rows):
    """Print the Section 3 table, the note's CPU numbers beside ours."""
    table = []
    for r in rows:
        note = NOTE_SECTION3[r["dataset"]].get((r["impl"], r["mode"]))
        table.append(
            [
                r["dataset"],
                r["impl"],
                r["mode"],
                f"{r['max_rel_err']:.3g}",
                f"{r['max_ulp_err']:.3g}",
                f"{r['correctly_rounded_pct']:.1f}",
                "" if note is None else f"{note:.3g}",
            ]
        )
    print_table(
        "Section 3: variance of D1-D4 against the exact oracle (note: its CPU table, "
        "against numpy.var in float64)",
        ["data", "implementation", "mode", "max rel err", "max ulp", "CR %", "note"],
        table,
    )
    for mode in NOTE_MODES:
        count = _at_most_equal(rows, "note_kernel", mode)
        print(
            f"note kernel at most equal to the formula of reference, {mode}: {count}/4 "
            f"(note, CPU: 3/4)"
        )


def report_identical(rows):
    """Print the identical-values table, eager / jit (/ tf.function) per cell."""
    cells = {}
    for r in rows:
        value = r["variance"]
        cells.setdefault((r["input"], r["impl"]), []).append(
            f"{r['mode']}={value if isinstance(value, str) else f'{value:g}'}"
        )
    table = [
        [label, impl, " ".join(values), NOTE_IDENTICAL[label].get(impl, "")]
        for (label, impl), values in cells.items()
    ]
    print_table(
        "Variance of three identical values (exact: 0)",
        ["input", "implementation", "ours", "note CPU eager / jit"],
        table,
    )


def report_ablation(records, shape):
    """Print the ablation table, the note's CPU numbers beside ours."""
    table = []
    for r in records:
        note = NOTE_ABLATION.get(r["impl"], ())
        table.append(
            [
                r["impl"],
                f"{r['at_most_equal_eager']}/4",
                f"{r['at_most_equal_jit']}/4",
                f"{r['correctly_rounded_pct_eager']:.1f}/{r['correctly_rounded_pct_jit']:.1f}",
                f"{r['var_1e38_eager']:g} / {r['var_1e38_jit']:g}",
                f"{r['ratio_median']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})",
                f"{r['median_ms']:.1f}",
                " | ".join(note),
            ]
        )
    print_table(
        f"Section 4 ablation: at most equal to the reference (D1-D4), correctly rounded % "
        f"(eager/jit), [1e38]*3, speed ratio on {list(shape)} axis 1 under jax.jit",
        ["variant", "eager", "jit", "CR %", "[1e38]*3", "speed", "ms", "note CPU"],
        table,
    )
    for r in records:
        print(f"  {r['impl']}: {r['label']}")


def report_sweep(points, impls, fixed=False):
    """Print a sweep as one row per offset."""
    keys = [f"{impl.key}/{mode}" for impl in impls for mode in NOTE_MODES]
    metric = "max_ulp_err" if fixed else "max_rel_err"
    table = [
        [f"{p['offset']:.0e}" + (" *" if p.get("exact_overflows") else "")]
        + [f"{p[k][metric]:.2g}" for k in keys]
        for p in points
    ]
    title = (
        f"Fixed-spread sweep, N(offset, {FIXED_SPREAD:g}): max ulp error"
        if fixed
        else "Offset sweep: max relative error (* exact variance overflows float32; inf is right)"
    )
    print_table(title, ["offset"] + keys, table)


def main(argv=None):
    """Run every experiment, print the tables, write <out>/results.json and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="128 x 16 subsets of D1-D4, the modes eager and jit only, 4 offsets",
    )
    parser.add_argument("--out", default="results", help="output folder (default: results)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tf.config.set_visible_devices([], "GPU")
    # Each shape and axis traces the tf.functions again, on purpose; do not warn about it.
    tf.get_logger().setLevel("ERROR")
    seconds = {}
    env = environment()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if TF_STABLE_MISSING:
        print(f"NOTE: {TF_STABLE_MISSING}")
    if args.quick:
        print(
            f"NOTE: --quick: {QUICK_SIZE[0]} x {QUICK_SIZE[1]} subsets of D1-D4 and a speed test"
            " on D2's shape; the note's numbers, set beside ours, are for the full sizes"
        )

    impls = implementations()
    datasets = make_datasets(args.quick)
    exact = {name: exact_variances(x, axis) for name, (x, axis) in datasets.items()}
    modes = NOTE_MODES if args.quick else None
    rows3 = section3(impls, datasets, exact, modes)
    report_section3(rows3)
    seconds["section3"] = time.perf_counter() - start

    rows_identical = identical_values(impls, modes)
    report_identical(rows_identical)
    seconds["identical_values"] = time.perf_counter() - start - sum(seconds.values())

    # In --quick the speed test reuses the programs compiled for D2: it checks that the
    # test runs, its ratios mostly measure the dispatch overhead.
    shape, rounds = (datasets["D2"][0].shape, 3) if args.quick else ((4096, 4096), 7)
    records, rows4 = ablation(ablation_implementations(impls), datasets, exact, shape, rounds)
    report_ablation(records, shape)
    seconds["ablation"] = time.perf_counter() - start - sum(seconds.values())

    offsets = np.logspace(0, 38, 4 if args.quick else 39)
    sweep_shape = datasets["D1"][0].shape  # the programs compiled for D1 are reused
    points = offset_sweep(impls, offsets, sweep_shape)
    report_sweep(points, impls)
    fixed_offsets = np.logspace(0, 6, 4) if args.quick else np.logspace(0, 7, 29)
    fixed_points = fixed_spread_sweep(impls, fixed_offsets, sweep_shape)
    report_sweep(fixed_points, impls, fixed=True)
    plot_sweep(points, impls, sweep_shape, out / "offset_sweep.png", fixed_points)
    seconds["offset_sweep"] = time.perf_counter() - start - sum(seconds.values())

    results = {
        "environment": env,
        "arguments": {"quick": args.quick, "out": str(out)},
        "modes": MODES,
        "section3": rows3,
        "identical_values": rows_identical,
        "ablation": {
            "shape": list(shape),
            "rounds": rounds,
            "variants": records,
            "accuracy": rows4,
        },
        "offset_sweep": {
            "relative_spread": RELATIVE_SPREAD,
            "shape": list(sweep_shape),
            "axis": 0,
            "points": points,
        },
        "fixed_spread_sweep": {
            "spread": FIXED_SPREAD,
            "shape": list(sweep_shape),
            "axis": 0,
            "keras_bn": KERAS_BN_NOTE,
            "points": fixed_points,
        },
        "note": {
            "section3_cpu": {
                k: {f"{i}/{m}": v for (i, m), v in d.items()} for k, d in NOTE_SECTION3.items()
            },
            "identical_cpu": NOTE_IDENTICAL,
            "ablation_cpu": NOTE_ABLATION,
        },
        "seconds": {**seconds, "total": time.perf_counter() - start},
    }
    (out / "results.json").write_text(json.dumps(_jsonable(results), indent=1) + "\n")
    print(
        f"\nwrote {out / 'results.json'} and {out / 'offset_sweep.png'} "
        f"in {results['seconds']['total']:.0f} s"
    )


if __name__ == "__main__":
    main()
