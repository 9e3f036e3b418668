"""The main job, `python -m tf_stable_moments`: this kernel vs tf.nn.moments vs the exact value."""

import argparse
import sys

import numpy as np

_MODES = ("eager", "tf.function", "XLA")
# Ours also with the XLA kernel under jit_compile (what accelerators run; on the CPU
# jit_compile calls the native kernel).
_KERNEL = "XLA kernel"


def design_note_datasets():
    """D1-D4 of the design note: numpy default_rng(0), float32, drawn in this order."""
    rng = np.random.default_rng(0)
    return {
        "D1 N(1000, 0.01)": (rng.normal(1000, 0.01, (1000, 64)).astype(np.float32), (0,)),
        "D2 N(1e4, 1)": (rng.normal(1e4, 1, (64, 1000)).astype(np.float32), (1,)),
        "D3 N(0, 1)": (rng.normal(0, 1, (1000, 64)).astype(np.float32), (0,)),
        "D4 N(1e6, 1)": (rng.normal(1e6, 1, (1000, 64)).astype(np.float32), (0,)),
    }


def identical_datasets():
    return {f"[{v:g}]*3": (np.full((3,), v, np.float32), (0,)) for v in (1e10, 7.5e10, 1e15, 1e38)}


def _slices(x, axes):
    kept = [a for a in range(x.ndim) if a not in axes]
    n = int(np.prod([x.shape[a] for a in axes]))
    return np.transpose(x, kept + list(axes)).reshape(-1, n)


def _run_tf(fn, x, axes, programs, xla_kernel=False):
    """{mode: variances of fn on x} for eager, tf.function, XLA (and with xla_kernel the
    XLA kernel under jit_compile: traced with the native kernel switched off).

    Each graph is traced once per (fn, mode, shape, dtype, axes) as a concrete function
    and reused for every dataset of that signature: datasets of one shape share one XLA
    compilation, and no tf.function retraces (nor warns that it does).
    """
    import tensorflow as tf

    from tf_stable_moments import _native

    def program(jit_compile, native=True):
        key = (fn, jit_compile, native, x.shape, x.dtype, axes)
        if key not in programs:
            graph = tf.function(lambda v: fn(v, list(axes)), jit_compile=jit_compile)
            spec = tf.TensorSpec(x.shape, x.dtype)
            if native:
                programs[key] = graph.get_concrete_function(spec)
            else:
                with _native.switched_off():
                    programs[key] = graph.get_concrete_function(spec)
        return programs[key]

    v = tf.constant(x)
    outs = {"eager": fn(v, list(axes)), "tf.function": program(False)(v), "XLA": program(True)(v)}
    if xla_kernel:
        outs[_KERNEL] = program(True, native=False)(v)
    return {m: np.asarray(out[1]).ravel() for m, out in outs.items()}


def report_rows(data):
    """One row per dataset: max ulp error of the variance per implementation and mode."""
    import tensorflow as tf

    import jax_kernel
    import tf_stable_moments
    from tf_stable_moments._oracle import exact_value, ulp_error

    rows, programs = [], {}
    for name, (x, axes) in data.items():
        exact = [exact_value(s, x.dtype)[1] for s in _slices(x, axes)]
        ours = _run_tf(tf_stable_moments.moments, x, axes, programs, xla_kernel=True)
        ours["JAX jit"] = np.asarray(jax_kernel.moments(x, axes)[1]).ravel()
        theirs = _run_tf(tf.nn.moments, x, axes, programs)
        worst = {}
        zero = all(e == 0 for e in exact)
        for label, results in (("ours", ours), ("tf.nn.moments", theirs)):
            for mode, var in results.items():
                if zero:  # the exact variance is 0: show the largest value returned
                    worst[f"{label} {mode}"] = f"var={np.max(np.abs(var)):.6g}"
                else:
                    errors = [ulp_error(v, e, x.dtype) for v, e in zip(var, exact)]
                    worst[f"{label} {mode}"] = f"{max(errors):.3g}"
        width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
        reference = ours["eager"].view(width)
        agree = all(np.array_equal(v.view(width), reference) for v in ours.values())
        rows.append((name, x.shape, axes, worst, agree))
    return rows


def format_rows(rows):
    ours = [f"ours {m}" for m in (*_MODES, _KERNEL, "JAX jit")]
    columns = ours + [f"tf.nn.moments {m}" for m in _MODES]
    lines = [
        "max ulp error of the variance against the exact value (<= 0.5: correctly rounded);",
        "where the exact variance is 0, the largest variance returned.",
        "",
    ]
    header = f"{'data':18} {'shape':11} {'axes':5} " + " ".join(f"{c:>{len(c)}}" for c in columns)
    lines += [header + "  all modes + JAX bitwise equal", "-" * (len(header) + 31)]
    for name, shape, axes, worst, agree in rows:
        cells = " ".join(f"{worst[c]:>{len(c)}}" for c in columns)
        lines.append(f"{name:18} {str(shape):11} {str(axes):5} {cells}  {'yes' if agree else 'NO'}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tf_stable_moments",
        description="Compare tf_stable_moments with tf.nn.moments and the exact variance.",
    )
    parser.add_argument("--input", nargs="+", help="one or more .npy files of float32/float64 data")
    parser.add_argument("--axes", type=int, nargs="+", help="axes to reduce (with --input)")
    args = parser.parse_args(argv)
    if args.input:
        if not args.axes:
            parser.error("--axes is required with --input")
        data = {}
        for path in args.input:
            x = np.load(path)
            if x.dtype not in (np.float32, np.float64):
                parser.error(
                    f"--input must hold float32 or float64 data; got dtype {x.dtype} in {path}"
                )
            axes = tuple(sorted(a % x.ndim for a in args.axes))
            data[path.rsplit("/", 1)[-1][:18]] = (x, axes)
    else:
        data = {**design_note_datasets(), **identical_datasets()}
    print(format_rows(report_rows(data)))
    if not args.input:
        from tf_stable_moments import _report_layers

        print()
        print(_report_layers.format_layer_rows(_report_layers.layer_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
