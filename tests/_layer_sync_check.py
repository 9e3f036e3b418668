"""StableBatchNormalization(synchronized=True) on two replicas against one device.

Usage: python tests/_layer_sync_check.py OUTPUTS.npz

Two logical CPU devices must be configured before TensorFlow initialises, so
this runs in its own process (tests/test_layer.py starts it).  A global batch
of 16 rows N(1e6, 1), 4 channels, with and without a mask, is split 10 + 6
over a MirroredStrategy; the same layer weights run on the whole batch on one
device (and a batch whose global slices are a tie and a near-tie, "ties": the
exact round).  Outputs, updated moving statistics and input gradients of both are
written for the test to compare, with a Hessian-vector product (the gradient of
sum(grad * v)) of fresh layers, and the sizes of replica 0's collectives.
"""

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tf_stable_moments import StableBatchNormalization  # noqa: E402

SPLIT = (0, 10, 16)


def _layer():
    layer = StableBatchNormalization(synchronized=True, momentum=0.5)
    layer.build((None, 4))
    layer.set_weights([np.linspace(0.5, 2.0, 4, dtype=np.float32), np.ones(4, np.float32)] * 2)
    return layer


def _step(layer, x, mask, loss_weights):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True, mask=mask)
        loss = tf.reduce_sum(y * y * loss_weights)
    return y, tape.gradient(loss, x)


def _hvp(layer, x, mask, loss_weights, v):
    with tf.GradientTape() as outer:
        outer.watch(x)
        _, grad = _step(layer, x, mask, loss_weights)
        product = tf.reduce_sum(grad * v)
    return outer.gradient(product, x)


def _per_replica(strategy, fn, arrays):
    """(a tf.function running fn on every replica, its arguments: the arrays split)."""

    def part(array, context):
        i = context.replica_id_in_sync_group
        return None if array is None else tf.constant(array[SPLIT[i] : SPLIT[i + 1]])

    args = [
        strategy.experimental_distribute_values_from_function(lambda c, a=a: part(a, c))
        for a in arrays
    ]
    return tf.function(lambda *a: strategy.run(fn, a)), args


def _joined(strategy, per_replica):
    return np.concatenate([v.numpy() for v in strategy.experimental_local_results(per_replica)])


def _ties(rng):
    """16 x 4 float32 whose global slices are ties no shard has: 1 a midpoint (eight 1.0,
    eight 1 + 2**-23: decided on the lattice), 2 a near-tie that no bound decides (the
    mean 1 + 2**-24 + 2**-104: one element 2**-100, no lattice), so the exact round runs;
    0 and 3 N(1e6, 1) and N(0, 1)."""
    x = np.stack([rng.normal(1e6, 1, 16), np.ones(16), np.ones(16), rng.normal(0, 1, 16)], 1)
    x[8:, 1] = 1 + 2.0**-23
    x[6:14, 2] = 1 + 2.0**-23
    x[14, 2], x[15, 2] = 2.0, 2.0**-100
    return x.astype(np.float32)


def run(strategy, case):
    rng = np.random.default_rng(30)
    x = rng.normal(1e6, 1, size=(16, 4)).astype(np.float32)
    mask = rng.random(16) < 0.7 if case == "masked" else None
    if case == "ties":
        x = _ties(rng)
    loss_weights = rng.normal(size=(16, 4)).astype(np.float32)
    v = rng.normal(size=(16, 4)).astype(np.float32)
    out = {}

    single = _layer()
    y, grad = _step(single, tf.constant(x), mask, loss_weights)
    out["single_y"], out["single_grad"] = y.numpy(), grad.numpy()
    out["single_moving"] = np.stack([single.moving_mean.numpy(), single.moving_variance.numpy()])
    out["single_hvp"] = _hvp(_layer(), tf.constant(x), mask, loss_weights, v).numpy()

    with strategy.scope():
        replicated, fresh = _layer(), _layer()
    step, args = _per_replica(strategy, lambda *b: _step(replicated, *b), (x, mask, loss_weights))
    out["sync_y"], out["sync_grad"] = (_joined(strategy, t) for t in step(*args))
    out["sync_moving"] = np.stack(
        [replicated.moving_mean.numpy(), replicated.moving_variance.numpy()]
    )
    out["collectives"] = _collectives(step.get_concrete_function(*args).graph)
    hvp, hvp_args = _per_replica(strategy, lambda *b: _hvp(fresh, *b), (x, mask, loss_weights, v))
    out["sync_hvp"] = _joined(strategy, hvp(*hvp_args))
    return out


def _collectives(graph):
    """[(op kind, dtype itemsize, elements)] of replica 0's collectives in the step's graph
    (elements -1: a shape known only when the step runs)."""
    rows = []
    for op in graph.get_operations():
        if op.type.startswith("Collective") and op.device.endswith("CPU:0"):
            kind = 0 if "Reduce" in op.type else 1
            shape = op.inputs[0].shape
            elements = shape.num_elements() if shape.rank is not None else None
            rows.append((kind, op.inputs[0].dtype.size, -1 if elements is None else elements))
    return np.array(rows, np.int64).reshape(-1, 3)


if __name__ == "__main__":
    # One strategy for both runs: a second MirroredStrategy in the same process restarts
    # its collective instance keys, and the runtime would pair them with the first one's.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {}
    for case in ("plain", "masked", "ties"):
        for key, value in run(strategy, case).items():
            results[f"{case}_{key}"] = value
    np.savez(sys.argv[1], **results)
