"""The accelerator path in one short run: oracle bits, speed, first calls, one table.

Every GPU and TPU user (and every machine where the native library cannot be built)
runs the pure-XLA kernel (moments_core/_kernel.py).  This script measures what they
get, on whatever machine it runs on:

1. the oracle-bitwise tests that matter on a device, as pytest runs them: every data
   set and every rounding fixture group (every kind of claim, one group per dtype and
   length) in the modes that run the XLA kernel (TF jit_compile and eager, JAX jit);
2. `benchmarks/speed.py`'s shapes and a BN-shaped one, `moments` under TF
   `jit_compile` against `tf.nn.moments` and under JAX `jit` against `jnp.var` (steady
   medians, ratios in this process), the first call of each (compile included) and
   the fraction of slices the fast path leaves to the exact path;
3. one ResNet50 (32x32, batch 16, every BN swapped: `benchmarks/models.py`) per
   framework, TF `jit_compile` and JAX `jit`: first step, steady step and the first step
   of a new batch size, ours against keras's BatchNormalization;

printed as tables.  On a machine with an accelerator it measures the accelerator;
on a CPU the native kernel is switched off first (TF_STABLE_MOMENTS_NATIVE=0), which
runs exactly what an accelerator runs: the CPU twin of the measurement.

Usage: python benchmarks/accelerator.py [--reps 7] [--no-tests] [--cases K] [--steps 3]
[--no-models]  (parts 1-2 take about 3-5 minutes on 2 CPU cores, the tests most of it;
part 3 minutes more on a CPU, where the XLA kernel compiles into every BN layer).
"""

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_STABLE_MOMENTS_NATIVE", "0")  # a no-op where an accelerator serves
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import models  # noqa: E402  (benchmarks/models.py, beside this file)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import jax_kernel  # noqa: E402
import tf_stable_moments  # noqa: E402
from jax_kernel import _moments as jax_moments  # noqa: E402
from tf_stable_moments import _moments as tf_moments  # noqa: E402

# (label, shape, axes, loc): a BN layer after a conv at N(0, 1) and on an offset, and
# speed.py's cases at N(1000, 1).
CASES = [
    ("[64,32,32,64] axes 0,1,2 N(0,1)", (64, 32, 32, 64), (0, 1, 2), 0.0),
    ("[64,32,32,64] axes 0,1,2 N(1e4,1)", (64, 32, 32, 64), (0, 1, 2), 1e4),
    ("[4096,4096] axis 1", (4096, 4096), (1,), 1000.0),
    ("[4096,4096] axis 0", (4096, 4096), (0,), 1000.0),
    ("[128,32,32,64] axes 0,1,2", (128, 32, 32, 64), (0, 1, 2), 1000.0),
    ("[256,1024] axis 1", (256, 1024), (1,), 1000.0),
]
TESTS = [
    "tests/test_kernel.py::test_every_data_set_is_correctly_rounded_under_xla",
    "tests/test_certification.py::test_every_fixture_is_correctly_rounded_under_xla",
]


def oracle_tests():
    """(passed, failed, seconds) of the XLA-kernel oracle tests, run by pytest."""
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-300:]
    return tail, run.returncode, time.perf_counter() - start


def _median(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _first(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(label, shape, axes, loc, reps):
    x = (loc + np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
    xt, xj = tf.constant(x), jnp.asarray(x)
    ours_tf = tf.function(lambda v: tf_stable_moments.moments(v, list(axes)), jit_compile=True)
    ref_tf = tf.function(lambda v: tf.nn.moments(v, list(axes)), jit_compile=True)
    ours_jax = jax.jit(lambda v: jax_kernel.moments(v, axes))
    ref_jax = jax.jit(lambda v: (jnp.mean(v, axes), jnp.var(v, axes)))

    def tf_call(f):
        return lambda: [t.numpy() for t in f(xt)]

    def jax_call(f):
        return lambda: jax.block_until_ready(f(xj))

    row = {"case": label}
    row["tf_first"] = _first(tf_call(ours_tf))
    row["tf_ref_first"] = _first(tf_call(ref_tf))
    row["tf_ratio"] = _median(tf_call(ours_tf), reps) / _median(tf_call(ref_tf), reps)
    row["jax_first"] = _first(jax_call(ours_jax))
    row["jax_ref_first"] = _first(jax_call(ref_jax))
    row["jax_ratio"] = _median(jax_call(ours_jax), reps) / _median(jax_call(ref_jax), reps)
    row["tf_open"] = tf_moments.undecided_fraction(xt, list(axes))
    row["jax_open"] = jax_moments.undecided_fraction(xj, axes)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first K cases")
    parser.add_argument("--steps", type=int, default=3, help="steady steps per model")
    parser.add_argument("--no-models", action="store_true")
    args = parser.parse_args()
    device = jax.devices()[0]
    native = os.environ["TF_STABLE_MOMENTS_NATIVE"]
    print(f"# device: {device.platform} ({device.device_kind}); TF_STABLE_MOMENTS_NATIVE={native}")
    print(f"# tensorflow {tf.__version__}, jax {jax.__version__}, reps {args.reps}")
    if not args.no_tests:
        tail, rc, seconds = oracle_tests()
        print(f"# oracle bits (XLA kernel modes): {tail} [{seconds:.0f} s, rc {rc}]")
    print()
    print(
        "| case | TF jit_compile / tf.nn.moments | first call (tf.nn.moments) "
        "| JAX jit / jnp.var | first call (jnp.var) | exact-path slices TF / JAX |"
    )
    print("|---|---|---|---|---|---|")
    for label, shape, axes, loc in CASES[: args.cases]:
        r = bench(label, shape, axes, loc, args.reps)
        print(
            f"| {r['case']} | {r['tf_ratio']:.2f}x | {r['tf_first']:.2f} s "
            f"({r['tf_ref_first']:.2f} s) | {r['jax_ratio']:.2f}x | {r['jax_first']:.2f} s "
            f"({r['jax_ref_first']:.2f} s) | {r['tf_open']:.3f} / {r['jax_open']:.3f} |",
            flush=True,
        )
    if not args.no_models:
        model_table(args.steps)


def model_table(steps):
    """Part 3: ResNet50 steps, ours / keras, TF jit_compile and JAX jit (subprocesses that
    inherit TF_STABLE_MOMENTS_NATIVE)."""
    plan = (("tensorflow", ("jit_compile",)), ("jax", ("jit",)))
    results = models.run_backends("ResNet50", 32, 16, steps, plan)
    print()
    print(f"ResNet50 32x32, batch 16, every BN swapped; seconds, ours / keras; {steps} steps")
    print("| framework | first step | steady step | new batch size (15) |")
    print("|---|---|---|---|")
    for key, value in results.items():
        cells = [f"{o:.2f} / {k:.2f} = {o / k:.2f}x" for k, o in zip(value["keras"], value["ours"])]
        print(f"| {key} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
