"""Moments states through JAX collectives on 8 virtual CPU devices.

Usage: python tests/_state_jax_collectives.py INPUT.npz OUTPUT.npz

XLA_FLAGS must be set before jax is imported, so this runs in its own process
(tests/test_state.py starts it).  INPUT holds x [8 m, K] float32 and a mask
`where` of the same shape (uneven per device, one device without data).
Written: the merged state's values and (mean, var) from shard_map + psum,
pmap + psum and jax.jit on an input sharded with NamedSharding, each also
carried by merge_states with the empty state (the test compares them with the
TF state and moments).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_kernel import MomentsState, merge_states, moments_state, state_moments  # noqa: E402


def main(src, dst):
    data = np.load(src)
    x, where = data["x"], data["where"]
    devices = jax.devices()
    assert len(devices) == 8, devices
    mesh = Mesh(np.array(devices), ("i",))
    out = {}

    def local(xs, ws):
        return jax.lax.psum(moments_state(xs, axes=0, where=ws), "i").values

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P(), check_vma=False)
    )
    out["shard_map"] = np.asarray(sharded(x, where))

    m = x.shape[0] // 8
    pmapped = jax.pmap(local, axis_name="i")
    out["pmap"] = np.asarray(pmapped(x.reshape(8, m, -1), where.reshape(8, m, -1)))[0]

    spec = NamedSharding(mesh, P("i"))
    xs, ws = jax.device_put(x, spec), jax.device_put(where, spec)
    out["jit_sharded"] = np.asarray(
        jax.jit(lambda a, b: moments_state(a, axes=0, where=b).values)(xs, ws)
    )

    dtype = np.dtype(np.float32)
    empty = MomentsState(np.zeros_like(out["pmap"]), dtype)  # the state of no data
    for key in ("shard_map", "pmap", "jit_sharded"):
        # A psum holds the digit sums; merging with the empty state carries them.
        out[f"{key}_canonical"] = np.asarray(
            merge_states(MomentsState(out[key], dtype), empty).values
        )
        mean, var = state_moments(MomentsState(out[key], dtype), ddof=1)
        out[f"{key}_mean"], out[f"{key}_var"] = np.asarray(mean), np.asarray(var)
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
