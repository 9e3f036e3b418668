"""Speed of tf_stable_moments against tf.nn.moments, jnp.var and one memory pass.

One process, interleaved repetitions after warm-up, medians and ratios side by
side.  Usage: python benchmarks/speed.py [--quick] [--reps 15] [--out results]
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tensorflow as tf  # noqa: E402

import jax_kernel  # noqa: E402
import tf_stable_moments  # noqa: E402
from tf_stable_moments import _kernel, _moments  # noqa: E402

CASES = [
    ("[4096,4096] axis 1", (4096, 4096), (1,)),
    ("[4096,4096] axis 0", (4096, 4096), (0,)),
    ("[128,32,32,64] axes 0,1,2", (128, 32, 32, 64), (0, 1, 2)),
    ("[256,1024] axis 1", (256, 1024), (1,)),
    ("[4000,4000] axis 1 (n not a power of two)", (4000, 4000), (1,)),
    ("[100,32,32,64] axes 0,1,2 (batch of 100)", (100, 32, 32, 64), (0, 1, 2)),
]
# First calls of a tf.function with an unknown batch size: XLA compiles once per bucket.
BATCH_SIZES = (100, 101, 102, 103, 120, 128, 64, 33, 34, 35)
# Inputs of at least this many elements also time the kernel's passes (stages()).
STAGE_MIN_SIZE = 1 << 22
QUICK_CASES = [
    ("[512,512] axis 1", (512, 512), (1,)),
    ("[16,8,8,16] axes 0,1,2", (16, 8, 8, 16), (0, 1, 2)),
]


def note_reference(x, axes):
    """The design note's reference formula: two-term, no shift."""
    m = jnp.mean(x, axis=axes, keepdims=True)
    d = x - m
    var = jnp.maximum(jnp.mean(d * d, axis=axes) - jnp.mean(d, axis=axes) ** 2, 0)
    return jnp.squeeze(m, axes), var


def implementations(axes, rank):
    ax = list(axes)
    ours_fn = tf.function(lambda v: tf_stable_moments.moments(v, ax))
    unknown = [tf.TensorSpec([None] * rank, tf.float32)]
    ours_dyn = tf.function(lambda v: tf_stable_moments.moments(v, ax), input_signature=unknown)
    ours_xla = tf.function(lambda v: tf_stable_moments.moments(v, ax), jit_compile=True)
    ref_fn = tf.function(lambda v: tf.nn.moments(v, ax))
    ref_xla = tf.function(lambda v: tf.nn.moments(v, ax), jit_compile=True)
    floor_xla = tf.function(lambda v: tf.reduce_sum(v, ax), jit_compile=True)
    return {
        "ours TF eager": ("tf", lambda v: tf_stable_moments.moments(v, ax)),
        "tf.nn.moments eager": ("tf", lambda v: tf.nn.moments(v, ax)),
        "ours tf.function": ("tf", ours_fn),
        "tf.nn.moments tf.function": ("tf", ref_fn),
        "ours tf.function, unknown shape": ("tf", ours_dyn),
        "ours XLA": ("tf", ours_xla),
        "tf.nn.moments XLA": ("tf", ref_xla),
        "reduce_sum XLA (floor)": ("tf", floor_xla),
        "ours JAX jit": ("jax", lambda v: jax_kernel.moments(v, axes)),
        "note reference JAX jit": ("jax", jax.jit(lambda v: note_reference(v, axes))),
        "jnp.var JAX jit": ("jax", jax.jit(lambda v: (jnp.mean(v, axes), jnp.var(v, axis=axes)))),
        "jnp.sum JAX jit (floor)": ("jax", jax.jit(lambda v: jnp.sum(v, axis=axes))),
    }


def stages(axes):
    """The kernel's passes as separate XLA computations (TF, float32).

    Each runs the kernel's own functions on the wrapper's 2-D layout, so
    together they show where its time goes: max and min (step 0), the shift
    pass (steps 0-2: scale, shift, tree), and one compensated tree over an input
    that costs nothing to produce (the arithmetic and memory of the tree alone;
    the kernel runs two).  Only for inputs whose slice length is a power of two
    (no padding), and large enough that a call's dispatch is negligible.
    """
    fmt = _kernel.FORMATS[tf.float32]

    def max_min(v):
        x, axis = _moments._layout(v, axes)
        return _kernel.scale_exponent(_kernel.classify(x, axis)[0], fmt)

    def shift_pass(v):
        x, axis = _moments._layout(v, axes)
        count = _kernel.counts(x.shape[axis], 0, fmt)
        return _kernel.part_sums(x, max_min(v), count.rn, axis, fmt, True)[2]

    def one_tree(v):
        x, axis = _moments._layout(v, axes)
        return _kernel.tree_sum(x, x * 0.5, axis, True)

    def xla(fn):
        return tf.function(fn, jit_compile=True)

    return {
        "stage XLA: max and min": ("tf", xla(max_min)),
        "stage XLA: shift pass": ("tf", xla(shift_pass)),
        "stage XLA: one tree": ("tf", xla(one_tree)),
    }


def _block(out):
    for o in out if isinstance(out, (tuple, list)) else [out]:
        if isinstance(o, tf.Tensor):
            o.numpy()
        else:
            o.block_until_ready()


def _peak_extra_bytes(fn, arg):
    """Peak resident memory above the level before one call (Linux; else None)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        _block(fn(arg))
        return max(_status("VmHWM") - before, 0)
    except OSError:
        return None


def _xla_temp_bytes(fn, arg):
    """Temporary buffer of the compiled JAX computation (exact, from XLA's buffer assignment)."""
    return int(jax.jit(fn).lower(arg).compile().memory_analysis().temp_size_in_bytes)


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def bench_case(label, shape, axes, reps):
    x = np.random.default_rng(0).normal(1e6, 1.0, shape).astype(np.float32)
    inputs = {"tf": tf.constant(x), "jax": jax.device_put(x)}
    impls = implementations(axes, len(shape))
    n = int(np.prod([shape[a] for a in axes]))
    # Each stage is a call of its own: only where a call's dispatch (~0.1 ms) is negligible.
    if n & (n - 1) == 0 and x.size >= STAGE_MIN_SIZE:
        impls.update(stages(axes))
    for kind, fn in impls.values():  # warm up: trace and compile
        _block(fn(inputs[kind]))
        _block(fn(inputs[kind]))
    times = {name: [] for name in impls}
    for _ in range(reps):  # interleaved
        for name, (kind, fn) in impls.items():
            start = time.perf_counter()
            _block(fn(inputs[kind]))
            times[name].append(time.perf_counter() - start)
    memory = {name: _peak_extra_bytes(fn, inputs[kind]) for name, (kind, fn) in impls.items()}
    # The resident high-water mark misses what an earlier case already touched; XLA's
    # temporary buffer is exact (JAX; TensorFlow compiles the same steps).
    temp = {name: _xla_temp_bytes(fn, inputs[k]) for name, (k, fn) in impls.items() if k == "jax"}
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "case": label,
        "shape": shape,
        "axes": axes,
        "input_bytes": x.nbytes,
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "peak_extra_bytes": memory,
        "xla_temp_bytes": temp,
    }


def batch_size_compiles(sizes=BATCH_SIZES, features=256):
    """Seconds of the first call per batch size, tf.function with an unknown batch size."""

    @tf.function(input_signature=[tf.TensorSpec([None, features], tf.float32)])
    def fn(v):
        return tf_stable_moments.moments(v, [0])

    out = []
    for b in sizes:
        x = tf.constant(np.random.default_rng(b).normal(1e6, 1.0, (b, features)), tf.float32)
        start = time.perf_counter()
        _block(fn(x))
        first = time.perf_counter() - start
        start = time.perf_counter()
        _block(fn(x))
        out.append({"batch": b, "first_s": first, "second_s": time.perf_counter() - start})
    return out


def ratios(result):
    m = result["median_s"]
    out = {}
    for mode in ("eager", "tf.function", "XLA"):
        key = "TF eager" if mode == "eager" else mode
        out[f"ours/tf.nn.moments {mode}"] = m[f"ours {key}"] / m[f"tf.nn.moments {mode}"]
    out["ours XLA/reduce_sum XLA"] = m["ours XLA"] / m["reduce_sum XLA (floor)"]
    out["ours JAX/note reference"] = m["ours JAX jit"] / m["note reference JAX jit"]
    out["ours JAX/jnp.var"] = m["ours JAX jit"] / m["jnp.var JAX jit"]
    if "stage XLA: one tree" in m:
        # What the two trees and max/min alone cost, against tf.nn.moments under XLA.
        floor = m["stage XLA: max and min"] + 2 * m["stage XLA: one tree"]
        out["(max,min + 2 trees)/tf.nn.moments XLA"] = floor / m["tf.nn.moments XLA"]
    return out


def environment():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "jax": jax.__version__,
        "numpy": np.__version__,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "TF_XLA_FLAGS": os.environ.get("TF_XLA_FLAGS", ""),
        "jax_backend": jax.default_backend(),
        "topology": "halving binary tree over zero padding to 2**k, TwoSum at every node, "
        "carries in a second array; 2 levels per XLA reduction; TF eager/graph: slices "
        "along axis 1 padded to 2**k (copies of the first element) before the XLA call",
        "passes": "4 reads of x under XLA: max and min (two reductions); the shift tree "
        "(SY, also the NaN test); the squares tree",
        # glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh
        # pages: XLA temporaries above it page-fault on every call (JAX), see README.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "accumulator_precision": "float32 double-float (hi + lo), no float64",
        "correction_precision": "double-float two-term correction and reciprocal pairs",
        "data": "N(1e6, 1) float32",
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small cases, few repetitions")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    cases, reps = (QUICK_CASES, 3) if args.quick else (CASES, args.reps)
    results = []
    for label, shape, axes in cases:
        r = bench_case(label, shape, axes, reps)
        r["ratios"] = ratios(r)
        results.append(r)
        print(f"\n{label}  ({r['input_bytes'] / 2**20:.0f} MiB, median of {reps} interleaved runs)")
        head = f"{'implementation':28} {'median ms':>10} {'input GB/s':>11} {'peak +MiB':>10}"
        print(f"  {head} {'XLA temp MiB':>13}")
        for name, t in r["median_s"].items():
            mem = r["peak_extra_bytes"][name]
            mem_s = f"{mem / 2**20:10.1f}" if mem is not None else f"{'n/a':>10}"
            temp = r["xla_temp_bytes"].get(name)
            temp_s = f"{temp / 2**20:13.1f}" if temp is not None else f"{'':>13}"
            speed = r["input_bytes"] / t / 1e9
            print(f"  {name:28} {t * 1e3:10.2f} {speed:11.2f} {mem_s} {temp_s}")
        for k, v in r["ratios"].items():
            print(f"  ratio {k:40} {v:6.2f}")
    compiles = batch_size_compiles(BATCH_SIZES[:3] if args.quick else BATCH_SIZES)
    print("\nfirst / second call, tf.function with an unknown batch size, [batch, 256] axis 0:")
    for c in compiles:
        print(
            f"  batch {c['batch']:4d}: {c['first_s'] * 1e3:8.1f} ms / {c['second_s'] * 1e3:6.1f} ms"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "speed.json")
    with open(path, "w") as f:
        record = {"environment": environment(), "reps": reps, "results": results}
        json.dump(dict(record, batch_size_compiles=compiles), f, indent=1)
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
