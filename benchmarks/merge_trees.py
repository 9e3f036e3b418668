"""A simulation of merge trees for docs/algorithm.md section 13 ("1,000 devices, on paper").

Usage: python benchmarks/merge_trees.py [--devices 1000] [--rows 48] [--channels 4]

A data set of `devices * rows` rows x `channels` float32 channels (N(1e6, 1),
N(0, 1e-3), a cancelling +-1e30 mixture, a channel with one NaN) is cut into
`devices` uneven shards (a `where` mask selects 0 ... rows rows per shard: one
shard is empty, most differ in size).  One call of moments_state (jax_kernel, or
tf_stable_moments with --framework tf: the same bits) on the data viewed as
[devices, rows, channels] (axes=1) gives the states of all shards;
they are then merged in several tree shapes:

  * chain:     ((s0 + s1) + s2) + ... (merge_states, carried at every step);
  * binary:    a balanced binary tree (log2(devices) levels);
  * random:    three random binary trees (random pairs, random operand order);
  * ring:      a ring all-reduce: the int32 digits cut into `devices` chunks, chunk j
               summed around the ring starting at device j + 1 (plain int32 adds, no
               carry, as the collective does), then gathered;
  * psum:      one flat int32 SUM of all states (a psum / all-reduce).

Every tree's state (carried) and its state_moments (ddof 0 and 1) must have the same
bits as the state of the whole data (where=) and `moments` of the selected rows on one
device, and as the oracle (tf_stable_moments/_oracle.py, exact rationals rounded once).  Printed:
the state size, the number of merges (collectives) and their depth per tree shape,
and the digit headroom of a plain sum: the largest digit after summing k states against
the int32 limit (every canonical digit is below 2**16, so 2**15 states always fit).

`run(devices, rows, channels)` is also called by tests/test_state.py with 16 devices.
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INT32_MAX = 2**31 - 1


def _data(devices, rows, channels, seed=0):
    """x [devices, rows, channels] float32 and where [devices, rows, channels] (uneven)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(1e6, 1.0, (devices, rows, channels))
    if channels > 1:
        x[..., 1] = rng.normal(0.0, 1e-3, (devices, rows))
    if channels > 2:
        x[..., 2] = rng.choice([-1e30, 1e30], (devices, rows)) + rng.normal(0, 1, (devices, rows))
    x = x.astype(np.float32)
    if channels > 3:
        x[devices // 2, 0, 3] = np.nan  # NaN in one shard only
    counts = rng.integers(0, rows + 1, devices)
    counts[1] = 0  # an empty shard
    where = np.arange(rows)[None, :] < counts[:, None]
    return x, np.broadcast_to(where[:, :, None], x.shape).copy()


def _oracle(values, ddof):
    """(mean, var) of a slice rounded once from exact rationals; NaN for a slice with NaN."""
    from tf_stable_moments._oracle import exact_moments

    if not np.isfinite(values).all():
        return np.float32(np.nan), np.float32(np.nan)
    return exact_moments(values, np.float32, ddof)


def _chain(states, merge, rng):
    return functools.reduce(merge, states)


def _binary(states, merge, rng):
    level = list(states)
    while len(level) > 1:
        pairs = [merge(a, b) for a, b in zip(level[0::2], level[1::2])]
        level = pairs + level[len(pairs) * 2 :]
    return level[0]


def _random(states, merge, rng):
    pool = list(states)
    while len(pool) > 1:
        i, j = sorted(rng.choice(len(pool), 2, replace=False))
        b, a = pool.pop(j), pool.pop(i)
        pool.insert(
            int(rng.integers(len(pool) + 1)), merge(*((a, b) if rng.random() < 0.5 else (b, a)))
        )
    return pool[0]


def _depth(shape, devices):
    return {
        "chain": devices - 1,
        "binary": int(np.ceil(np.log2(devices))),
        "random": None,
        "ring": 2 * (devices - 1),
        "psum": 1,
    }[shape]


def _ring(values):
    """A ring all-reduce of [devices, ...] (int32 digits, or float64 sums: in the order of
    the ring): reduce-scatter, then all-gather."""
    devices = values.shape[0]
    flat = values.reshape(devices, -1)
    chunks = np.array_split(np.arange(flat.shape[1]), devices)
    total = np.empty(flat.shape[1], values.dtype)
    for j, idx in enumerate(chunks):
        acc = np.zeros(len(idx), values.dtype)
        for step in range(devices):  # chunk j starts at device j + 1 and goes round
            acc = acc + flat[(j + 1 + step) % devices, idx]
        total[idx] = acc
    return total.reshape(values.shape[1:])


def _api(framework):
    if framework == "jax":
        import jax_kernel

        return jax_kernel
    import tf_stable_moments

    return tf_stable_moments


def run(devices=1000, rows=48, channels=4, seed=0, framework="jax", verbose=True):
    """Simulate the merge trees; return the figures (raises AssertionError on any mismatch).

    framework: "jax" (jax_kernel: XLA compiles each shape once, then fast) or "tf"
    (tf_stable_moments: graph functions, nothing compiled; the same bits).
    """
    api = _api(framework)
    MomentsState, merge_states = api.MomentsState, api.merge_states
    moments_state, state_moments = api.moments_state, api.state_moments

    x, where = _data(devices, rows, channels, seed)
    start = time.perf_counter()
    shards = moments_state(x, axes=1, where=where)  # [devices, channels, L]: every shard at once
    values = np.asarray(shards.values)
    state_seconds = time.perf_counter() - start
    size = values.shape[-1]
    dtype = np.dtype(np.float32)
    states = [MomentsState(v, dtype) for v in values]
    empty = MomentsState(np.zeros_like(values[0]), dtype)

    flat_x = x.reshape(-1, channels)
    flat_w = where.reshape(-1, channels)
    whole = moments_state(flat_x, axes=0, where=flat_w)
    selected = flat_x[flat_w[:, 0]]  # the mask selects rows: the data of one device
    want = {}
    for ddof in (0, 1):
        mean, var = (np.asarray(t) for t in api.moments(selected, axes=[0], ddof=ddof))
        exact = [_oracle(selected[:, j], ddof) for j in range(channels)]
        oracle = [np.array([e[i] for e in exact], np.float32) for i in (0, 1)]
        for got, ref, name in ((mean, oracle[0], "mean"), (var, oracle[1], "var")):
            finite = ~np.isnan(ref)  # the NaN channel: NaN (the oracle takes finite data)
            np.testing.assert_array_equal(
                got[finite].view(np.uint32), ref[finite].view(np.uint32), err_msg=name
            )
            assert np.isnan(got[~finite]).all(), (name, got)
        want[ddof] = (mean, var)

    rng = np.random.default_rng(seed + 1)
    trees = {
        "chain": _chain(states, merge_states, rng),
        "binary": _binary(states, merge_states, rng),
    }
    for i in range(3):
        trees[f"random_{i}"] = _random(states, merge_states, rng)
    trees["ring"] = MomentsState(_ring(values), dtype)
    psum = values.sum(axis=0, dtype=np.int32)
    trees["psum"] = MomentsState(psum, dtype)
    canonical = np.asarray(whole.values)
    for name, state in trees.items():
        carried = np.asarray(merge_states(state, empty).values)  # a plain sum is carried here
        np.testing.assert_array_equal(carried, canonical, err_msg=f"{name} state")
        for ddof, (mean, var) in want.items():
            got = [np.asarray(t) for t in state_moments(state, ddof=ddof)]
            np.testing.assert_array_equal(got[0].view(np.uint32), mean.view(np.uint32), name)
            np.testing.assert_array_equal(got[1].view(np.uint32), var.view(np.uint32), name)
    headroom = {}
    for k in sorted({2, 16, 256, devices} & set(range(2, devices + 1))):
        headroom[k] = int(values[:k].sum(axis=0, dtype=np.int64).max())
    assert int(psum.max()) == headroom[devices] and headroom[devices] < INT32_MAX
    figures = {
        "devices": devices,
        "state_int32_per_slice": size,
        "state_bytes": int(values[0].nbytes),
        "channels": channels,
        "trees": list(trees),
        "headroom": headroom,
        "bound": devices * (2**16 - 1),
        "state_seconds": state_seconds,
        "framework": framework,
    }
    if verbose:
        _print(figures)
    return figures


@functools.cache
def _certified_fn(devices, given):
    """The certified merge (docs section 13b, `moments_core._kernel.merge_fast`) of every
    device's part x[d] (selected by where[d]), the devices simulated by `jax.vmap` over an
    axis "i", compiled once: (x, where, total) -> (mean, var, todo) as every device
    computed them, and the values each device all-reduces (its s1, s2, d1, d2, the
    smallest magnitude's exponent term and count, flat).  given: the all-reduce SUM
    returns `total` (the global values as some tree summed them) to every device; else
    it is a psum."""
    import jax
    import jax.numpy as jnp

    from jax_kernel import _ops
    from jax_kernel._union import _leader_sum
    from moments_core import _kernel
    from moments_core._formats import FORMATS

    def device(xd, wd, total):
        captured = []

        def reduce(rows):  # the all-reduce SUM of the rows, flat [6 * channels]
            captured.append(rows)
            return total if given else jax.lax.psum(rows, "i")

        count = jnp.sum(wd, 0).astype(jnp.int64)
        mean, var, todo, _ = _kernel.merge_fast(
            _ops,
            xd,
            0,
            FORMATS["float32"],
            _leader_sum("i", None),
            reduce,
            devices,
            count,
            wd,
            0,
        )
        return mean, var, todo, captured[0]

    return jax.jit(jax.vmap(device, in_axes=(0, 0, None), axis_name="i"))


def _certified_run(x, where, devices, total=None):
    import jax

    with jax.enable_x64(True):
        fn = _certified_fn(devices, total is not None)
        rows = np.zeros((6, x.shape[-1])) if total is None else total
        return [np.asarray(t) for t in fn(x, where, rows)]


def run_certified(devices=1000, rows=48, channels=4, seed=0, verbose=True):
    """The certified merge's all-reduce SUM of float64 sums and bounds done by several
    trees (chain, balanced binary, three random binary trees, a ring, numpy's pairwise
    sum), which give different float64 totals: every device must decide alike and every
    slice a tree decides must have the oracle's bits (ddof 0); the slices it leaves open
    are listed (the exact states decide them, as in `run`).  Returns the figures."""
    x, where = _data(devices, rows, channels, seed)
    start = time.perf_counter()
    _, _, todo, local = _certified_run(x, where, devices)
    seconds = time.perf_counter() - start
    flat_x, flat_w = x.reshape(-1, channels), where.reshape(-1, channels)
    selected = flat_x[flat_w[:, 0]]
    exact = [_oracle(selected[:, j], 0) for j in range(channels)]
    oracle = [np.array([e[i] for e in exact], np.float32) for i in (0, 1)]
    parts = list(local)  # [devices] of [6 * channels] float64
    rng = np.random.default_rng(seed + 2)
    trees = {"chain": _chain(parts, np.add, rng), "binary": _binary(parts, np.add, rng)}
    for i in range(3):
        trees[f"random_{i}"] = _random(parts, np.add, rng)
    trees["ring"] = _ring(local)
    trees["pairwise"] = local.sum(axis=0)
    opened = {"psum": np.flatnonzero(todo[0]).tolist()}
    for name, total in trees.items():
        mean, var, todo_t, _ = _certified_run(x, where, devices, total)
        assert (todo_t == todo_t[0]).all(), name  # every device decides alike
        decided = ~todo_t[0]
        for got, ref, what in ((mean[0], oracle[0], "mean"), (var[0], oracle[1], "var")):
            got32 = got.astype(np.float32)
            np.testing.assert_array_equal(
                got32[decided].view(np.uint32), ref[decided].view(np.uint32), f"{name} {what}"
            )
        opened[name] = np.flatnonzero(todo_t[0]).tolist()
    figures = {
        "devices": devices,
        "channels": channels,
        "open": opened,
        "seconds": seconds,
        "distinct_totals": len({t.tobytes() for t in trees.values()}),
    }
    if verbose:
        print(
            f"\ncertified merge, {devices} devices x {channels} channels (jax.vmap, "
            f"{seconds:.2f} s with compilation): {figures['distinct_totals']} different "
            f"float64 totals from {len(trees)} trees; slices left open per tree (the exact "
            "states decide them); every decided slice has the oracle's bits"
        )
        print("\n| all-reduce tree | open slices |\n|---|---|")
        for name, o in opened.items():
            print(f"| {name} | {o} |")
    return figures


def _print(f):
    d = f["devices"]
    print(
        f"{d} shards x {f['channels']} channels: state {f['state_int32_per_slice']} int32 per "
        f"slice, {f['state_bytes']:,} bytes per device; all {d} states in one "
        f"moments_state call ({f['framework']}): {f['state_seconds']:.2f} s"
    )
    print("trees with the bits of one device and of the oracle: " + ", ".join(f["trees"]))
    print("\n| tree | merges (collectives) | sequential depth | bytes per device per step |")
    print("|---|---|---|---|")
    b = f["state_bytes"]
    rows = [
        ("chain (merge_states)", d - 1, d - 1, f"{b:,}"),
        ("balanced binary (merge_states)", d - 1, _depth("binary", d), f"{b:,}"),
        ("random binary x3 (merge_states)", d - 1, "random", f"{b:,}"),
        ("ring all-reduce (int32 adds)", f"2 x {d - 1} steps", 2 * (d - 1), f"~{2 * b:,}"),
        ("psum / all-reduce SUM (int32)", 1, 1, f"{b:,} (plus the collective's own)"),
    ]
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print(
        "\n| states summed (k) | max digit of the plain int32 sum | k (2**16 - 1) | int32 limit |"
    )
    print("|---|---|---|---|")
    for k, m in f["headroom"].items():
        print(f"| {k} | {m:,} | {k * (2**16 - 1):,} | {INT32_MAX:,} |")
    print(f"| 2**15 (bound) | | {2**15 * (2**16 - 1):,} | {INT32_MAX:,} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=48, help="rows per shard (before the mask)")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--framework", choices=("jax", "tf"), default="jax")
    args = parser.parse_args()
    run(args.devices, args.rows, args.channels, framework=args.framework)
    run_certified(args.devices, args.rows, args.channels)


if __name__ == "__main__":
    main()
