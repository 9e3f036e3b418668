"""`tf_stable_moments.moments(..., synchronized=True)` over a four-replica MirroredStrategy
on logical CPU devices.

Usage: python tests/_moments_tf_mirrored.py INPUT.npz OUTPUT.npz

Logical devices must be configured before TensorFlow initialises, so this runs in its
own process (tests/test_merge.py starts it).  INPUT holds, per case NAME, the global
batch NAME_x [rows, K] and the cut points NAME_cuts (replica i holds rows
cuts[i]:cuts[i + 1]; uneven, one replica may hold none); case "bfloat16" is held as
float32 and cast in the replicas, its results cast back to float32 (exact).  Written
per case and ddof: every replica's mean and variance (NAME_ddofD_mean / _var [4, K]),
from `strategy.run` inside a tf.function; and for case "grad" the gradient of every
replica's loss sum(c_mean * mean + c_var * var) (c_* of the replica) with respect to
its rows, joined
(grad [rows, K]).
"""

import os
import sys

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tf_stable_moments import moments  # noqa: E402


def _shards(strategy, x, cuts, dtype=None):
    def part(context):
        i = context.replica_id_in_sync_group
        shard = tf.constant(x[cuts[i] : cuts[i + 1]])
        return shard if dtype is None else tf.cast(shard, dtype)

    return strategy.experimental_distribute_values_from_function(part)


def _local(strategy, value):
    return np.stack([v.numpy() for v in strategy.experimental_local_results(value)])


def main(src, dst):
    data = dict(np.load(src))
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
    out = {}
    names = sorted(k[:-2] for k in data if k.endswith("_x") and k != "grad_x")

    def both(v):  # ddof 0 and 1 in one trace (tracing the merge for 4 replicas takes seconds)
        pairs = [moments(v, [0], ddof=ddof, synchronized=True) for ddof in (0, 1)]
        if v.dtype == tf.bfloat16:  # back as float32 (exact) for numpy
            pairs = [[tf.cast(t, tf.float32) for t in pair] for pair in pairs]
        return pairs

    step = tf.function(lambda xs: strategy.run(both, (xs,)), autograph=False)
    for name in names:
        x, cuts = data[f"{name}_x"], data[f"{name}_cuts"]
        dtype = tf.bfloat16 if name == "bfloat16" else None  # held as float32 in the file
        for ddof, (mean, var) in enumerate(step(_shards(strategy, x, cuts, dtype))):
            out[f"{name}_ddof{ddof}_mean"] = _local(strategy, mean)
            out[f"{name}_ddof{ddof}_var"] = _local(strategy, var)
    x, cuts = data["grad_x"], data["grad_cuts"]
    coef = data["grad_coef"]  # [4, 2, K]: c_mean, c_var per replica

    def replica_grad(xs):
        i = tf.distribute.get_replica_context().replica_id_in_sync_group
        c = tf.gather(tf.constant(coef), i)
        with tf.GradientTape() as tape:
            tape.watch(xs)
            mean, var = moments(xs, [0], ddof=1, keepdims=True, synchronized=True)
            loss = tf.reduce_sum(c[0] * mean[0] + c[1] * var[0])
        return tape.gradient(loss, xs)

    grads = strategy.run(tf.function(replica_grad, autograph=False), (_shards(strategy, x, cuts),))
    out["grad"] = np.concatenate([g.numpy() for g in strategy.experimental_local_results(grads)])
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
