"""Synchronized StableBatchNormalization beyond one process's logical TF devices.

* the Keras JAX backend under keras.distribution.DataParallel over 8 virtual CPU
  devices (tests/_layer_jax_sync_check.py, one subprocess: XLA_FLAGS must be set
  before jax starts);
* a two-worker tf.distribute.MultiWorkerMirroredStrategy on localhost
  (tests/_multi_worker_check.py, two worker processes talking gRPC), with the
  state API all-reduced through the same strategy.

Both against one device holding the global batch: outputs and moving statistics
bit for bit (.view(np.uint32)), gradients to float32 tolerance (their batch sums
run per device, then across devices).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from tf_stable_moments import StableBatchNormalization, moments
from tf_stable_moments._state import state_size

HERE = Path(__file__).resolve().parent
TIMEOUT = 600


def _same_bits(a, b, label):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=label)


def test_jax_data_parallel_matches_one_device(tmp_path):
    """8 devices x 8 rows under DataParallel == 64 rows on one device (a jitted step each);
    61 rows (padded to 8 x 8 in the layer) == 61 rows on one device."""
    path = tmp_path / "jax_sync.npz"
    script = HERE / "_layer_jax_sync_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, (
        f"{script.name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    )
    out = dict(np.load(path))
    channels = out["plain_single_y"].shape[1]
    size = state_size(tf.float32)
    for case in ("plain", "masked", "uneven", "uneven_masked"):
        for key in ("y", "moving"):
            _same_bits(out[f"{case}_sync_{key}"], out[f"{case}_single_{key}"], f"{case} {key}")
        # Gradients: XLA partitions the batch sums of the tangent rule (per device, then an
        # all-reduce): float32 tolerance.
        for key, tol in (("grad", 2e-7), ("grad_vars", 1e-6)):
            want, got = out[f"{case}_single_{key}"], out[f"{case}_sync_{key}"]
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=key)
        # O(channels) communication: all-reduces only (no gather of the batch).  Per call of
        # the statistics (docs section 13b): the shared shift K [C], the float64 sums and
        # smallest-magnitude exponent terms [3 C], and in the branch that runs only when a
        # slice is left open the int32 state [L C].  Without mean_lo (masked: two calls)
        # then the scalar max of the open slices; with it (plain) the float64 mean_lo sums
        # and the count of open slices [C + 1], and in that branch the sums again [C].
        # masked: the selected counts [C] int32 (XLA combines them with another [C]
        # reduction: 2 C); the backward pass's [3, C] sums.
        c = channels
        merge = [(0, size * c), (0, c), (0, 3 * c), (0, 1)]
        with_lo = [(0, size * c), (0, c), (0, 3 * c), (0, c + 1), (0, c)]
        # Uneven: each device's count of real rows rides in the SUM (4 C), a pmin of the
        # device indices finds the shift's device (C); the 61-row input and output cannot
        # be sharded evenly, so XLA gathers the padded batch (64 C) in and out.
        uneven = [(0, size * c), (0, c), (0, c), (0, 4 * c), (0, 1)]
        uneven_lo = [(0, size * c), (0, c), (0, c), (0, 4 * c), (0, c + 1), (0, c)]
        batch = [(1, 64 * c)] * 2
        expected = {
            "plain": with_lo + [(0, 3 * c)],
            "masked": merge * 2 + [(0, 2 * c), (0, 3 * c)],
            "uneven": uneven_lo + [(0, 3 * c)] + batch,
            "uneven_masked": uneven * 2 + [(0, 2 * c), (0, 3 * c)] + batch,
        }[case]
        if case == "uneven_masked":  # XLA combines the selected counts with one [C] sum
            expected.remove((0, c))
        got = sorted(tuple(r) for r in out[f"{case}_collectives"].tolist())
        assert got == sorted(expected), (case, got)
    # Measured beside it on N(1e6, 1): ours within 1e-6 of the exact normalisation, keras's
    # BatchNormalization under the same distribution (float32 sums) far off.
    assert out["error_ours"] < 1e-6, out["error_ours"]
    assert out["error_keras"] > 1e-2, out["error_keras"]
    print(f"max |y - exact|: ours {out['error_ours']:.2g}, keras {out['error_keras']:.3g}")


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _single_device(x, weights):
    layer = StableBatchNormalization(momentum=0.5)
    layer.build((None, x.shape[1]))
    gamma = np.linspace(0.5, 2.0, x.shape[1], dtype=np.float32)
    layer.set_weights([gamma] + [np.ones(x.shape[1], np.float32)] * 3)
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * y * weights)
    grad = tape.gradient(loss, x)
    moving = np.stack([layer.moving_mean.numpy(), layer.moving_variance.numpy()])
    return y.numpy(), grad.numpy(), moving


def test_multi_worker_mirrored_strategy_matches_one_device(tmp_path):
    """Two workers (9 + 15 rows) == 24 rows on one device: the layer and the state API."""
    rng = np.random.default_rng(5)
    x = rng.normal(1e6, 1, (24, 3)).astype(np.float32)
    weights = rng.normal(size=x.shape).astype(np.float32)
    src = tmp_path / "in.npz"
    np.savez(src, x=x, weights=weights, cut=np.array(9))
    cluster = {"worker": [f"localhost:{p}" for p in _free_ports(2)]}
    procs = []
    for index in range(2):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CONFIG": json.dumps(config), "KERAS_BACKEND": "tensorflow"}
        cmd = [sys.executable, str(HERE / "_multi_worker_check.py"), str(src)]
        cmd.append(str(tmp_path / f"out{index}.npz"))
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker failed:\n{log[-4000:]}"
    out = [dict(np.load(tmp_path / f"out{index}.npz")) for index in range(2)]
    y, grad, moving = _single_device(x, weights)
    mean, var = (t.numpy() for t in moments(tf.constant(x), [0], ddof=1))
    _same_bits(np.concatenate([o["y"] for o in out]), y, "y")
    scale = np.abs(grad).max()
    got = np.concatenate([o["grad"] for o in out])
    np.testing.assert_allclose(got, grad, rtol=0, atol=2e-7 * scale)  # sums in another order
    for index, o in enumerate(out):
        _same_bits(o["moving"], moving, f"worker {index} moving statistics")
        _same_bits(o["mean"], mean, f"worker {index} state mean")
        _same_bits(o["var"], var, f"worker {index} state var")
