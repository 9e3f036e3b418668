"""StableBatchNormalization(synchronized=True) on the Keras JAX backend, 8 devices vs one.

Usage: python tests/_layer_jax_sync_check.py OUTPUTS.npz

XLA_FLAGS must be set before jax is imported, so this runs in its own process
(tests/test_layer_distributed.py starts it).  A global batch of 64 rows
N(1e6, 1), 4 channels, with and without a mask, runs on one device (no
distribution) and under keras.distribution.DataParallel over 8 virtual CPU
devices (8 rows each); one jitted training step per case (stateless_call: the
output, the updated moving statistics, the gradients of sum(y * y * weights)
with respect to the input, gamma and beta).  An uneven batch (61 rows, with and without
a mask: padded to 64 inside the layer, the padding left out of every sum) runs the
same way.  Also written: the collectives of
the compiled sharded step (kind and element count) and the maximum error of
keras's BatchNormalization against the exact normalisation of the same data under
the same distribution (keras refuses synchronized=True on JAX: its layer under
DataParallel takes float32 means over the global batch, partitioned by XLA).
"""

import os
import re
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tf_stable_moments import StableBatchNormalization  # noqa: E402
from tf_stable_moments._oracle import exact_value  # noqa: E402

ROWS, CHANNELS = 64, 4
UNEVEN = 61  # a batch that 8 devices do not divide
KEYS = ("y", "moving", "grad", "grad_vars")


def _layer():
    layer = StableBatchNormalization(synchronized=True, momentum=0.5)
    layer.build((None, CHANNELS))
    gamma = np.linspace(0.5, 2.0, CHANNELS, dtype=np.float32)
    layer.set_weights([gamma, np.ones(CHANNELS, np.float32)] * 2)
    return layer


def _step(layer, jit=True):
    """A training step, jitted or eager: (y, moving mean and variance, d loss / d (x, gamma,
    beta))."""

    def loss(trainable, non_trainable, x, mask, weights):
        y, updated = layer.stateless_call(trainable, non_trainable, x, training=True, mask=mask)
        return jnp.sum(y * y * weights), (y, updated)

    def step(trainable, non_trainable, x, mask, weights):
        grad = jax.grad(loss, argnums=(0, 2), has_aux=True)
        (g_vars, g_x), (y, updated) = grad(trainable, non_trainable, x, mask, weights)
        return y, jnp.stack(updated), g_x, jnp.stack(g_vars)

    return jax.jit(step) if jit else step


def _collectives(compiled_text):
    """[(kind, elements)] of the compiled step's collectives: 0 all-reduce, 1 any other."""
    rows = []
    for line in compiled_text.splitlines():
        found = re.search(
            r"= (\(?[^=]*?\)?) (all-reduce|all-gather|all-to-all|collective-permute)", line
        )
        if found and "-done" not in line:
            shapes = re.findall(r"[a-z0-9]+\[([0-9,]*)\]", found.group(1))
            elements = sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes)
            rows.append((0 if found.group(2) == "all-reduce" else 1, elements))
    return np.array(rows, np.int64).reshape(-1, 2)


def _exact_output(x):
    exact = [exact_value(column, x.dtype) for column in x.T]
    mean, var = (np.array([float(v) for v in t]) for t in zip(*exact))
    return (x.astype(np.float64) - mean) / np.sqrt(var + 1e-3)


def main(dst):
    assert len(jax.devices()) == 8, jax.devices()
    rng = np.random.default_rng(31)
    x = rng.normal(1e6, 1, size=(ROWS, CHANNELS)).astype(np.float32)
    masks = {"plain": None, "masked": rng.random(ROWS) < 0.7}
    weights = rng.normal(size=(ROWS, CHANNELS)).astype(np.float32)
    uneven = {"uneven": None, "uneven_masked": masks["masked"][:UNEVEN]}
    out = {}
    cases = [(c, x, m, weights) for c, m in masks.items()]
    cases += [(c, x[:UNEVEN], m, weights[:UNEVEN]) for c, m in uneven.items()]
    for case, data, mask, w in cases:  # one device, jitted (XLA's 1 / sqrt: rsqrt in both)
        layer = _layer()
        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]
        results = _step(layer)(trainable, non_trainable, data, mask, w)
        out.update({f"{case}_single_{k}": np.asarray(v) for k, v in zip(KEYS, results)})

    distribution = keras.distribution.DataParallel(devices=jax.devices())
    mesh = distribution.device_mesh.backend_mesh
    sharded = NamedSharding(mesh, P(distribution.batch_dim_name))
    with distribution.scope():
        for case, mask in masks.items():
            layer = _layer()
            args = [
                [v.value for v in layer.trainable_variables],
                [v.value for v in layer.non_trainable_variables],
                jax.device_put(x, sharded),
                None if mask is None else jax.device_put(mask, sharded),
                jax.device_put(weights, sharded),
            ]
            compiled = _step(layer).lower(*args).compile()  # compiled once
            out[f"{case}_collectives"] = _collectives(compiled.as_text())
            results = compiled(*args)
            assert len(results[0].sharding.device_set) == 8, results[0].sharding
            out.update({f"{case}_sync_{k}": np.asarray(v) for k, v in zip(KEYS, results)})
        for case, mask in uneven.items():  # 61 rows: no even sharding; the layer pads
            layer = _layer()
            args = [
                [v.value for v in layer.trainable_variables],
                [v.value for v in layer.non_trainable_variables],
                x[:UNEVEN],
                mask,
                weights[:UNEVEN],
            ]
            compiled = _step(layer).lower(*args).compile()
            out[f"{case}_collectives"] = _collectives(compiled.as_text())
            results = compiled(*args)
            out.update({f"{case}_sync_{k}": np.asarray(v) for k, v in zip(KEYS, results)})
        keras_bn = keras.layers.BatchNormalization(momentum=0.5)  # synchronized=True: refused
        keras_bn.build((None, CHANNELS))
        keras_bn.set_weights(_layer().get_weights())
        theirs = np.asarray(keras_bn(jax.device_put(x, sharded), training=True))
    exact = _exact_output(x) * np.linspace(0.5, 2.0, CHANNELS) + 1.0
    out["error_ours"] = np.abs(out["plain_sync_y"] - exact).max()
    out["error_keras"] = np.abs(theirs - exact).max()
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1])
