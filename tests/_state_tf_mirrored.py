"""Moments states all-reduced over a four-replica MirroredStrategy on logical CPU devices.

Usage: python tests/_state_tf_mirrored.py INPUT.npz OUTPUT.npz

Logical devices must be configured before TensorFlow initialises, so this runs
in its own process (tests/test_state.py starts it).  INPUT holds x [rows, K]
and cut points `cuts` (uneven, one replica without rows).  Each replica
computes the state of its rows, all-reduces `state.values` (int32 SUM) and
rounds; every replica's (mean, var) are written for the test to compare.
"""

import os
import sys

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tf_stable_moments import MomentsState, moments_state, state_moments  # noqa: E402


def main(src, dst):
    data = np.load(src)
    x, cuts = data["x"], data["cuts"]
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])

    def part(context):
        i = context.replica_id_in_sync_group
        return tf.constant(x[cuts[i] : cuts[i + 1]])

    shards = strategy.experimental_distribute_values_from_function(part)

    def step(xs):
        ctx = tf.distribute.get_replica_context()
        state = moments_state(xs, axes=[0])
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, state.values)
        return state_moments(MomentsState(total, state.dtype), ddof=1)

    mean, var = strategy.run(step, (shards,))
    out = {
        "mean": np.stack([m.numpy() for m in strategy.experimental_local_results(mean)]),
        "var": np.stack([v.numpy() for v in strategy.experimental_local_results(var)]),
    }
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
