"""Synchronized batch normalization across virtual replicas: step time, memory, traffic, error.

Usage: python benchmarks/sync.py [--rows 256] [--channels 128] [--steps 5]

For 2, 4 and 8 replicas (logical CPU devices of one process, a MirroredStrategy)
and three layers with synchronized=True:

  * state:  StableBatchNormalization (each replica's exact moments state, all-reduced),
  * gather: StableBatchNormalization through its former path (all_gather of the batch,
            the kernel on the global batch; the private switch `_sync_all_gather`),
  * keras:  keras.layers.BatchNormalization (all-reduced float32 sums),

one training step (forward and input/weight gradients of sum(y * w)) on a global
batch of replicas x rows N(1e6, 1) float32 rows of `channels` channels is timed
(median of `steps` after a warm-up step), with:

  * peak memory: the peak of TensorFlow's CPU allocator (the BFC allocator, shared by
    the logical devices, so all replicas together) during the timed steps above its
    level before them, in MiB;
  * bytes communicated per replica and step, from the tensor sizes of the
    collectives in the step's graph (replica 0): an all-reduce counts its input
    once, an all-gather its gathered output (what a replica receives);
  * the error of the output against the exact normalisation of the global batch
    (float64 from the exact mean and variance of tf_stable_moments/_oracle.py):
    the largest absolute error of y (y is of size 1).

Each (replicas, layer) runs in its own process: TensorFlow fixes the logical devices
at start-up, and a second MirroredStrategy in one process would restart the collective
instance keys.  This is a benchmark, not a test: the figures depend on the machine.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("state", "gather", "keras")
REPLICAS = (2, 4, 8)


def _collective_bytes(graph, replicas, rows, channels):
    """Bytes of replica 0's collectives: an all-reduce's input, an all-gather's output.

    Shapes come from the graph.  Only the all_gather path has collectives of unknown
    shape: its gather of the (flattened) batch and, in the gradient, the all-reduce of
    the flattened gradient of the gathered batch; both carry replicas * rows * channels
    elements (tf.distribute's all_gather first gathers the shapes: [1, rank] int32).
    """
    total = 0
    for op in graph.get_operations():
        if not (op.type.startswith("Collective") and op.device.endswith("CPU:0")):
            continue
        tensor = op.inputs[0]
        elements = tensor.shape.num_elements()
        if elements is None:
            elements = replicas * rows * channels
        elif "Gather" in op.type:
            elements *= replicas
        total += elements * tensor.dtype.size
    return total


def _exact_output(x):
    """(x - mean) / sqrt(var + eps) per channel, from the exact mean and variance (float64)."""
    from tf_stable_moments._oracle import exact_value

    exact = [exact_value(column, x.dtype) for column in x.T]
    mean, var = (np.array([float(v) for v in t]) for t in zip(*exact))
    return (x.astype(np.float64) - mean) / np.sqrt(var + 1e-3)


def run_one(replicas, layer_kind, rows, channels, steps):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    sys.path.insert(0, str(ROOT))
    import keras

    from tf_stable_moments import StableBatchNormalization

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        if layer_kind == "keras":
            layer = keras.layers.BatchNormalization(synchronized=True, epsilon=1e-3)
        else:
            layer = StableBatchNormalization(synchronized=True, epsilon=1e-3)
            layer._sync_all_gather = layer_kind == "gather"
        layer.build((None, channels))

    rng = np.random.default_rng(0)
    x = rng.normal(1e6, 1.0, (replicas * rows, channels)).astype(np.float32)
    w = rng.normal(size=x.shape).astype(np.float32)

    def part(array):
        return strategy.experimental_distribute_values_from_function(
            lambda c: tf.constant(array[c.replica_id_in_sync_group * rows :][:rows])
        )

    args = (part(x), part(w))

    def replica_step(xs, ws):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = layer(xs, training=True)
            loss = tf.reduce_sum(y * ws)
        return y, tape.gradient(loss, [xs, *layer.trainable_variables])

    step = tf.function(lambda *a: strategy.run(replica_step, a))
    y, _ = step(*args)  # warm-up: tracing and the first step
    graph = step.get_concrete_function(*args).graph
    y = np.concatenate([v.numpy() for v in strategy.experimental_local_results(y)])
    error = float(np.abs(y - _exact_output(x)).max())

    times = []
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    for _ in range(steps):
        start = time.perf_counter()
        out = step(*args)
        tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(out))
        times.append(time.perf_counter() - start)
        del out
    peak = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20
    return {
        "replicas": replicas,
        "layer": layer_kind,
        "step_ms": 1e3 * float(np.median(times)),
        "peak_mib": peak,
        "bytes": _collective_bytes(graph, replicas, rows, channels),
        "error": error,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="rows per replica")
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("REPLICAS", "LAYER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_one(int(args.one[0]), args.one[1], args.rows, args.channels, args.steps)
        print("RESULT " + json.dumps(result))
        return
    # The BFC allocator on the CPU keeps the allocation statistics read for the peak.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    results = []
    for replicas in REPLICAS:
        for kind in LAYERS:
            cmd = [sys.executable, __file__, "--one", str(replicas), kind]
            cmd += ["--rows", str(args.rows), "--channels", str(args.channels)]
            cmd += ["--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
            print(results[-1], flush=True)
    print(
        f"\nper replica: {args.rows} rows x {args.channels} channels, N(1e6, 1) float32; "
        f"step = forward + gradients, median of {args.steps}\n"
    )
    print("| replicas | layer | step ms | peak MiB | bytes / replica / step | max abs error of y |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['replicas']} | {r['layer']} | {r['step_ms']:.1f} | {r['peak_mib']:.1f} "
            f"| {r['bytes']:,} | {r['error']:.2g} |"
        )


if __name__ == "__main__":
    main()
