"""jax_kernel.flax.linen.BatchNorm with axis_name on 4 virtual CPU devices.

Usage: python tests/_flax_sync_check.py OUTPUT.npz   (XLA_FLAGS must be set before jax
is imported, so tests/test_flax.py runs this in its own process.)  Written: for the
global batch x [32, 6] (N(1e4, 1), float32), with momentum 0 (the running statistics
are then the batch statistics): the outputs and statistics of one device holding x,
of pmap over 4 devices (axis_name="i"), of shard_map, of pmap with
axis_index_groups [[0, 1], [2, 3]] and of one device holding each half; the gradients
of one device and of pmap, with the collectives of that pmap's program; and a masked pmap
beside one device with the same mask.
"""

import os
import re
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_kernel.flax.linen import BatchNorm  # noqa: E402


def run(module, variables, x, mask=None):
    y, updated = module.apply(variables, x, mask=mask, mutable=["batch_stats"])
    return y, updated["batch_stats"]["mean"], updated["batch_stats"]["var"]


def _all_reduces(compiled_text):
    """The element counts of a compiled program's collectives, sorted (-1: one that is
    not an all-reduce), those in the branches of a conditional included."""
    sizes = []
    for line in compiled_text.splitlines():
        found = re.search(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute)\(", line)
        if found:
            dims = re.findall(r"\[([0-9,]*)\]", found.group(1))
            count = sum(int(np.prod([int(d) for d in s.split(",") if d])) for s in dims)
            sizes.append(count if found.group(2) == "all-reduce" else -1)
    return np.array(sorted(sizes), np.int64)


def main(dst):
    assert len(jax.devices()) == 4, jax.devices()
    x = np.random.default_rng(24).normal(1e4, 1.0, (32, 6)).astype(np.float32)
    mask = np.ones(x.shape, bool)
    mask[1::4] = False
    single = BatchNorm(use_running_average=False, momentum=0.0)
    synced = BatchNorm(use_running_average=False, momentum=0.0, axis_name="i")
    variables = single.init(jax.random.PRNGKey(0), x)
    variables = {
        "params": jax.tree_util.tree_map(lambda v: v + 0.25, variables["params"]),
        "batch_stats": variables["batch_stats"],
    }
    out = {}
    for key, value in zip(("y", "mean", "var"), jax.jit(lambda v: run(single, variables, v))(x)):
        out[f"single_{key}"] = value
    shards = x.reshape(4, 8, 6)
    pmapped = jax.pmap(lambda xs: run(synced, variables, xs), axis_name="i")
    for key, value in zip(("y", "mean", "var"), pmapped(shards)):
        out[f"pmap_{key}"] = np.asarray(value).reshape((32, 6) if key == "y" else (4, 6))
    mesh = Mesh(np.array(jax.devices()), ("i",))
    mapped = jax.jit(
        jax.shard_map(
            lambda xs: run(synced, variables, xs),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=(P("i"), P(), P()),
            check_vma=False,
        )
    )
    for key, value in zip(("y", "mean", "var"), mapped(x)):
        out[f"shard_map_{key}"] = value
    grouped = BatchNorm(
        use_running_average=False, momentum=0.0, axis_name="i", axis_index_groups=[[0, 1], [2, 3]]
    )
    _, gm, gv = jax.pmap(lambda xs: run(grouped, variables, xs), axis_name="i")(shards)
    out["groups_mean"], out["groups_var"] = np.asarray(gm), np.asarray(gv)
    for half in range(2):
        _, m, v = run(single, variables, x[16 * half : 16 * (half + 1)])
        out[f"half{half}_mean"], out[f"half{half}_var"] = m, v
    masks = mask.reshape(4, 8, 6)
    _, mm, mv = jax.pmap(lambda xs, ms: run(synced, variables, xs, ms), axis_name="i")(
        shards, masks
    )
    out["masked_pmap_mean"], out["masked_pmap_var"] = np.asarray(mm)[0], np.asarray(mv)[0]
    _, m, v = run(single, variables, x, mask)
    out["masked_single_mean"], out["masked_single_var"] = m, v

    def loss(module, xs):
        return jnp.sum(jnp.sin(3.0 * run(module, variables, xs)[0]))

    out["single_grad"] = jax.jit(jax.grad(lambda xs: loss(single, xs)))(x)

    def device_grad(xs):
        # Each device's own loss: psum's transpose sums the cotangents of all devices,
        # so this is the gradient of the sum of the losses.
        return jax.grad(lambda v: loss(synced, v))(xs)

    grad_step = jax.pmap(device_grad, axis_name="i")
    out["pmap_grad"] = np.asarray(grad_step(shards)).reshape(32, 6)
    out["grad_collectives"] = _all_reduces(grad_step.lower(shards).compile().as_text())
    np.savez(dst, **{k: np.asarray(v) for k, v in out.items()})


if __name__ == "__main__":
    main(sys.argv[1])
