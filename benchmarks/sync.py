"""Synchronized batch normalization across virtual replicas: step time, memory, traffic, error.

Usage: python benchmarks/sync.py [--rows 256] [--channels 128] [--steps 5]

For 2, 4 and 8 replicas (logical CPU devices of one process, a MirroredStrategy)
and three layers with synchronized=True:

  * merge:  StableBatchNormalization (the certified merge of the replicas' fast sums,
            docs section 13b; exact states only for the slices it leaves open),
  * state:  StableBatchNormalization through its former path (each replica's exact
            moments state, all-reduced; the private switch
            `tf_stable_moments._union._sync_exact_states`),
  * gather: StableBatchNormalization through its former path (all_gather of the batch,
            the kernel on the global batch; the private switch `_sync_all_gather`),
  * keras:  keras.layers.BatchNormalization (all-reduced float32 sums),

one training step (forward and input/weight gradients of sum(y * w)) on a global
batch of replicas x rows float32 rows of `channels` channels, N(loc, scale) (--loc,
--scale: N(1e6, 1) by default), is timed after a warm-up step, the four layers
alternating step by step: the median of `steps`, and the quartiles of each step's ratio
to the keras step beside it, with:

  * peak memory: the peak of TensorFlow's CPU allocator (the BFC allocator, shared by
    the logical devices, so all replicas together) during three steps of that layer
    alone, above its level before them, in MiB;
  * bytes communicated per replica and step, from the tensor sizes of the
    collectives in the step's graph (replica 0): an all-reduce counts its input
    once, an all-gather its gathered output (what a replica receives);
  * the error of the output against the exact normalisation of the global batch
    (float64 from the exact mean and variance of tf_stable_moments/_oracle.py):
    the largest absolute error of y (y is of size 1).

With --jax, the same for JAX (one process, 8 virtual CPU devices, `jax.shard_map` over
2, 4 and 8 of them): Flax's `flax.linen.BatchNorm(axis_name=...)` (one pmean of float32
sums and squares: fast, inexact) against `jax_kernel.flax.linen.BatchNorm(axis_name=...)`
with the certified merge (docs section 13b: one all-reduce of the fast sums and bounds)
and with every replica's exact state psum-ed (the path before it: the private switch
`jax_kernel._union._sync_exact_states`); `jax.jit` of forward and gradients of
sum(y * w) on a batch already on the devices, the three layers alternating step by
step: the median of `steps`, the quartiles of each step's ratio to the Flax step beside
it, and the largest error of y
against the exact normalisation.

Each replica count runs in its own process (its four layers under one MirroredStrategy):
TensorFlow fixes the logical devices at start-up, and a second MirroredStrategy in one
process would restart the collective instance keys.  This is a benchmark, not a test:
the figures depend on the machine.
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
if str(ROOT) not in sys.path:  # this checkout, not an installed copy
    sys.path.insert(0, str(ROOT))
LAYERS = ("merge", "state", "gather", "keras")
REPLICAS = (2, 4, 8)


def _collective_bytes(graph, replicas, rows, channels, kind="gather"):
    """Bytes of replica 0's collectives: an all-reduce's input, an all-gather's output.

    Shapes come from the graph.  The merge's second round has a shape known when it runs
    (mean_lo's sums and the open slices' elements: the sums alone on decided data); the
    all_gather path's collectives of unknown shape are its gather of the (flattened)
    batch and, in the gradient, the all-reduce of the flattened gradient of the gathered
    batch; both carry replicas * rows * channels elements (tf.distribute's all_gather
    first gathers the shapes: [1, rank] int32).
    """
    total = 0
    for op in graph.get_operations():
        if not (op.type.startswith("Collective") and op.device.endswith("CPU:0")):
            continue
        tensor = op.inputs[0]
        elements = tensor.shape.num_elements() if tensor.shape.rank is not None else None
        if elements is None and kind == "merge":
            # The second round: mean_lo's sums [channels] (int64) with the bits of the
            # open slices' elements (none on decided data).
            elements = channels
        elif elements is None:
            elements = replicas * rows * channels
        elif "Gather" in op.type:
            elements *= replicas
        total += elements * tensor.dtype.size
    return total


def _exact_output(x, eps=1e-3):
    """(x - mean) / sqrt(var + eps) per channel, from the exact mean and variance (float64)."""
    from tf_stable_moments._oracle import exact_value

    exact = [exact_value(column, x.dtype) for column in x.T]
    mean, var = (np.array([float(v) for v in t]) for t in zip(*exact))
    return (x.astype(np.float64) - mean) / np.sqrt(var + eps)


def run_tf(replicas, rows, channels, steps, dist=(1e6, 1.0)):
    """Rows of the TensorFlow table for one replica count, every layer of LAYERS in this
    process under one MirroredStrategy: the layers alternate step by step (so that the
    machine's load of the moment falls on all alike); each step's ratio is taken to the
    keras step beside it."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    sys.path.insert(0, str(ROOT))
    import keras

    from tf_stable_moments import StableBatchNormalization, _union

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    rng = np.random.default_rng(0)
    x = rng.normal(dist[0], dist[1], (replicas * rows, channels)).astype(np.float32)
    w = rng.normal(size=x.shape).astype(np.float32)
    exact = _exact_output(x)

    def part(array):
        return strategy.experimental_distribute_values_from_function(
            lambda c: tf.constant(array[c.replica_id_in_sync_group * rows :][:rows])
        )

    args = (part(x), part(w))
    steps_of, rows_of = {}, {}
    for kind in LAYERS:
        with strategy.scope():
            if kind == "keras":
                layer = keras.layers.BatchNormalization(synchronized=True, epsilon=1e-3)
            else:
                layer = StableBatchNormalization(synchronized=True, epsilon=1e-3)
                layer._sync_all_gather = kind == "gather"
            layer.build((None, channels))

        def replica_step(xs, ws, layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(xs)
                y = layer(xs, training=True)
                loss = tf.reduce_sum(y * ws)
            return y, tape.gradient(loss, [xs, *layer.trainable_variables])

        step = tf.function(lambda *a, fn=replica_step: strategy.run(fn, a))
        _union._sync_exact_states = kind == "state"  # read while tracing
        y, _ = step(*args)  # warm-up: tracing and the first step
        _union._sync_exact_states = False
        graph = step.get_concrete_function(*args).graph
        y = np.concatenate([v.numpy() for v in strategy.experimental_local_results(y)])
        # The peak of the allocator over a few steps of this layer alone.
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        for _ in range(3):
            _run(strategy, step, args)
        peak = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20
        steps_of[kind] = step
        rows_of[kind] = {
            "replicas": replicas,
            "layer": kind,
            "peak_mib": peak,
            "bytes": _collective_bytes(graph, replicas, rows, channels, kind),
            "error": float(np.abs(y - exact).max()),
        }
    times = {kind: [] for kind in LAYERS}
    for _ in range(steps):
        for kind in LAYERS:
            start = time.perf_counter()
            _run(strategy, steps_of[kind], args)
            times[kind].append(time.perf_counter() - start)
    for kind in LAYERS:
        paired = np.array(times[kind]) / np.array(times["keras"])
        rows_of[kind]["step_ms"] = 1e3 * float(np.median(times[kind]))
        rows_of[kind]["paired"] = [float(q) for q in np.percentile(paired, [25, 50, 75])]
    return list(rows_of.values())


def _run(strategy, step, args):
    """One step, its results fetched."""
    import tensorflow as tf

    out = step(*args)
    tf.nest.map_structure(lambda t: t.numpy(), strategy.experimental_local_results(out))


def run_jax(rows, channels, steps, dist):
    """Rows of the JAX table (see the module docstring), in this process (8 devices)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_kernel import _union
    from jax_kernel.flax import linen as stable

    out = []
    for replicas in REPLICAS:
        rng = np.random.default_rng(replicas)
        x = (dist[0] + dist[1] * rng.standard_normal((replicas * rows, channels))).astype(
            np.float32
        )
        w = rng.standard_normal(x.shape).astype(np.float32)
        exact = _exact_output(x, 1e-5)  # Flax's epsilon
        mesh = Mesh(np.array(jax.devices()[:replicas]), ("r",))
        # The batch and the weights on the devices before the steps, as a training loop's
        # input pipeline puts them: no host transfer is timed (numpy arguments added about
        # 0.15 ms of transfers to every step of every layer).
        host = x
        x, w = (jax.device_put(a, NamedSharding(mesh, P("r"))) for a in (x, w))
        fns = {}
        for kind in ("keras", "state", "merge"):
            module = (nn if kind == "keras" else stable).BatchNorm(
                use_running_average=False, momentum=0.9, axis_name="r"
            )
            variables = module.init(jax.random.PRNGKey(0), host[:rows])
            variables = jax.device_put(variables, NamedSharding(mesh, P()))
            _union._sync_exact_states = kind == "state"  # read while tracing, below

            def loss(v, xs, ws, module=module):
                y, _ = module.apply(v, xs, mutable=["batch_stats"])
                return jnp.sum(y * ws), y

            def step(v, xs, ws, loss=loss):
                (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(v, xs, ws)
                return y, grads

            fn = jax.jit(
                jax.shard_map(
                    step,
                    mesh=mesh,
                    in_specs=(P(), P("r"), P("r")),
                    out_specs=(P("r"), P()),
                    check_vma=False,
                )
            )
            y, _ = jax.block_until_ready(fn(variables, x, w))
            fns[kind] = (fn, variables, y)
        _union._sync_exact_states = False
        # The kinds alternate step by step, so that the machine's load of the moment
        # falls on all of them alike; each ratio below pairs a step with Flax's beside it.
        times = {kind: [] for kind in fns}
        for _ in range(steps):
            for kind, (fn, variables, _) in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(variables, x, w))
                times[kind].append(time.perf_counter() - start)
        for kind, (_, _, y) in fns.items():
            error = float(np.max(np.abs(np.asarray(y, np.float64) - exact)))
            name = {"keras": "flax", "state": "exact states", "merge": "certified merge"}[kind]
            paired = np.array(times[kind]) / np.array(times["keras"])
            out.append(
                {
                    "replicas": replicas,
                    "layer": name,
                    "step_ms": 1e3 * float(np.median(times[kind])),
                    "paired": [float(q) for q in np.percentile(paired, [25, 50, 75])],
                    "error": error,
                }
            )
            print(out[-1], flush=True)
    _union._sync_exact_states = False
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="rows per replica")
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", type=int, metavar="REPLICAS", help=argparse.SUPPRESS)
    parser.add_argument("--jax", action="store_true", help="the JAX table (Flax layers)")
    parser.add_argument("--loc", type=float, default=1e6, help="the data's offset")
    parser.add_argument("--scale", type=float, default=1.0, help="the data's spread")
    parser.add_argument("--jax-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jax_one:
        print(
            "RESULT "
            + json.dumps(run_jax(args.rows, args.channels, args.steps, (args.loc, args.scale)))
        )
        return
    if args.jax:
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        env = {**os.environ, "XLA_FLAGS": flags.strip(), "TF_CPP_MIN_LOG_LEVEL": "3"}
        cmd = [sys.executable, __file__, "--jax-one", "--rows", str(args.rows)]
        cmd += ["--channels", str(args.channels), "--steps", str(args.steps)]
        cmd += ["--loc", str(args.loc), "--scale", str(args.scale)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        rows = json.loads(lines[-1][len("RESULT ") :])
        print(
            f"\nJAX, per replica: {args.rows} rows x {args.channels} channels, "
            f"N({args.loc:g}, {args.scale:g}) float32; step = forward + gradients under "
            f"jax.jit(shard_map), median of {args.steps}\n"
        )
        print(
            "| replicas | layer | step ms | / Flax, paired steps: median (quartiles) "
            "| max abs error of y |"
        )
        print("|---|---|---|---|---|")
        for r in rows:
            q1, median, q3 = r["paired"]
            print(
                f"| {r['replicas']} | {r['layer']} | {r['step_ms']:.2f} "
                f"| {median:.2f} ({q1:.2f}-{q3:.2f}) | {r['error']:.2g} |"
            )
        return
    if args.one:
        dist = (args.loc, args.scale)
        result = run_tf(args.one, args.rows, args.channels, args.steps, dist)
        print("RESULT " + json.dumps(result))
        return
    # The BFC allocator on the CPU keeps the allocation statistics read for the peak.
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    results = []
    for replicas in REPLICAS:
        cmd = [sys.executable, __file__, "--one", str(replicas)]
        cmd += ["--rows", str(args.rows), "--channels", str(args.channels)]
        cmd += ["--steps", str(args.steps), "--loc", str(args.loc), "--scale", str(args.scale)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        for row in json.loads(lines[-1][len("RESULT ") :]):
            results.append(row)
            print(row, flush=True)
    print(
        f"\nper replica: {args.rows} rows x {args.channels} channels, "
        f"N({args.loc:g}, {args.scale:g}) float32; "
        f"step = forward + gradients, median of {args.steps}, the layers alternating\n"
    )
    print(
        "| replicas | layer | step ms | / keras, paired steps: median (quartiles) | peak MiB "
        "| bytes / replica / step | max abs error of y |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        q1, median, q3 = r["paired"]
        print(
            f"| {r['replicas']} | {r['layer']} | {r['step_ms']:.1f} "
            f"| {median:.2f} ({q1:.2f}-{q3:.2f}) | {r['peak_mib']:.1f} "
            f"| {r['bytes']:,} | {r['error']:.2g} |"
        )


if __name__ == "__main__":
    main()
