"""One worker of a two-worker MultiWorkerMirroredStrategy on localhost.

Usage: python tests/_multi_worker_check.py INPUT.npz OUTPUT.npz   (TF_CONFIG set)

tests/test_layer_distributed.py starts two of these with TF_CONFIG naming two
localhost ports (gRPC collectives between the processes, one CPU replica each).
INPUT holds x [rows, C], the loss weights, and the cut `cut` (worker 0 takes rows
[:cut], worker 1 the rest: uneven).  Each worker, in one tf.function under the
strategy:

  * StableBatchNormalization(synchronized=True, momentum=0.5) on its rows: the
    output, the input gradient of sum(y * y * weights), the moving statistics;
  * the state API: moments_state of its rows, all-reduced as int32 SUM
    (ctx.all_reduce on state.values), and state_moments of the sum.

Written: its rows of y and of the gradient, the moving statistics, (mean, var).
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tf_stable_moments import (  # noqa: E402
    MomentsState,
    StableBatchNormalization,
    moments_state,
    state_moments,
)


def main(src, dst):
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    data = np.load(src)
    x, weights, cut = data["x"], data["weights"], int(data["cut"])
    rows = slice(0, cut) if task == 0 else slice(cut, None)
    channels = x.shape[1]
    with strategy.scope():
        layer = StableBatchNormalization(synchronized=True, momentum=0.5)
        layer.build((None, channels))
        layer.set_weights(
            [np.linspace(0.5, 2.0, channels, dtype=np.float32)]
            + [np.ones(channels, np.float32)] * 3
        )

    def part(array):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(array[rows])
        )

    def replica_step(xs, ws):
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            tape.watch(xs)
            y = layer(xs, training=True)
            loss = tf.reduce_sum(y * y * ws)
        grad = tape.gradient(loss, xs)
        state = moments_state(xs, axes=[0])
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, state.values)
        mean, var = state_moments(MomentsState(total, state.dtype), ddof=1)
        return y, grad, mean, var

    step = tf.function(lambda a, b: strategy.run(replica_step, (a, b)))
    results = step(part(x), part(weights))
    y, grad, mean, var = (strategy.experimental_local_results(t)[0].numpy() for t in results)
    moving = np.stack([layer.moving_mean.numpy(), layer.moving_variance.numpy()])
    np.savez(dst, y=y, grad=grad, mean=mean, var=var, moving=moving)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
