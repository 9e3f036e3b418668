"""Real models with StableBatchNormalization: step times, and inference at an offset.

Usage::

    python benchmarks/models.py speed [--model ResNet50] [--size 32] [--batch 16] [--steps 10]
    python benchmarks/models.py offset [--steps 2048]
    python benchmarks/models.py flax [--models CNN Encoder] [--offsets 0 1e4 1e6] [--steps 300]

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

``flax``: a small Flax CNN (BatchNorm) and a pre-LN encoder (LayerNorm) trained with
optax under jax.jit on inputs at an offset, with Flax's layers and with
jax_kernel.flax.linen's alternating step by step: held-out accuracy, first and steady
step times, and a checkpoint round trip (`flax_experiment`).

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


# --------------------------------------------------------------------------------- flax
def _flax_models(norms):
    """(CNN, ViT-style encoder) as flax.linen modules whose normalization layers come from
    `norms` (flax.linen, or jax_kernel.flax.linen: one import apart)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class CNN(nn.Module):
        """A BatchNorm on the raw input (its features sit on the offset), then three conv
        + BatchNorm + ReLU blocks, global average pooling and a 10-way head."""

        @nn.compact
        def __call__(self, x, train):
            x = norms.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            for features, stride in ((16, 1), (32, 2), (64, 2)):
                x = nn.Conv(features, (3, 3), stride, use_bias=False)(x)
                x = norms.BatchNorm(use_running_average=not train, momentum=0.9)(x)
                x = nn.relu(x)
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    class Encoder(nn.Module):
        """A pre-LN encoder on the raw token features (the residual stream is the input):
        two blocks of LayerNorm + attention and LayerNorm + MLP, a final LayerNorm, mean
        pooling, a 10-way head."""

        @nn.compact
        def __call__(self, x, train):
            d = x.shape[-1]
            for _ in range(2):
                a = norms.LayerNorm()(x)
                x = x + nn.MultiHeadDotProductAttention(4, deterministic=True)(a, a)
                f = nn.relu(nn.Dense(2 * d)(norms.LayerNorm()(x)))
                x = x + nn.Dense(d)(f)
            return nn.Dense(10)(jnp.mean(norms.LayerNorm()(x), axis=1))

    return {"CNN": CNN(), "Encoder": Encoder()}


def _flax_data(model, offset, n, rng, templates):
    """n examples of 10 classes: offset + 0.5 * the class's template + N(0, 1) noise (CNN:
    16x16x3 images; Encoder: 16 tokens of 32 features), float32."""
    labels = rng.integers(0, 10, size=n)
    x = offset + 0.5 * templates[labels] + rng.normal(size=(n, *templates.shape[1:]))
    return x.astype("float32"), labels


def flax_experiment(model, offset, steps, batch=64, seed=0):
    """Train `model` ("CNN" or "Encoder") with Flax's normalization layers and with
    jax_kernel.flax.linen's (same initial parameters, same batches, optax Adam, jax.jit),
    alternating step by step; returns {variant: {first, steady, accuracy, loss}} and the
    checkpoint round trip of the trained variables (flax.serialization)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import serialization

    from jax_kernel.flax import linen as stable

    rng = np.random.default_rng(seed)
    shape = (16, 16, 3) if model == "CNN" else (16, 32)
    templates = rng.normal(size=(10, *shape))
    x_test, y_test = _flax_data(model, offset, 2048, rng, templates)
    batches = [_flax_data(model, offset, batch, rng, templates) for _ in range(steps)]
    variants = {"flax": _flax_models(nn)[model], "ours": _flax_models(stable)[model]}
    init = variants["flax"].init(jax.random.key(seed), jnp.asarray(x_test[:batch]), False)
    tx = optax.adam(1e-3)

    def make_step(module):
        def loss_fn(params, stats, x, y):
            logits, updates = module.apply(
                {"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, updates.get("batch_stats", stats)

        @jax.jit
        def step(params, stats, opt, x, y):
            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), stats, opt, loss

        @jax.jit
        def predict(params, stats, x):
            return module.apply({"params": params, "batch_stats": stats}, x, False)

        return step, predict

    state, times, fns = {}, {}, {}
    for key, module in variants.items():
        params, stats = init["params"], init.get("batch_stats", {})
        state[key] = (params, stats, tx.init(params), None)
        times[key] = []
        fns[key] = make_step(module)
    for x, y in batches:  # alternate: load hits both alike
        for key in variants:
            params, stats, opt, _ = state[key]
            start = time.perf_counter()
            out = fns[key][0](params, stats, opt, x, y)
            jax.block_until_ready(out)
            times[key].append(time.perf_counter() - start)
            state[key] = out
    rows = {}
    for key in variants:
        params, stats, _, loss = state[key]
        logits = np.asarray(fns[key][1](params, stats, x_test))
        restored = serialization.from_bytes(
            {"params": params, "batch_stats": stats},
            serialization.to_bytes({"params": params, "batch_stats": stats}),
        )
        again = np.asarray(fns[key][1](restored["params"], restored["batch_stats"], x_test))
        rows[key] = {
            "first": times[key][0],
            "steady": float(np.median(times[key][1:])),
            "accuracy": float(np.mean(np.argmax(logits, -1) == y_test)),
            "loss": float(loss),
            "finite": bool(np.all(np.isfinite(logits))),
            "restored_same_bits": bool(
                np.array_equal(logits.view(np.uint32), again.view(np.uint32))
            ),
        }
    paired = np.array(times["ours"][1:]) / np.array(times["flax"][1:])
    rows["paired"] = tuple(float(q) for q in np.percentile(paired, [25, 50, 75]))
    return rows


def flax_table(args):
    print(
        f"Flax models, {args.steps} training steps of 64 (optax Adam, jax.jit), held-out "
        "2048; seconds; Flax's normalization layers against jax_kernel.flax.linen's"
    )
    print(
        "| model | input offset | held-out accuracy: Flax | ours | final loss: Flax | ours "
        "| first step: Flax | ours | ratio | steady: Flax | ours | ratio "
        "| per-pair ratio: median (quartiles) | checkpoint round trip: same bits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for offset in args.offsets:
            r = flax_experiment(model, offset, args.steps)
            f, o = r["flax"], r["ours"]
            q1, q2, q3 = r["paired"]
            print(
                f"| {model} | {offset:g} | {f['accuracy']:.3f} | {o['accuracy']:.3f} | "
                f"{f['loss']:.3g} | {o['loss']:.3g} | {f['first']:.2f} | {o['first']:.2f} | "
                f"{o['first'] / f['first']:.2f} | {f['steady'] * 1e3:.1f} ms | "
                f"{o['steady'] * 1e3:.1f} ms | {o['steady'] / f['steady']:.2f} | "
                f"{q2:.2f} ({q1:.2f}-{q3:.2f}) | "
                f"{f['restored_same_bits']} / {o['restored_same_bits']} |",
                flush=True,
            )


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
    f = sub.add_parser("flax", help="a Flax CNN and encoder trained with Flax's and our layers")
    f.add_argument("--models", nargs="+", default=["CNN", "Encoder"])
    f.add_argument("--offsets", nargs="+", type=float, default=[0.0, 1e4, 1e6])
    f.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    if args.command == "speed":
        speed(args)
        return
    if args.command == "flax":
        flax_table(args)
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
