"""Speed of tf_stable_moments against tf.nn.moments, jnp.var and one memory pass.

One process, interleaved repetitions after warm-up (each timed call preceded by an
untimed call of the same implementation), medians and ratios side by side.  Also:
the fraction of slices the fast path decides (the rest take the exact path) on the
design note's data sets and on harder ones, in TF and JAX, and what a call costs
when some slice needs the exact path.
Usage: python benchmarks/speed.py [--quick] [--reps 15] [--out results] [--sweep | --sweep-only]

--sweep adds a size sweep (time against the number of elements, 2**10 ... 2**26 in steps
of 4x, float32 N(1e6, 1) of shape [2**k / 1024, 1024] reduced along axis 1, every mode
against tf.nn.moments, jnp.var and one reduce_sum pass) plotted log-log into
results/speed.png; --sweep-only runs only that.  It is not in the default run.  The XLA
kernel under jit_compile (what an accelerator runs; on this CPU jit_compile calls the
native kernel) compiles the whole kernel once per shape (seconds each on a small
machine), so it is timed at four of the sizes only.
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
from jax_kernel import _moments as jax_moments  # noqa: E402
from tf_stable_moments import _moments as tf_moments  # noqa: E402
from tf_stable_moments import _native as tf_native  # noqa: E402
from tf_stable_moments._report import design_note_datasets  # noqa: E402

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
# --quick: one small shape, D2's, shared by every section (XLA compiles per shape and
# mode, a few seconds each on a small machine: the compiles are most of its time).
QUICK_SHAPE = (64, 1000)
QUICK_CASES = [("[64,1000] axis 1", QUICK_SHAPE, (1,))]


def note_reference(x, axes):
    """The design note's reference formula: two-term, no shift."""
    m = jnp.mean(x, axis=axes, keepdims=True)
    d = x - m
    var = jnp.maximum(jnp.mean(d * d, axis=axes) - jnp.mean(d, axis=axes) ** 2, 0)
    return jnp.squeeze(m, axes), var


def xla_kernel(fn):
    """fn as tf.function(jit_compile=True), traced with the native kernel off: the XLA
    kernel built into the computation, what an accelerator runs (on this CPU the native
    kernel serves jit_compile as an XLA custom call)."""

    def traced(v):
        with tf_native.switched_off():
            return fn(v)

    return tf.function(traced, jit_compile=True, autograph=False)


def implementations(axes, rank):
    ax = list(axes)
    ours_fn = tf.function(lambda v: tf_stable_moments.moments(v, ax))
    unknown = [tf.TensorSpec([None] * rank, tf.float32)]
    ours_dyn = tf.function(lambda v: tf_stable_moments.moments(v, ax), input_signature=unknown)
    ours_xla = tf.function(lambda v: tf_stable_moments.moments(v, ax), jit_compile=True)
    ours_kernel = xla_kernel(lambda v: tf_stable_moments.moments(v, ax))
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
        "ours XLA, XLA kernel": ("tf", ours_kernel),
        "tf.nn.moments XLA": ("tf", ref_xla),
        "reduce_sum XLA (floor)": ("tf", floor_xla),
        "ours JAX jit": ("jax", lambda v: jax_kernel.moments(v, axes)),
        "note reference JAX jit": ("jax", jax.jit(lambda v: note_reference(v, axes))),
        "jnp.var JAX jit": ("jax", jax.jit(lambda v: (jnp.mean(v, axes), jnp.var(v, axis=axes)))),
        "jnp.sum JAX jit (floor)": ("jax", jax.jit(lambda v: jnp.sum(v, axis=axes))),
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
    """Temporary buffer of the compiled JAX computation (exact, from XLA's buffer
    assignment), or None where this JAX does not report it."""
    try:
        analysis = jax.jit(fn).lower(arg).compile().memory_analysis()
        return int(analysis.temp_size_in_bytes)
    except (AttributeError, NotImplementedError, TypeError):
        return None


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
    for kind, fn in impls.values():  # warm up: trace and compile
        _block(fn(inputs[kind]))
        _block(fn(inputs[kind]))
    times = {name: [] for name in impls}
    for _ in range(reps):  # interleaved
        for name, (kind, fn) in impls.items():
            # One untimed call first: the timed one then follows a call of its own
            # framework, not the other one's idle threads (which cost the first JAX
            # call after TensorFlow ops up to 3x on the 1 MiB case of a 2-core machine).
            _block(fn(inputs[kind]))
            start = time.perf_counter()
            _block(fn(inputs[kind]))
            times[name].append(time.perf_counter() - start)
    memory = {name: _peak_extra_bytes(fn, inputs[kind]) for name, (kind, fn) in impls.items()}
    # The resident high-water mark misses what an earlier case already touched; XLA's
    # temporary buffer is exact (JAX; TensorFlow compiles the same steps).
    temp = {name: _xla_temp_bytes(fn, inputs[k]) for name, (k, fn) in impls.items() if k == "jax"}
    med = {name: statistics.median(t) for name, t in times.items()}
    slices = x.size // int(np.prod([shape[a] for a in axes]))
    return {
        "case": label,
        "shape": shape,
        "axes": axes,
        "input_bytes": x.nbytes,
        # Slices of this input that the fast path leaves to the exact path (part of "ours"):
        # the native kernel's, and the XLA kernel's (both decide ties of exact sums on the
        # inputs' lattice, docs section 5).
        "exact_path_slices": round(tf_moments.undecided_fraction(inputs["tf"], axes) * slices),
        "exact_path_slices_xla": _xla_undecided(x, axes),
        "slices": slices,
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


# ------------------------------------------------------------- fraction decided by the fast path

# Generated data sets: float32 [slices, n] along axis 1, n a power of two and not.  With
# n = 2**k, float32 data of one binade has many exact ties, which the fast path leaves to
# the exact path: N(1e6, 1) has an exactly halfway variance in about 1.5% of its slices
# with n = 4096 and 30% with n = 256, and a halfway mean in 1/64 with n = 64.
FRACTION_SHAPES = ((512, 1024), (512, 1000))
QUICK_FRACTION_SHAPES = (QUICK_SHAPE,)


def _cancelling(rng, shape, big):
    """Per slice n//4 values +big and n//4 values -big (they cancel exactly), the rest
    N(0, 1), shuffled: the mean is that of the N(0, 1) part, tiny against the bounds."""
    rows, n = shape
    q = n // 4
    out = np.concatenate(
        [np.full((rows, q), big), np.full((rows, q), -big), rng.normal(0, 1, (rows, n - 2 * q))],
        axis=1,
    )
    return rng.permuted(out, axis=1)


def _mixture(rng, shape, big):
    """Each element +big or -big (random sign) with probability 1/2, else N(0, 1)."""
    signs = rng.choice([-big, big], shape)
    return np.where(rng.random(shape) < 0.5, signs, rng.normal(0, 1, shape))


def fraction_datasets(shape, seed=0):
    """The generated data sets of the decided-fraction table: float32, slices along axis 1."""
    rng = np.random.default_rng(seed)
    data = {
        "N(0, 1)": rng.normal(0, 1, shape),
        "N(1e6, 1)": rng.normal(1e6, 1, shape),
        "Cauchy": rng.standard_cauchy(shape),
        "Pareto a=1": rng.pareto(1.0, shape),
        "+-1e30 or N(0,1), random": _mixture(rng, shape, 1e30),
        "+-1e30 cancelling + N(0,1)": _cancelling(rng, shape, 1e30),
        "+-1e15 or N(0,1), random": _mixture(rng, shape, 1e15),
        "+-1e15 cancelling + N(0,1)": _cancelling(rng, shape, 1e15),
    }
    return {name: (x.astype(np.float32), (1,)) for name, x in data.items()}


def _xla_undecided(x, axes):
    """The number of slices of x that the XLA kernel's fast path leaves open (JAX)."""
    x = np.asarray(x)
    with jax.enable_x64(x.dtype == np.float64):
        todo = jax_moments._fast(jnp.asarray(x), tuple(axes), 0, False)[2]
        return int(np.sum(np.asarray(todo)))


def decided_fractions(data):
    """{name: (TF, JAX, XLA)}: the fraction of the slices of each (x, axes) in `data` that
    the fast path decided, 1 - undecided_fraction, from each backend's kernel (TF and JAX:
    the native kernel on this CPU) and from the XLA kernel."""
    out = {}
    for name, (x, axes) in data.items():
        slices = x.size // int(np.prod([x.shape[a] for a in axes]))
        out[name] = (
            1.0 - tf_moments.undecided_fraction(tf.constant(x), axes),
            1.0 - jax_moments.undecided_fraction(jax.device_put(x), axes),
            1.0 - _xla_undecided(x, axes) / slices,
        )
    return out


def fraction_table(shapes):
    """Rows of the decided-fraction table: D1-D4 of the design note, then the generated sets."""
    sets = [(name, x, axes) for name, (x, axes) in design_note_datasets().items()]
    for shape in shapes:
        sets += [(name, x, axes) for name, (x, axes) in fraction_datasets(shape).items()]
    rows = []
    for name, x, axes in sets:
        tf_f, jax_f, xla_f = decided_fractions({name: (x, axes)})[name]
        slices = x.size // int(np.prod([x.shape[a] for a in axes]))
        rows.append(
            {
                "data": name,
                "shape": x.shape,
                "axes": axes,
                "slices": slices,
                "tf": tf_f,
                "jax": jax_f,
                "xla": xla_f,
            }
        )
    return rows


# ----------------------------------------------------------- cost of the exact path

EXACT_SHAPE = (4096, 4096)
QUICK_EXACT_SHAPE = QUICK_SHAPE
# --quick times only these in the exact-path table (each implementation compiles its own).
QUICK_EXACT_IMPLS = ("ours TF eager", "ours JAX jit", "tf.nn.moments eager")


def _decided_everywhere(x):
    """x [slices, n] with each slice the fast path leaves undecided (along axis 1) nudged
    by one ulp in its second element, until the fast path decides every slice."""
    # The JAX fast path inside a jit of its own: its per-slice flags, and no compile of
    # the computation that jax_kernel.moments runs (its first call is timed below).
    undecided = jax.jit(lambda v: jax_moments._fast(v, (1,), 0, False)[2])
    x = x.copy()
    for _ in range(20):
        with jax.enable_x64(True):
            todo = np.asarray(undecided(jax.device_put(x)))
        if not todo.any():
            return x
        rows = np.nonzero(todo)[0]
        x[rows, 1] = np.nextafter(x[rows, 1], np.float32(np.inf))
    raise RuntimeError("could not make every slice decided")


def exact_path_inputs(shape, seed=0):
    """float32 N(1e6, 1) [slices, n] variants, reduced along axis 1: every slice decided
    (the slices whose mean or variance is an exact tie, common with n = 2**k, nudged by
    one ulp), then one slice of it replaced by an exact tie ([0, 4097, 0, 4097, ...]) or
    by a cancelling one (n/4 values +1e15, n/4 values -1e15, the rest N(0, 1)), and the
    data as drawn."""
    raw = np.random.default_rng(seed).normal(1e6, 1.0, shape).astype(np.float32)
    clean = _decided_everywhere(raw)
    row = shape[0] // 2
    tie = clean.copy()  # mean 2048.5, variance 2048.5**2: exactly halfway between two floats
    tie[row] = np.resize(np.float32([0, 4097]), shape[1])
    cancel = clean.copy()
    cancel[row] = _cancelling(np.random.default_rng(seed + 1), (1, shape[1]), 1e15)[0]
    return {
        "all decided": clean,
        "one tie slice": tie,
        "one cancelling slice": cancel,
        "as drawn": raw,
    }


def exact_path_cost(shape, reps, only=None):
    """Medians of calls on the exact_path_inputs variants (interleaved, after warm-up),
    and the first call on the tie variant after warm-up on the decided one: it compiles
    the exact path where the backend compiles it separately (TF; JAX outside jit)."""
    variants = exact_path_inputs(shape)
    inputs = {k: {"tf": tf.constant(x), "jax": jax.device_put(x)} for k, x in variants.items()}
    impls = {
        "ours TF eager": ("tf", lambda v: tf_stable_moments.moments(v, [1])),
        "ours tf.function": ("tf", tf.function(lambda v: tf_stable_moments.moments(v, [1]))),
        "ours JAX jit": ("jax", lambda v: jax_kernel.moments(v, (1,))),
        "ours inside jax.jit": ("jax", jax.jit(lambda v: jax_kernel.moments(v, (1,)))),
        "tf.nn.moments eager": ("tf", lambda v: tf.nn.moments(v, [1])),
    }
    impls = {k: v for k, v in impls.items() if only is None or k in only}
    clean, tie = inputs["all decided"], inputs["one tie slice"]
    first = {}
    for name, (kind, fn) in impls.items():  # first calls: nothing has run on this shape yet
        start = time.perf_counter()
        _block(fn(clean[kind]))
        first[name] = {"first_decided_s": time.perf_counter() - start}
        _block(fn(clean[kind]))
        for label in ("first_tie_s", "second_tie_s"):
            start = time.perf_counter()
            _block(fn(tie[kind]))
            first[name][label] = time.perf_counter() - start
    for kind, fn in impls.values():  # warm up on the timed inputs
        for v in inputs.values():
            _block(fn(v[kind]))
    times = {(name, k): [] for name in impls for k in variants}
    for _ in range(reps):  # interleaved over implementations and variants
        for k, v in inputs.items():
            for name, (kind, fn) in impls.items():
                start = time.perf_counter()
                _block(fn(v[kind]))
                times[(name, k)].append(time.perf_counter() - start)
    med = {name: {k: statistics.median(times[(name, k)]) for k in variants} for name in impls}
    exact_slices = {
        k: round(tf_moments.undecided_fraction(v["tf"], (1,)) * shape[0]) for k, v in inputs.items()
    }
    return {
        "shape": shape,
        "axes": (1,),
        "exact_path_slices": exact_slices,
        "median_s": med,
        "first_calls": first,
    }


def print_exact_path_cost(r, reps):
    shape = r["shape"]
    print(
        f"\ncost of the exact path: [{shape[0]},{shape[1]}] float32 N(1e6, 1) along axis 1, "
        f"median ms of {reps} interleaved runs after warm-up (ratio to 'all decided')"
    )
    variants = list(r["exact_path_slices"])
    print(
        "  (all decided: as drawn with its exact ties nudged by one ulp; one tie slice: one"
        " slice [0, 4097, 0, 4097, ...];\n   one cancelling slice: one slice of n/4 x +1e15,"
        " n/4 x -1e15, n/2 x N(0,1); as drawn: N(1e6, 1) itself)"
    )
    for k in variants:
        print(f"  {k:22} {r['exact_path_slices'][k]:5d} of {shape[0]} slices take the exact path")
    head = "".join(f" {k:>22}" for k in variants)
    print(f"  {'implementation':22}{head}")
    for name, med in r["median_s"].items():
        base = med["all decided"]
        cells = "".join(
            f" {med[k] * 1e3:14.2f} ({med[k] / base:5.2f})"
            if k != "all decided"
            else f" {med[k] * 1e3:22.2f}"
            for k in variants
        )
        print(f"  {name:22}{cells}")
    print(
        "\nfirst calls on this shape (ms; rows in the order run, nothing ran on this shape"
        " before): the first call with every slice decided (compiles the fast path;\n"
        "'inside jax.jit' compiles the whole kernel, exact path included), a second one,"
        " then the first and second call with one tie slice: first - second is the exact\n"
        "path's compile (and trace) time where it is a computation of its own"
        " (TF eager, tf.function, JAX outside jit)"
    )
    print(
        f"  {'implementation':22} {'first, decided':>15} {'first, tie':>11} {'second, tie':>12}"
        f" {'first - second, tie':>20}"
    )
    for name, f in r["first_calls"].items():
        compile_s = f["first_tie_s"] - f["second_tie_s"]
        print(
            f"  {name:22} {f['first_decided_s'] * 1e3:15.1f} {f['first_tie_s'] * 1e3:11.1f} "
            f"{f['second_tie_s'] * 1e3:12.1f} {compile_s * 1e3:20.1f}"
        )


def print_fractions(rows):
    print(
        "\nfraction of slices the fast path decides (the rest take the exact path), "
        "TF and JAX kernels (native on this CPU; agree: TF == JAX), and the XLA kernel (both "
        "decide ties of exact sums on the inputs' lattice):"
    )
    head = f"{'TF':>8} {'JAX':>8} {'undecided':>14}  agree {'XLA':>8}"
    print(f"  {'data':28} {'shape':12} {'axes':5} {head}")
    for row in rows:
        undecided = f"{round((1 - row['tf']) * row['slices'])} of {row['slices']}"
        agree = "yes" if row["tf"] == row["jax"] else "NO"
        print(
            f"  {row['data']:28} {str(list(row['shape'])):12} {str(row['axes']):5} "
            f"{row['tf']:8.4f} {row['jax']:8.4f} {undecided:>14}  {agree:5} {row['xla']:8.4f}"
        )


def ratios(result):
    m = result["median_s"]
    out = {}
    for mode in ("eager", "tf.function", "XLA"):
        key = "TF eager" if mode == "eager" else mode
        out[f"ours/tf.nn.moments {mode}"] = m[f"ours {key}"] / m[f"tf.nn.moments {mode}"]
    out["ours XLA kernel/tf.nn.moments XLA"] = m["ours XLA, XLA kernel"] / m["tf.nn.moments XLA"]
    out["ours XLA/reduce_sum XLA"] = m["ours XLA"] / m["reduce_sum XLA (floor)"]
    out["ours XLA kernel/reduce_sum XLA"] = m["ours XLA, XLA kernel"] / m["reduce_sum XLA (floor)"]
    out["ours JAX/note reference"] = m["ours JAX jit"] / m["note reference JAX jit"]
    out["ours JAX/jnp.var"] = m["ours JAX jit"] / m["jnp.var JAX jit"]
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
        "design": "per slice a float64 approximation of mean and variance (float64 pairs "
        "for float64 input) with a rigorous error bound; a rounding test decides the "
        "correctly rounded result; undecided slices and slices with NaN/Inf take the exact "
        "integer path (moments_core/_kernel.py, _exact.py). TF eager/graph and JAX outside "
        "jit: the native kernel (C++; inside jit_compile on the CPU an XLA custom call, "
        "in JAX an FFI call); the XLA kernel (accelerators): fast and exact path as separate "
        "XLA computations where they can be, the exact one run only when some slice is "
        "undecided, and inside a user's jit_compile / jax.jit one computation (the exact "
        "path a while loop with no iteration when every slice is decided)",
        # glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh
        # pages: XLA temporaries above it page-fault on every call (JAX), see README.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "data": "N(1e6, 1) float32 (timings)",
    }


def print_case(r, reps):
    print(f"\n{r['case']}  ({r['input_bytes'] / 2**20:.0f} MiB, median of {reps} interleaved runs)")
    print(
        f"  {r['exact_path_slices']} of {r['slices']} slices of this input take the exact path"
        f" in the native kernel (TF eager, tf.function, JAX jit), {r['exact_path_slices_xla']}"
        " in the XLA kernel (ours XLA, XLA kernel)"
    )
    head = f"{'implementation':32} {'median ms':>10} {'input GB/s':>11} {'peak +MiB':>10}"
    print(f"  {head} {'XLA temp MiB':>13}")
    for name, t in r["median_s"].items():
        mem = r["peak_extra_bytes"][name]
        mem_s = f"{mem / 2**20:10.1f}" if mem is not None else f"{'n/a':>10}"
        temp = r["xla_temp_bytes"].get(name)
        temp_s = f"{temp / 2**20:13.1f}" if temp is not None else f"{'':>13}"
        speed = r["input_bytes"] / t / 1e9
        print(f"  {name:32} {t * 1e3:10.2f} {speed:11.2f} {mem_s} {temp_s}")
    for k, v in r["ratios"].items():
        print(f"  ratio {k:40} {v:6.2f}")


# ------------------------------------------------------------------------- size sweep

SWEEP_COLUMNS = 1024  # slices of 1024 elements along axis 1: [2**k / 1024, 1024]
SWEEP_POWERS = tuple(range(10, 27, 2))
QUICK_SWEEP_POWERS = (10, 14)
# The XLA kernel compiles per shape (exact path included): timed at these only.
SWEEP_XLA_POWERS = (10, 14, 18, 22)
SWEEP_XLA = "ours XLA kernel (jit_compile, accelerators' path)"


def sweep_implementations():
    ax = [1]

    def tf_fn(f, jit=False):
        return tf.function(f, jit_compile=jit, autograph=False)

    return {
        "ours TF eager": ("tf", lambda v: tf_stable_moments.moments(v, ax)),
        "ours tf.function": ("tf", tf_fn(lambda v: tf_stable_moments.moments(v, ax))),
        "ours XLA (jit_compile)": ("tf", tf_fn(lambda v: tf_stable_moments.moments(v, ax), True)),
        SWEEP_XLA: ("tf", xla_kernel(lambda v: tf_stable_moments.moments(v, ax))),
        "ours JAX jit (native FFI)": ("jax", lambda v: jax_kernel.moments(v, (1,))),
        "tf.nn.moments eager": ("tf", lambda v: tf.nn.moments(v, ax)),
        "jnp.var JAX jit": (
            "jax",
            jax.jit(lambda v: (jnp.mean(v, 1), jnp.var(v, axis=1))),
        ),
        "reduce_sum XLA (one pass)": ("tf", tf_fn(lambda v: tf.reduce_sum(v, ax), True)),
    }


def size_sweep(powers, reps, budget_s=1.0):
    """Median seconds per call for each implementation and size 2**k, interleaved per size
    after two warm-up calls (compiles); repetitions per size: `reps`, fewer where one
    round of calls takes long (at least 3, about `budget_s` per implementation)."""
    impls = sweep_implementations()
    rows = []
    all_impls = impls
    for k in powers:
        impls = {n: v for n, v in all_impls.items() if n != SWEEP_XLA or k in SWEEP_XLA_POWERS}
        shape = (2**k // SWEEP_COLUMNS, SWEEP_COLUMNS)
        x = np.random.default_rng(k).normal(1e6, 1.0, shape).astype(np.float32)
        inputs = {"tf": tf.constant(x), "jax": jax.device_put(x)}
        start = time.perf_counter()
        for kind, fn in impls.values():
            _block(fn(inputs[kind]))
            _block(fn(inputs[kind]))
        one_round = time.perf_counter() - start
        n = max(3, min(reps, int(budget_s * len(impls) / max(one_round / 2, 1e-9))))
        times = {name: [] for name in impls}
        for _ in range(n):
            for name, (kind, fn) in impls.items():
                t0 = time.perf_counter()
                _block(fn(inputs[kind]))
                times[name].append(time.perf_counter() - t0)
        exact = round(tf_moments.undecided_fraction(inputs["tf"], (1,)) * shape[0])
        rows.append(
            {
                "elements": 2**k,
                "shape": shape,
                "reps": n,
                "exact_path_slices": exact,
                "median_s": {name: statistics.median(t) for name, t in times.items()},
            }
        )
        med = rows[-1]["median_s"]
        print(
            f"  2**{k:2d} {str(list(shape)):14} ({exact:5d} of {shape[0]:5d} slices exact) "
            + " ".join(
                f"{med[name] * 1e3:9.3f}" if name in med else f"{'-':>9}" for name in all_impls
            )
        )
    return rows


def print_sweep_header():
    names = list(sweep_implementations())
    print(
        f"\nsize sweep: float32 N(1e6, 1) [2**k / {SWEEP_COLUMNS}, {SWEEP_COLUMNS}] along axis 1,"
        " median ms (interleaved per size); columns:"
    )
    for i, name in enumerate(names):
        print(f"  {i + 1}. {name}")


def plot_sweep(rows, path, title):
    """Time against number of elements, log-log, one line per implementation (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {
        "ours": {"linewidth": 2.0},
        "tf.nn": {"linestyle": "--"},
        "jnp": {"linestyle": "--"},
        "reduce_sum": {"linestyle": ":", "color": "black"},
    }
    for name in sweep_implementations():
        style = next(v for k, v in styles.items() if name.startswith(k))
        got = [(r["elements"], r["median_s"][name]) for r in rows if name in r["median_s"]]
        ax.plot(*zip(*got), marker="o", ms=3, label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"elements (float32 N(1e6, 1), [n / {SWEEP_COLUMNS}, {SWEEP_COLUMNS}] axis 1)")
    ax.set_ylabel("seconds per call (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small cases, few repetitions")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="results")
    parser.add_argument("--sweep", action="store_true", help="add the size sweep and its plot")
    parser.add_argument("--sweep-only", action="store_true", help="only the size sweep")
    args = parser.parse_args(argv)
    quick = args.quick
    cases, reps = (QUICK_CASES, 3) if quick else (CASES, args.reps)
    start = time.perf_counter()
    print(
        f"cpu: {environment()['cpu']}, {os.cpu_count()} cores; jax {jax.default_backend()}; "
        f"load average at start {_load()}"
    )
    os.makedirs(args.out, exist_ok=True)
    sweep = None
    if args.sweep or args.sweep_only:
        section = time.perf_counter()
        print_sweep_header()
        sweep = size_sweep(QUICK_SWEEP_POWERS if quick else SWEEP_POWERS, reps)
        env = environment()
        title = (
            f"{env['cpu']}, {env['cores']} cores; TF {env['tensorflow']}, JAX {env['jax']}; "
            f"load average {_load()}"
        )
        png = os.path.join(args.out, "speed.png")
        plot_sweep(sweep, png, title)
        print(f"  wrote {png}")
        _took(section)
        if args.sweep_only:
            path = os.path.join(args.out, "speed_sweep.json")
            with open(path, "w") as f:
                json.dump({"environment": env, "sweep": sweep}, f, indent=1)
            print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s)")
            return sweep
    # First, so that no earlier call has compiled the exact path for its shape.
    section = time.perf_counter()
    exact_shape, only = (QUICK_EXACT_SHAPE, QUICK_EXACT_IMPLS) if quick else (EXACT_SHAPE, None)
    exact = exact_path_cost(exact_shape, reps, only)
    print_exact_path_cost(exact, reps)
    section = _took(section)
    results = []
    for label, shape, axes in cases:
        r = bench_case(label, shape, axes, reps)
        r["ratios"] = ratios(r)
        results.append(r)
        print_case(r, reps)
        section = _took(section)
    compiles = batch_size_compiles(BATCH_SIZES[:2] if quick else BATCH_SIZES)
    print("\nfirst / second call, tf.function with an unknown batch size, [batch, 256] axis 0:")
    for c in compiles:
        print(
            f"  batch {c['batch']:4d}: {c['first_s'] * 1e3:8.1f} ms / {c['second_s'] * 1e3:6.1f} ms"
        )
    section = _took(section)
    fractions = fraction_table(QUICK_FRACTION_SHAPES if quick else FRACTION_SHAPES)
    print_fractions(fractions)
    _took(section)
    path = os.path.join(args.out, "speed.json")
    with open(path, "w") as f:
        record = {"environment": environment(), "reps": reps, "results": results, "sweep": sweep}
        record.update(batch_size_compiles=compiles, exact_path=_jsonable(exact))
        json.dump(dict(record, decided_fractions=fractions), f, indent=1)
    print(f"\nwrote {path} ({time.perf_counter() - start:.0f} s; load average at end {_load()})")
    return results


def _load():
    """The 1, 5 and 15 minute load averages (other processes skew the timings)."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def _took(since):
    """Print the seconds since `since` (compiles included) and return now."""
    now = time.perf_counter()
    print(f"  (section: {now - since:.0f} s, compiles included)")
    return now


def _jsonable(r):
    """The exact-path record with its (implementation, variant) tables as nested dicts."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in r.items()}


if __name__ == "__main__":
    main()
