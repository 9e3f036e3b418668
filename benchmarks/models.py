"""Real models with StableBatchNormalization: step times, and inference at an offset.

Usage::

    python benchmarks/models.py speed [--model ResNet50] [--size 32] [--batch 16] [--steps 10]
    python benchmarks/models.py offset [--steps 2048]

``speed``: a keras.applications model (weights=None) with keras's BatchNormalization, or
``--model Encoder`` (a 4-block pre-LN transformer encoder: 8 LayerNormalization, d 128,
sequence 64, inputs around 1e4), and the same model after ``tf_stable_moments.stabilize``;
first-step time (tracing and compilation included), median steady step time and the
first step of a new batch size (batch - 1: a partial last batch, traced and compiled
again where the mode compiles per shape) of ``train_on_batch``, in TF eager
(run_eagerly=True), tf.function, tf.function(jit_compile=True) and on the JAX backend
(a subprocess per backend: the backend is fixed when keras is imported).  The two models
alternate step by step in one process, so load on a shared machine hits both alike; the
quartiles of the per-pair ratio (ours / keras over consecutive steps) show the spread.

``offset``: an MLP whose input BatchNormalization sees N(1e6, 1) features (momentum 0.99,
``--steps`` steps of batch 32): moving-mean error and held-out accuracy for keras's layer
and for StableBatchNormalization with compensated_moving_stats off and on.
"""

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = ("eager", "tf.function", "jit_compile")


# ------------------------------------------------------------------------------- offset
def offset_experiment(steps, seed=0):
    """Moving-mean error and held-out accuracy after `steps` steps at N(1e6, 1)."""
    import keras
    import numpy as np

    import tf_stable_moments

    rng = np.random.default_rng(seed)
    features, batch, offset = 16, 32, 1e6
    w = rng.normal(size=features)

    def draw(n):
        z = rng.normal(size=(n, features))
        return (offset + z).astype(np.float32), (z @ w > 0).astype(np.float32)

    x, y = draw(steps * batch)
    xt, yt = draw(8192)
    true_mean = x.astype(np.float64).mean(axis=0)
    variants = {
        "keras BatchNormalization": keras.layers.BatchNormalization,
        "StableBatchNormalization, compensated_moving_stats=False (default)": (
            tf_stable_moments.StableBatchNormalization
        ),
        "StableBatchNormalization, compensated_moving_stats=True": lambda **kw: (
            tf_stable_moments.StableBatchNormalization(compensated_moving_stats=True, **kw)
        ),
    }
    rows = []
    for label, cls in variants.items():
        keras.utils.set_random_seed(seed)
        bn = cls(momentum=0.99)  # moving mean from 0, as by default
        model = keras.Sequential(
            [
                keras.Input((features,)),
                bn,
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(keras.optimizers.Adam(1e-3), "binary_crossentropy", metrics=["accuracy"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        moving = np.asarray(bn.moving_mean, np.float64)
        if getattr(bn, "compensated_moving_stats", False):
            moving = moving + np.asarray(bn.moving_mean_correction, np.float64)
        rows.append(
            {
                "layer": label,
                "max_abs_moving_mean_error": float(np.max(np.abs(moving - true_mean))),
                "held_out_accuracy": float(model.evaluate(xt, yt, verbose=0)[1]),
                "stall_warnings": sum("cannot follow" in str(c.message) for c in caught),
            }
        )
    return rows


# -------------------------------------------------------------------------------- speed
def _encoder(seq=64, d=128, blocks=4, heads=4):
    """A pre-LN transformer encoder (2 LayerNormalization per block) with a 10-way head."""
    import keras

    inputs = keras.Input((seq, d))
    h = inputs
    for _ in range(blocks):
        a = keras.layers.LayerNormalization()(h)
        a = keras.layers.MultiHeadAttention(heads, d // heads)(a, a)
        h = h + a
        f = keras.layers.LayerNormalization()(h)
        f = keras.layers.Dense(2 * d, activation="relu")(f)
        h = h + keras.layers.Dense(d)(f)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, out)


def _models(name, size, swap):
    import keras

    import tf_stable_moments

    keras.utils.set_random_seed(0)
    if name == "Encoder":
        base = _encoder()
    else:
        base = getattr(keras.applications, name)(
            weights=None, input_shape=(size, size, 3), classes=10
        )
    return base, (tf_stable_moments.stabilize(base) if swap else None)


def _inputs(name, size, batch, rng):
    """A batch for the model: images N(0, 1), or encoder sequences around 1e4."""
    if name == "Encoder":
        return (1e4 + rng.normal(size=(batch, 64, 128))).astype("float32")
    return rng.normal(size=(batch, size, size, 3)).astype("float32")


def speed_backend(name, size, batch, steps, modes):
    """{mode: {"keras": (first, steady, new batch), "ours": (...), "paired": (q1, median,
    q3)}} in this process's backend: steady is the median step time, new batch the first
    step of batch - 1 after them, paired the quartiles of ours / keras over the pairs of
    consecutive steps (the models alternate, so a pair shares the machine's load of the
    moment)."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = _inputs(name, size, batch, rng)
    y = rng.integers(0, 10, size=(batch,))
    out = {}
    for mode in modes:
        base, ours = _models(name, size, True)
        models = {"keras": base, "ours": ours}
        times = {k: [] for k in models}
        for model in models.values():
            model.compile(
                keras.optimizers.SGD(0.01),
                "sparse_categorical_crossentropy",
                run_eagerly=mode == "eager",
                jit_compile=mode in ("jit_compile", "jit"),
            )
        for _ in range(steps + 1):  # alternate: load hits both alike
            for key, model in models.items():
                start = time.perf_counter()
                model.train_on_batch(x, y)
                times[key].append(time.perf_counter() - start)
        for key, model in models.items():  # a partial last batch: a new shape
            start = time.perf_counter()
            model.train_on_batch(x[1:], y[1:])
            times[key].append(time.perf_counter() - start)
        out[mode] = {k: (t[0], float(np.median(t[1:-1])), t[-1]) for k, t in times.items()}
        paired = np.array(times["ours"][1:-1]) / np.array(times["keras"][1:-1])
        out[mode]["paired"] = tuple(float(q) for q in np.percentile(paired, [25, 50, 75]))
    return out


def run_backends(model, size, batch, steps, plan=(("tensorflow", MODES), ("jax", ("jit",)))):
    """{"backend mode": speed_backend's value} from one subprocess per backend of `plan`
    ((backend, modes) pairs); a failed backend is reported and left out."""
    results = {}
    for backend, modes in plan:
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); import models; "
            f"print('RESULT', json.dumps(models.speed_backend({model!r}, {size}, "
            f"{batch}, {steps}, {list(modes)!r})))"
        )
        env = dict(os.environ, KERAS_BACKEND=backend)
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            print(f"{backend} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            continue
        for mode, value in json.loads(line[-1][7:]).items():
            results[f"{backend} {mode}"] = value
            print(f"{backend} {mode}: {value}", flush=True)
    return results


def speed(args):
    results = run_backends(args.model, args.size, args.batch, args.steps)
    print(
        f"{args.model} {args.size}x{args.size}, batch {args.batch}, {args.steps} steady steps "
        "(train_on_batch; seconds; ours / keras BN)"
    )
    print(
        "| backend, mode | first step: keras | ours | ratio | steady: keras | ours | ratio "
        "| per-pair ratio: median (quartiles) | new batch size: keras | ours | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, value in results.items():
        (kf, ks, kn), (of, os_, on) = value["keras"], value["ours"]
        q1, q2, q3 = value["paired"]
        cells = f"{kf:.2f} | {of:.2f} | {of / kf:.2f} | {ks:.3f} | {os_:.3f} | {os_ / ks:.2f}"
        new = f"{kn:.2f} | {on:.2f} | {on / kn:.2f}"
        print(f"| {key} | {cells} | {q2:.2f} ({q1:.2f}-{q3:.2f}) | {new} |")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speed", help="step times of a keras.applications model")
    s.add_argument("--model", default="ResNet50")
    s.add_argument("--size", type=int, default=32)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--steps", type=int, default=10)
    o = sub.add_parser("offset", help="inference after training at N(1e6, 1)")
    o.add_argument("--steps", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.command == "speed":
        speed(args)
        return
    print(f"input BN on N(1e6, 1) features, MLP, momentum 0.99, {args.steps} steps of 32")
    print("| layer | max abs moving-mean error | held-out accuracy | stall warnings |")
    print("|---|---|---|---|")
    for r in offset_experiment(args.steps):
        print(
            f"| {r['layer']} | {r['max_abs_moving_mean_error']:.3g} | "
            f"{r['held_out_accuracy']:.3f} | {r['stall_warnings']} |"
        )


if __name__ == "__main__":
    main()
