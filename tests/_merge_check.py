"""The certified merge of the fast sums (docs section 13b) on 8 virtual CPU devices.

Usage: python tests/_merge_check.py OUTPUT.npz   (XLA_FLAGS must be set before jax is
imported, so tests/test_merge.py runs this in its own process.)  For each case of
`cases()` (a global batch x [rows, kept], float32/float16/bfloat16, an optional
selection, a number of devices R), written: the statistics of the union from
`jax_kernel._union.union_stats` under shard_map (device d holds rows d::R... as the
contiguous block d of rows), the slices the merged fast path left open
(`moments_core._kernel.merge_fast`), as every device computed them, and the mean_lo of
one device holding everything.
"""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("TF_STABLE_MOMENTS_NATIVE", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_kernel import _centre, _ops, _union  # noqa: E402
from jax_kernel import _moments as _m  # noqa: E402
from moments_core import _kernel  # noqa: E402
from moments_core._formats import FORMATS  # noqa: E402


def cases():
    """{name: (x, mask or None, devices)}."""
    rng = np.random.default_rng(13)
    out = {}
    for devices in (1, 2, 4, 8):
        for loc in (0.0, 1e4, 1e6):
            x = (loc + rng.standard_normal((64, 16))).astype(np.float32)
            out[f"normal{loc:g}_r{devices}"] = (x, None, devices)
    relu = np.maximum(rng.standard_normal((256, 8)), 0).astype(np.float32)
    out["relu_r8"] = (relu, None, 8)
    for dtype in (np.float16, "bfloat16"):
        x = (100 + rng.standard_normal((64, 8))).astype(np.float32).astype(jnp.dtype(dtype))
        out[f"{jnp.dtype(dtype).name}_r4"] = (np.asarray(x), None, 4)
    # Uneven and empty shards: a selection that leaves device 0 nothing, device 1 one row.
    x = (1e4 + rng.standard_normal((64, 8))).astype(np.float32)
    mask = np.ones(x.shape, bool)
    mask[:8] = False
    mask[9:16] = False
    mask[40:44, 3] = False
    out["uneven_r8"] = (x, mask, 8)
    # A NaN in one device's part of slice 2, an inf in slice 5: those slices only.
    x = (1e4 + rng.standard_normal((64, 8))).astype(np.float32)
    x[20, 2] = np.nan
    x[50, 5] = np.inf
    out["special_r8"] = (x, None, 8)
    # Global ties no shard has: each device's rows are all 1 or all 1 + 2**-23, so every
    # shard's mean is a float32, and the union's mean 1 + 2**-24 is a midpoint (ties to
    # even: 1; decided on the lattice, section 5); slice 1 a near-tie (one element
    # 2**-22 larger); slice 2 ordinary data; slice 3 a near-tie no bound can decide: the
    # mean is 1 + 2**-24 + 2**-106 (one element 2**-100: no lattice), so the exact states
    # round it (up), in a second round that every device takes.
    x = np.ones((64, 4), np.float32)
    x[32:, :2] = np.float32(1 + 2.0**-23)
    x[63, 1] = np.float32(1 + 2.0**-22)
    x[:, 2] = (1e3 + rng.standard_normal(64)).astype(np.float32)
    x[30:62, 3] = np.float32(1 + 2.0**-23)
    x[62, 3], x[63, 3] = 2.0, 2.0**-100
    out["ties_r8"] = (x, None, 8)
    return out


def run(x, mask, devices):
    ms = np.ones(x.shape, bool) if mask is None else mask
    fn = _program(devices, mask is not None, jnp.dtype(x.dtype).name)
    return [np.asarray(v) for v in fn(jnp.asarray(x), jnp.asarray(ms))]


@functools.cache
def _program(devices, masked, dtype):
    """The jitted shard_map of the union's statistics on `devices` devices: one per
    (devices, selection or not, dtype), so cases that differ only in their data (the
    N(loc, 1) cases of one device count) run one compiled program."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("i",))
    fmt = FORMATS[dtype]

    def local(xs, ms):
        m = ms if masked else None
        mean, lo, var = _union.union_stats(xs, m, (0,), "i", None)
        with jax.enable_x64(True):
            laid, axis = _m._layout(xs, (0,))
            count = None if m is None else jnp.sum(m, 0).astype(jnp.int64)

            def all_sum(t):
                return jax.lax.psum(t, "i")

            shift = _union._leader_sum("i", None)
            todo = _kernel.merge_fast(_ops, laid, axis, fmt, shift, all_sum, devices, count, m)[2]
        return mean[None], lo[None], var[None], todo[None]

    return jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"), check_vma=False
        )
    )


def public_api(out):
    """jax_kernel.moments(..., axis_name=...): shard_map over 8 devices (ddof 0 and 1,
    float32 and complex64), pmap over 4 with axis_index_groups, and the gradient of
    sum(w * var) beside one device's."""
    import jax_kernel

    rng = np.random.default_rng(5)
    x = (1e4 + rng.standard_normal((64, 6))).astype(np.float32)
    z = (x + 1j * rng.standard_normal(x.shape)).astype(np.complex64)
    w = rng.standard_normal(6).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()), ("i",))

    def sharded(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=False)
        )

    for ddof in (0, 1):
        stats = sharded(lambda v, d=ddof: jax_kernel.moments(v, 0, ddof=d, axis_name="i"))(x)
        out[f"api_ddof{ddof}_mean"], out[f"api_ddof{ddof}_var"] = map(np.asarray, stats)
    stats = sharded(lambda v: jax_kernel.moments(v, 0, axis_name="i"))(z)
    out["api_complex_mean"], out["api_complex_var"] = map(np.asarray, stats)
    groups = jax.pmap(
        lambda v: jax_kernel.moments(v, 0, axis_name="g", axis_index_groups=[[0, 1], [2, 3]]),
        axis_name="g",
        devices=jax.devices()[:4],
    )(x.reshape(4, 16, 6))
    out["api_groups_mean"], out["api_groups_var"] = map(np.asarray, groups)

    def loss(v, axis_name=None):
        return jnp.sum(w * jax_kernel.moments(v, 0, axis_name=axis_name)[1])

    grad = jax.jit(
        jax.shard_map(
            # Data-parallel semantics: the loss is the sum of the devices' losses (psum
            # transposes to psum), each device's here the global sum(w * var) over 8.
            lambda v: jax.grad(lambda u: loss(u, "i") / 8)(v),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )
    )(x)
    out["api_grad"] = np.asarray(grad)
    out["api_single_grad"] = np.asarray(jax.jit(jax.grad(loss))(x))
    out["api_x"], out["api_z"], out["api_w"] = x, z, w


def main(dst):
    assert len(jax.devices()) == 8, jax.devices()
    out = {}
    for name, (x, mask, devices) in cases().items():
        mean, lo, var, todo = run(x, mask, devices)
        out[f"{name}_x"] = x.view(np.uint16) if x.dtype.itemsize == 2 else x
        out[f"{name}_dtype"] = np.array(jnp.dtype(x.dtype).name)
        out[f"{name}_mask"] = np.ones(x.shape, bool) if mask is None else mask
        for key, value in (("mean", mean), ("mean_lo", lo), ("var", var), ("todo", todo)):
            out[f"{name}_{key}"] = value.view(np.uint16) if value.dtype.itemsize == 2 else value
        # One device holding everything: the reference for mean_lo (not correctly rounded).
        if mask is None:
            single = _centre._stats(jnp.asarray(x), None, (0,))
            out[f"{name}_single_mean_lo"] = np.asarray(single[1]).view(
                np.uint16 if x.dtype.itemsize == 2 else np.uint32
            )
    public_api(out)
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1])
