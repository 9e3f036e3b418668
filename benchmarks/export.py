"""Exported artifacts (issue #26): size, load time, first and steady call where the
package is not installed.

Usage::

    python benchmarks/export.py [--backends tensorflow jax] [--batch 4]

Per Keras backend, the models of `benchmarks/models.py` (TensorFlow: ResNet50 at 32x32,
every BatchNormalization swapped, and the pre-LN Encoder with 8 LayerNormalization;
JAX: the Encoder) with keras's layers and after ``tf_stable_moments.stabilize``:
``model.export`` (the SavedModel TF Serving loads; jax2tf on the JAX backend), the
artifact's size on disk,
then in a fresh process in which importing this package fails: the time of
``tf.saved_model.load``, of the first ``serve`` call, the median of five more and the
first call of another batch size (1); then,
in one more such process holding both artifacts, the median ratio ours / keras of 20
steady calls made alternately.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tensorflow": ("ResNet50", "Encoder"), "jax": ("Encoder",)}

# The serving process: this package cannot be imported there.
_GUARD = """
import builtins, json, sys, time
real = builtins.__import__
def guard(name, *args, **kwargs):
    if name.split(".")[0] in ("tf_stable_moments", "jax_kernel", "moments_core"):
        raise ImportError(name)
    return real(name, *args, **kwargs)
builtins.__import__ = guard
import numpy as np, tensorflow as tf
"""
_SERVE = (
    _GUARD
    + """
path, data = sys.argv[1], sys.argv[2]
start = time.perf_counter(); model = tf.saved_model.load(path); load = time.perf_counter() - start
x = np.load(data)
start = time.perf_counter(); model.serve(x); first = time.perf_counter() - start
times = []
for _ in range(5):
    start = time.perf_counter(); model.serve(x); times.append(time.perf_counter() - start)
start = time.perf_counter(); model.serve(x[:1]); other = time.perf_counter() - start
print("RESULT", json.dumps([load, first, sorted(times)[2], other]))
"""
)


# Steady calls of both artifacts in one process, alternating (the VM's speed moves
# between processes): the median of the per-pair ratios ours / keras.
_PAIRED = (
    _GUARD
    + """
keras_model, ours = (tf.saved_model.load(p) for p in sys.argv[1:3])
x = np.load(sys.argv[3])
ratios = []
for i in range(23):
    t = []
    for model in (keras_model, ours) if i % 2 else (ours, keras_model):
        start = time.perf_counter(); model.serve(x); t.append(time.perf_counter() - start)
    if i >= 3:
        ratios.append(t[1] / t[0] if i % 2 else t[0] / t[1])
print("RESULT", json.dumps(sorted(ratios)[len(ratios) // 2]))
"""
)


def _run(script, *args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise RuntimeError(f"serving failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0][7:])


def measure(backend, name, batch, directory):
    """{"keras": [...], "ours": [...], "paired": ratio}: export s, bytes, load s, first call
    s, steady s, first call of batch 1 s; the paired steady ratio ours / keras."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import models

    base, ours = models._models(name, 32, True)
    x = models._inputs(name, 32, batch, np.random.default_rng(0))
    data = Path(directory) / "x.npy"
    np.save(data, x)
    out = {}
    for label, model in (("keras", base), ("ours", ours)):
        model(x[:1])
        path = Path(directory) / f"{backend}_{name}_{label}"
        start = time.perf_counter()
        model.export(str(path), verbose=False)
        export = time.perf_counter() - start
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out[label] = [export, size, *_run(_SERVE, path, data)]
    out["paired"] = _run(
        _PAIRED, *(Path(directory) / f"{backend}_{name}_{x}" for x in ("keras", "ours")), data
    )
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax"])
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    if os.environ.get("KERAS_BACKEND") is None:  # one process per backend
        for backend in args.backends:
            env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
            cmd = [sys.executable, __file__, "--backends", backend, "--batch", str(args.batch)]
            subprocess.run(cmd, env=env, check=True)
        return
    backend = os.environ["KERAS_BACKEND"]
    sys.path.insert(0, str(ROOT))
    for name in MODELS[backend]:
        with tempfile.TemporaryDirectory() as directory:
            out = measure(backend, name, args.batch, directory)
        print(f"\n{backend}, {name}, batch {args.batch}: keras / ours (ratio)")
        print(
            "| export (s) | size (bytes) | load (s) | first call (s) | steady call (ms) "
            "| first call of batch 1 (s) | steady, paired in one process |"
        )
        print("|---|---|---|---|---|---|---|")
        keras, ours = out["keras"], out["ours"]
        cells = []
        for i, scale in enumerate((1, 1, 1, 1, 1000, 1)):
            a, b = keras[i] * scale, ours[i] * scale
            cells.append(f"{a:.4g} / {b:.4g} ({b / a:.2f})")
        cells.append(f"{out['paired']:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
