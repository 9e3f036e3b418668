"""The accelerator path in one short run: oracle bits, speed, first calls, models, tables.

Every GPU and TPU user (and every machine where the native library cannot be built)
runs the pure-XLA kernel (moments_core/_kernel.py).  This script measures what they
get, on whatever machine it runs on, in parts that each run in a subprocess of their
own (with a time limit, so that one slow part cannot take the others' time):

* ``oracle``: every data set and every rounding fixture group (every kind of claim,
  every dtype, every slice length up to 65536: one XLA compilation per group) through
  ``jax_kernel.moments`` under ``jax.jit`` on the default device, bit for bit against
  the exact oracle, with the float32-pair fast path on and off (docs section 4b); the
  fraction of slices the fast path leaves open on BN-shaped data (N(0, 1),
  N(0, 1e-3), ReLU outputs, n = 8 to 2**20; issue #23 item 1).  Where TensorFlow is
  installed, the XLA-kernel oracle tests of the test suite as pytest runs them, too.
* ``speed``: `benchmarks/speed.py`'s shapes and BN-shaped ones, ``moments`` under
  JAX ``jit`` against ``jnp.var`` (and, with TensorFlow, under ``jit_compile``
  against ``tf.nn.moments``): steady medians, ratios in one process, the first call
  of each (compile included), the slices left to the exact path; float32 pairs on
  and off.
* ``models``: a ResNet50 (32x32, batch 16, every BN swapped: `benchmarks/models.py`),
  Keras-JAX ``jit`` (and TF ``jit_compile`` with TensorFlow): first step, steady
  step, the first step of a new batch size, ours against keras's BatchNormalization.
* ``flax``: the Flax CNN of `benchmarks/models.py flax` (conv + BatchNorm blocks on
  inputs around 1e4), a few dozen steps: first and steady step, ours against Flax's.

On a machine with an accelerator it measures the accelerator (the native kernel is
switched off: TF_STABLE_MOMENTS_NATIVE=0, a no-op there); on a CPU the same setting
runs exactly what an accelerator runs: the CPU twin of the measurement.  TensorFlow
and Keras are optional: without them the TF columns and models are left out.

Usage: python benchmarks/accelerator.py [--parts oracle speed models flax]
[--reps 7] [--steps 3] [--limit 240] [--deadline S] [--pairs-last] [--log FILE]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_STABLE_MOMENTS_NATIVE", "0")  # a no-op where an accelerator serves
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # parts share the device
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

PARTS = ("oracle", "speed", "models", "flax")
# (label, shape, axes, loc): BN layers after a conv at N(0, 1) and on an offset, ReLU
# outputs, and speed.py's cases at N(1000, 1).
CASES = [
    ("[64,32,32,64] axes 0,1,2 N(0,1)", (64, 32, 32, 64), (0, 1, 2), 0.0),
    ("[64,32,32,64] axes 0,1,2 N(1e4,1)", (64, 32, 32, 64), (0, 1, 2), 1e4),
    ("[128,16,16,128] axes 0,1,2 ReLU", (128, 16, 16, 128), (0, 1, 2), "relu"),
    ("[4096,4096] axis 1", (4096, 4096), (1,), 1000.0),
    ("[4096,4096] axis 0", (4096, 4096), (0,), 1000.0),
    ("[128,32,32,64] axes 0,1,2", (128, 32, 32, 64), (0, 1, 2), 1000.0),
    ("[256,1024] axis 1", (256, 1024), (1,), 1000.0),
]
# The test suite's XLA-kernel oracle tests (need TensorFlow).
TESTS = [
    "tests/test_kernel.py::test_every_data_set_is_correctly_rounded_under_xla",
    "tests/test_certification.py::test_every_fixture_is_correctly_rounded_under_xla",
]
LONGEST = 65536  # fixture groups up to this slice length (the 2**20 one: the CPU tests)
BN_LENGTHS = (8, 64, 512, 4096, 65536, 2**20)


def _has(module):
    try:
        __import__(module)
    except Exception:  # noqa: BLE001  (a broken install counts as absent)
        return False
    return True


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


def _data(shape, loc, seed=0):
    import numpy as np

    x = np.random.default_rng(seed).standard_normal(shape)
    if loc == "relu":
        return np.maximum(x, 0).astype(np.float32)
    return (loc + x).astype(np.float32)


# ------------------------------------------------------------------------------ oracle
def _bits(a):
    import numpy as np

    a = np.ascontiguousarray(a).reshape(-1)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[a.dtype.itemsize])


def _groups():
    """{label: (rows [m, n], oracle (mean, var) flat)}: the data sets and the rounding
    fixtures, stacked per (dtype, n, ddof) as the test suite stacks them."""
    import datasets
    import numpy as np
    import rounding_fixtures

    named = {}
    data = datasets.all_datasets()
    fixtures = rounding_fixtures.fixtures()
    for prefix, entries in (("data", data), ("fixture", fixtures)):
        keep_ddof = prefix == "fixture"
        stacked = rounding_fixtures.stacked(
            {k: (x, axes, ddof if keep_ddof else 0) for k, (x, axes, ddof) in entries.items()}
        )
        for key, (rows, names) in sorted(stacked.items()):
            if key[1] > LONGEST:
                continue
            ddof = key[2]
            want = [
                datasets.oracle(rows[[i for i, n in enumerate(names) if n == name]], (1,), ddof)
                for name in dict.fromkeys(names)
            ]
            oracle = tuple(np.concatenate([np.ravel(w[i]) for w in want]) for i in (0, 1))
            named[f"{prefix} {rounding_fixtures.group_id(key)}"] = (rows, ddof, oracle)
    return named


def oracle_part(args):
    import jax
    import numpy as np

    import jax_kernel
    from jax_kernel import _moments as jax_moments

    start = time.perf_counter()
    groups = _groups()
    print(f"oracle: {len(groups)} groups ({time.perf_counter() - start:.1f} s of oracle)")
    bad = slices = 0

    def compiled(item):  # one XLA compilation per group, several at once
        rows, ddof, _ = item
        with jax.enable_x64(rows.dtype in (np.float64, np.complex128)):
            fn = jax.jit(lambda v: jax_kernel.moments(v, (1,), ddof=ddof))
            t = time.perf_counter()
            exe = fn.lower(rows).compile()
            return exe, time.perf_counter() - t

    compile_s = []
    with ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2))) as pool:
        done = pool.map(compiled, groups.values())  # in order, as they finish
        for i, ((label, (rows, _, want)), (exe, t)) in enumerate(zip(groups.items(), done)):
            compile_s.append(t)
            with jax.enable_x64(rows.dtype in (np.float64, np.complex128)):
                out = [np.asarray(o) for o in jax.block_until_ready(exe(rows))]
            wrong = sum(int(np.sum(_bits(g) != _bits(w))) for g, w in zip(out, want))
            bad += wrong
            slices += len(rows)
            if wrong:
                print(f"  MISMATCH {label}: {wrong} of {len(rows)} slices", flush=True)
            if i % 10 == 9:
                print(
                    f"  {i + 1} groups, {bad} differing [{time.perf_counter() - start:.0f} s]",
                    flush=True,
                )
    print(
        f"oracle bits, JAX jit: {slices} slices in {len(groups)} groups, {bad} differing "
        f"bits patterns from the oracle; compilations {min(compile_s):.2f}-{max(compile_s):.2f} s"
        f" (median {sorted(compile_s)[len(compile_s) // 2]:.2f} s)",
        flush=True,
    )
    # Item 1: slices left open on BN-shaped data, 64 channels (fewer for 2**20).
    for kind in ("N(0,1)", "N(0,1e-3)", "ReLU"):
        cells = []
        for n in BN_LENGTHS:
            channels = 64 if n <= 65536 else 16
            x = np.random.default_rng(n).standard_normal((n, channels))
            x = {"N(0,1)": x, "N(0,1e-3)": 1e-3 * x, "ReLU": np.maximum(x, 0)}[kind]
            frac = jax_moments.undecided_fraction(x.astype(np.float32), (0,))
            cells.append(f"n={n}: {frac:.3f}")
        print(f"open slices, {kind}: {', '.join(cells)}", flush=True)
    return bad == 0


def tf_oracle_part(args):
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-300:]
    print(f"oracle bits, TF (pytest): {tail} [{time.perf_counter() - start:.0f} s]")
    return run.returncode == 0


# ------------------------------------------------------------------------------- speed
def speed_part(args):
    import jax
    import jax.numpy as jnp

    import jax_kernel
    from jax_kernel import _moments as jax_moments

    tf = None
    if _has("tensorflow"):
        import tensorflow as tf

        import tf_stable_moments
        from tf_stable_moments import _moments as tf_moments
    head = "| case | JAX jit / jnp.var | first call (jnp.var) | exact-path slices"
    head += " | TF jit_compile / tf.nn.moments | first call (tf.nn.moments) |" if tf else " |"
    print(head)
    print("|---" * head.count(" | ") + "|---|")
    for label, shape, axes, loc in CASES:
        x = _data(shape, loc)
        xj = jnp.asarray(x)
        ours = jax.jit(lambda v, a=axes: jax_kernel.moments(v, a))
        ref = jax.jit(lambda v, a=axes: (jnp.mean(v, a), jnp.var(v, a)))

        def call(f, v=xj):
            return lambda: jax.block_until_ready(f(v))

        first, ref_first = _first(call(ours)), _first(call(ref))
        ratio = _median(call(ours), args.reps) / _median(call(ref), args.reps)
        open_ = jax_moments.undecided_fraction(xj, axes)
        row = f"| {label} | {ratio:.2f}x | {first:.2f} s ({ref_first:.2f} s) | {open_:.3f}"
        if tf:
            xt = tf.constant(x)
            ours_tf = tf.function(
                lambda v, a=axes: tf_stable_moments.moments(v, list(a)), jit_compile=True
            )
            ref_tf = tf.function(lambda v, a=axes: tf.nn.moments(v, list(a)), jit_compile=True)

            def tcall(f, v=xt):
                return lambda: [t.numpy() for t in f(v)]

            tfirst, tref_first = _first(tcall(ours_tf)), _first(tcall(ref_tf))
            tratio = _median(tcall(ours_tf), args.reps) / _median(tcall(ref_tf), args.reps)
            topen = tf_moments.undecided_fraction(xt, list(axes))
            row += f" / TF {topen:.3f} | {tratio:.2f}x | {tfirst:.2f} s ({tref_first:.2f} s)"
        print(row + " |", flush=True)
    return True


# ------------------------------------------------------------------------------ models
def models_part(args):
    import models

    plan = [("jax", ("jit",))]
    if _has("tensorflow"):
        plan.insert(0, ("tensorflow", ("jit_compile",)))
    results = models.run_backends("ResNet50", 32, 16, args.steps, tuple(plan))
    print(f"ResNet50 32x32, batch 16, every BN swapped; seconds, ours / keras; {args.steps} steps")
    print("| framework | first step | steady step | new batch size (15) |")
    print("|---|---|---|---|")
    for key, value in results.items():
        cells = [f"{o:.2f} / {k:.2f} = {o / k:.2f}x" for k, o in zip(value["keras"], value["ours"])]
        print(f"| {key} | {' | '.join(cells)} |", flush=True)
    return bool(results)


def flax_part(args):
    import models

    steps = max(args.steps, 2) * 10
    r = models.flax_experiment("CNN", 1e4, steps)
    f, o = r["flax"], r["ours"]
    print(f"Flax CNN, inputs around 1e4, {steps} steps of 64 (optax Adam, jax.jit); seconds")
    print(
        "| first step: Flax / ours (ratio) | steady: Flax / ours (ratio) | accuracy: Flax / ours |"
    )
    print("|---|---|---|")
    print(
        f"| {f['first']:.2f} / {o['first']:.2f} ({o['first'] / f['first']:.2f}) | "
        f"{f['steady'] * 1e3:.2f} / {o['steady'] * 1e3:.2f} ms ({o['steady'] / f['steady']:.2f}) | "
        f"{f['accuracy']:.3f} / {o['accuracy']:.3f} |",
        flush=True,
    )
    return True


RUNNERS = {
    "oracle": oracle_part,
    "tf_oracle": tf_oracle_part,
    "speed": speed_part,
    "models": models_part,
    "flax": flax_part,
}


# ------------------------------------------------------------------------------ driver
def _run_part(part, pairs, args, log, limit):
    env = dict(os.environ)
    if pairs is not None:
        env["TF_STABLE_MOMENTS_F32_PAIRS"] = pairs
    what = part + ("" if pairs is None else f" (TF_STABLE_MOMENTS_F32_PAIRS={pairs})")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--part",
        part,
        "--reps",
        str(args.reps),
        "--steps",
        str(args.steps),
    ]
    start = time.perf_counter()
    # A session of its own: at the limit the part and its own subprocesses stop together.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
        out, rc = out + (err[-3000:] if proc.returncode else ""), proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out, rc = out + f"\n(stopped at the {limit:.0f} s limit)", "timeout"
    text = f"\n## {what}: rc {rc}, {time.perf_counter() - start:.0f} s\n{out.rstrip()}\n"
    print(text, flush=True)
    if log:
        with open(log, "a") as f:
            f.write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--part", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steady steps per model")
    parser.add_argument("--limit", type=float, default=240, help="seconds per part")
    parser.add_argument("--deadline", type=float, default=3600, help="seconds for all parts")
    parser.add_argument("--pairs-last", action="store_true", help="forced float32 pairs last")
    parser.add_argument("--log", help="append each part's output to this file")
    args = parser.parse_args()
    if args.part:
        sys.exit(0 if RUNNERS[args.part](args) else 1)
    import jax

    if not _has("tensorflow"):  # keras's default backend needs TensorFlow
        os.environ.setdefault("KERAS_BACKEND", "jax")
    device = jax.devices()[0]
    facts = {
        "device": f"{device.platform} ({device.device_kind})",
        "jax": jax.__version__,
        "tensorflow": _has("tensorflow"),
        "keras": _has("keras"),
        "flax": _has("flax"),
        "TF_STABLE_MOMENTS_NATIVE": os.environ["TF_STABLE_MOMENTS_NATIVE"],
    }
    print("# " + json.dumps(facts), flush=True)
    if args.log:
        with open(args.log, "a") as f:
            f.write("# " + json.dumps(facts) + "\n")
    plan = []
    for part in args.parts:
        if part in ("oracle", "speed"):
            plan += [(part, "0"), (part, "1")]
            if part == "oracle" and facts["tensorflow"]:
                plan.append(("tf_oracle", None))
        elif part == "flax" and not facts["flax"] or part == "models" and not facts["keras"]:
            print(f"\n## {part}: skipped ({part} needs {'flax' if part == 'flax' else 'keras'})")
        else:
            plan.append((part, None))
    if args.pairs_last:  # the default choice of every part first, forced pairs after
        plan.sort(key=lambda p: p[1] == "1")
    start = time.perf_counter()
    for part, pairs in plan:
        left = args.deadline - (time.perf_counter() - start)
        if left < 20:
            print(f"\n## {part}: skipped (the {args.deadline:.0f} s deadline)", flush=True)
            continue
        _run_part(part, pairs, args, args.log, min(args.limit, left))


if __name__ == "__main__":
    main()
