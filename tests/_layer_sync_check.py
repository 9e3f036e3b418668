"""StableBatchNormalization(synchronized=True) on two replicas against one device.

Usage: python tests/_layer_sync_check.py OUTPUTS.npz

Two logical CPU devices must be configured before TensorFlow initialises, so
this runs in its own process (tests/test_layer.py starts it).  A global batch
of 16 rows N(1e6, 1), 4 channels, with and without a mask, is split 10 + 6
over a MirroredStrategy; the same layer weights run on the whole batch on one
device.  Outputs, updated moving statistics and input gradients of both are
written for the test to compare.
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


def run(masked):
    rng = np.random.default_rng(30)
    x = rng.normal(1e6, 1, size=(16, 4)).astype(np.float32)
    mask = rng.random(16) < 0.7 if masked else None
    loss_weights = rng.normal(size=(16, 4)).astype(np.float32)
    out = {}

    single = _layer()
    y, grad = _step(single, tf.constant(x), mask, loss_weights)
    out["single_y"], out["single_grad"] = y.numpy(), grad.numpy()
    out["single_moving"] = np.stack([single.moving_mean.numpy(), single.moving_variance.numpy()])

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        replicated = _layer()

    def part(array, context):
        i = context.replica_id_in_sync_group
        return None if array is None else tf.constant(array[SPLIT[i] : SPLIT[i + 1]])

    args = [
        strategy.experimental_distribute_values_from_function(lambda c, a=a: part(a, c))
        for a in (x, mask, loss_weights)
    ]
    per_replica = strategy.run(tf.function(lambda *a: _step(replicated, *a)), args)
    y, grad = (
        np.concatenate([v.numpy() for v in strategy.experimental_local_results(t)])
        for t in per_replica
    )
    out["sync_y"], out["sync_grad"] = y, grad
    out["sync_moving"] = np.stack(
        [replicated.moving_mean.numpy(), replicated.moving_variance.numpy()]
    )
    return out


if __name__ == "__main__":
    results = {}
    for masked in (False, True):
        for key, value in run(masked).items():
            results[f"{'masked' if masked else 'plain'}_{key}"] = value
    np.savez(sys.argv[1], **results)
