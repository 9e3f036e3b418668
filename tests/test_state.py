"""The mergeable moments state: shards merged in any order give the bits of the whole.

Fixtures (tests/rounding_fixtures.py) and a subset of the datasets
(tests/datasets.py) are packed, per dtype, into one array [rows, slices] with a
`where` mask (masked entries hold NaN, which must not count), so that one graph
function per dtype serves every call.  Rows are cut into 1, 2, 3, 4 and 8
uneven shards (empty ones included); every merge order of up to 4 shards and
random merge trees of 8 must give the state of the whole, bit for bit, and
`state_moments` the oracle's bits and those of `moments`.  JAX collectives
(shard_map, pmap, sharded jit) and TF MirroredStrategy run in subprocesses
(virtual devices must be configured before the framework starts).
"""

import functools
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from datasets import all_datasets, oracle, slices
from modes import bits
from rounding_fixtures import fixtures

import tf_stable_moments
from tf_stable_moments import MomentsState, merge_states, moments_state, state_moments
from tf_stable_moments import _native as tf_native
from tf_stable_moments._state import state_size

HERE = Path(__file__).resolve().parent
DATASETS = (
    "D1",
    "D4",
    "offset_1e+38",
    "spread_1e-19",
    "n_1",
    "n_2",
    "cancelling_large",
    "tiny_with_subnormals",
    "huge_overflowing_variance",
)
SHARDS = (1, 2, 3, 4, 8)
COLUMNS = 8  # slices taken from each dataset (CI budget)


def _special_columns(rng, dtype):
    """Slices with NaN, +inf, -inf, both infinities, and NaN in one part of complex data."""
    out = []
    offset = 100.0 if np.dtype(dtype).itemsize == 2 else 1e6
    for bad in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf]):
        s = rng.normal(offset, 1.0, 40)
        s[rng.choice(40, len(bad), replace=False)] = bad
        out.append(s)
    if np.dtype(dtype).kind == "c":
        z = rng.normal(3.0, 1.0, 40) + 1j * rng.normal(-2.0, 0.5, 40)
        z[7] = complex(np.nan, 0.25)
        out.append(z)
    return [(s.astype(dtype), ddof) for s in out for ddof in (0, 1)]


def _packed(dtype):
    """(x [rows, slices], where, ddof per slice, expected (mean, var) per slice from the oracle,
    and from moments) for the fixtures of `dtype` (and the chosen datasets for float32)."""
    rng = np.random.default_rng(14)
    cases = []  # (slice values, ddof, mean and var of moments on the original array)
    sources = [(x, axes, ddof) for x, axes, ddof in fixtures().values() if x.dtype == dtype]
    sources = [s for s in sources if s[0].size <= 5000]  # not the 2**20 fixture (CI budget)
    if dtype == np.float32:
        data = all_datasets()
        sources += [(data[k][0], data[k][1], ddof) for k in DATASETS for ddof in (0, 1)]
    for x, axes, ddof in sources:
        rows = slices(x, axes)[:COLUMNS]
        mean, var = tf_stable_moments.moments(tf.constant(x), list(axes), ddof=ddof)
        for r, m, v in zip(rows, mean.numpy().reshape(-1), var.numpy().reshape(-1)):
            cases.append((r, ddof, m, v))
    for s, ddof in _special_columns(rng, dtype):
        mean, var = tf_stable_moments.moments(tf.constant(s), [0], ddof=ddof)
        cases.append((s, ddof, mean.numpy(), var.numpy()))
    length = max(len(c[0]) for c in cases)
    x = np.full((length, len(cases)), np.nan, dtype)
    where = np.zeros(x.shape, bool)
    for j, (r, *_) in enumerate(cases):
        # Spread each slice over the rows, so that every shard holds some of most slices.
        at = np.sort(rng.choice(length, len(r), replace=False))
        x[at, j], where[at, j] = r, True
    ddofs = np.array([c[1] for c in cases])
    from_moments = (np.array([c[2] for c in cases]), np.array([c[3] for c in cases]))
    expected = [oracle(r[:, None], (0,), d) for r, d, *_ in cases]
    mean = np.array([e[0][0] for e in expected], dtype)
    var = np.array([e[1][0] for e in expected], expected[0][1].dtype)
    return x, where, ddofs, (mean, var), from_moments


def _cuts(rng, rows, k, empty):
    """k uneven shards of range(rows), one of them empty if `empty`."""
    inner = np.sort(rng.integers(0, rows + 1, k - 1))
    if empty and k > 1:
        inner[rng.integers(k - 1)] = inner[0]  # two equal cuts: an empty shard
        inner = np.sort(inner)
    edges = [0, *inner.tolist(), rows]
    return list(zip(edges[:-1], edges[1:]))


def _tree(rng, states):
    """Merge in a random binary tree."""
    states = list(states)
    while len(states) > 1:
        i, j = sorted(rng.choice(len(states), 2, replace=False))
        b = states.pop(j)
        a = states.pop(i)
        states.insert(
            int(rng.integers(len(states) + 1)), merge_states(*(a, b)[:: int(rng.choice([1, -1]))])
        )
    return states[0]


def _check_moments(state, ddofs, expected, from_moments, label):
    for ddof in np.unique(ddofs):
        mean, var = (t.numpy() for t in state_moments(state, ddof=int(ddof)))
        pick = ddofs == ddof
        for got, want, name in ((mean, expected[0], "mean"), (var, expected[1], "var")):
            np.testing.assert_array_equal(
                bits(got[pick]), bits(want[pick]), err_msg=f"{label} {name} vs oracle"
            )
        np.testing.assert_array_equal(bits(mean[pick]), bits(from_moments[0][pick]))
        np.testing.assert_array_equal(bits(var[pick]), bits(from_moments[1][pick]))


DTYPES = [np.float32, np.float64, np.complex64, np.complex128, np.float16, tf.bfloat16]


@pytest.mark.parametrize(
    "dtype", DTYPES, ids=lambda d: np.dtype(getattr(d, "as_numpy_dtype", d)).name
)
def test_shards_merged_in_any_order_give_the_bits_of_the_whole(dtype):
    dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    x, where, ddofs, expected, from_moments = _packed(dtype)
    whole = moments_state(tf.constant(x), axes=0, where=tf.constant(where))
    assert whole.values.shape == (x.shape[1], state_size(dtype))
    _check_moments(whole, ddofs, expected, from_moments, "whole")
    rng = np.random.default_rng(int(x.shape[1]))
    for k in SHARDS:
        cuts = _cuts(rng, x.shape[0], k, empty=k in (3, 8))
        states = [
            moments_state(tf.constant(x[a:b]), axes=[0], where=tf.constant(where[a:b]))
            for a, b in cuts
        ]
        if k <= 4:
            orders = [functools.reduce(merge_states, p) for p in itertools.permutations(states)]
        else:
            orders = [_tree(rng, states) for _ in range(4)]
        for merged in orders:
            np.testing.assert_array_equal(merged.values.numpy(), whole.values.numpy())
        if k == 4:
            _check_moments(orders[-1], ddofs, expected, from_moments, f"{k} shards")


# The datasets the packed test above leaves out (CI budget there), each cut along a
# reduced axis into 1, 2, 3, 4 and 8 uneven shards (one empty), every dataset's own
# array with its own axes (no padding: the state costs per element).
OTHER_DATASETS = tuple(k for k in all_datasets() if k not in DATASETS)


def _shard_orders(rng, states):
    """Every merge order of up to 3 shards; 3 random orders and 2 random trees beyond."""
    if len(states) <= 3:
        return [functools.reduce(merge_states, p) for p in itertools.permutations(states)]
    orders = [functools.reduce(merge_states, [states[i] for i in rng.permutation(len(states))])]
    orders += [functools.reduce(merge_states, states[::-1]), functools.reduce(merge_states, states)]
    return orders + [_tree(rng, states) for _ in range(2)]


@pytest.mark.parametrize("name", OTHER_DATASETS + ("huge_n_f32_2p20_mean_tie_var_tie",))
def test_every_dataset_sharded_gives_the_bits_of_the_whole(name):
    """The rest of the dataset suite (and the 2**20-element tie fixture, left out above),
    sharded along a reduced axis: every order gives the whole's state, whose moments are the
    oracle's bits and moments' (ddof 0 and 1)."""
    if name in OTHER_DATASETS:
        x, axes, _ = all_datasets()[name]
        if x.ndim == 2:  # at most COLUMNS slices, as above (CI budget)
            kept = 1 - axes[0]
            x = np.take(x, range(min(COLUMNS, x.shape[kept])), axis=kept)
    else:
        x, axes, _ = fixtures()[name]
    whole = moments_state(tf.constant(x), axes=list(axes))
    for ddof in (0, 1):
        got = [t.numpy() for t in state_moments(whole, ddof=ddof)]
        ref = [t.numpy() for t in tf_stable_moments.moments(tf.constant(x), list(axes), ddof=ddof)]
        # The oracle's Python rationals for 2**20 elements cost seconds (CI budget): there,
        # moments, itself checked against the oracle on that fixture (test_certification.py).
        want = oracle(x, axes, ddof) if x.size <= 2**17 else ref
        for g, w, r, part in zip(got, want, ref, ("mean", "var")):
            np.testing.assert_array_equal(bits(g), bits(w), err_msg=f"{name} {part} vs oracle")
            np.testing.assert_array_equal(bits(g), bits(r), err_msg=f"{name} {part} vs moments")
    axis = max(axes, key=lambda a: x.shape[a])  # the longest reduced axis
    rng = np.random.default_rng(len(name))
    sharded_counts = (1, 2, 3, 4, 8) if x.size <= 2**17 else (8,)  # 2**20: CI budget
    for k in sharded_counts:
        cuts = _cuts(rng, x.shape[axis], k, empty=k in (3, 8))
        states = [
            moments_state(tf.constant(np.take(x, range(a, b), axis=axis)), axes=list(axes))
            for a, b in cuts
        ]
        for merged in _shard_orders(rng, states):
            np.testing.assert_array_equal(
                merged.values.numpy(), whole.values.numpy(), err_msg=f"{name}, {k} shards"
            )


def _run_script(name, tmp_path, **arrays):
    src, dst = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, **arrays)
    proc = subprocess.run(
        [sys.executable, str(HERE / name), str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return dict(np.load(dst))


def _collective_data():
    """x [64, 6] float32 on an offset, a NaN in one shard, an inf in another."""
    rng = np.random.default_rng(41)
    x = rng.normal(1e6, 1.0, (64, 6)).astype(np.float32)
    x[5, 2], x[40, 4] = np.nan, np.inf
    return x


def test_jax_collectives_give_the_single_device_bits(tmp_path):
    """shard_map + psum, pmap + psum and jit on a NamedSharding input (8 virtual devices)
    give the TF state of the whole (after carrying) and its moments, bit for bit."""
    x = _collective_data()
    rng = np.random.default_rng(42)
    where = rng.random(x.shape) < np.linspace(0.1, 1.0, 64)[:, None]  # uneven per device
    where[24:32] = False  # device 3 holds no data
    out = _run_script("_state_jax_collectives.py", tmp_path, x=x, where=where)
    whole = moments_state(tf.constant(x), axes=0, where=tf.constant(where))
    mean, var = (t.numpy() for t in state_moments(whole, ddof=1))
    expected = [oracle(x[where[:, j], j][:, None], (0,), 1) for j in range(x.shape[1])]
    np.testing.assert_array_equal(bits(var), bits(np.array([e[1][0] for e in expected])))
    np.testing.assert_array_equal(bits(mean), bits(np.array([e[0][0] for e in expected])))
    for key in ("shard_map", "pmap", "jit_sharded"):
        np.testing.assert_array_equal(out[f"{key}_canonical"], whole.values.numpy(), err_msg=key)
        np.testing.assert_array_equal(bits(out[f"{key}_mean"]), bits(mean), err_msg=key)
        np.testing.assert_array_equal(bits(out[f"{key}_var"]), bits(var), err_msg=key)
    # The psum is the plain digit sum; the state computed on the sharded input is canonical.
    np.testing.assert_array_equal(out["jit_sharded"], whole.values.numpy())


def test_mirrored_strategy_all_reduce_gives_the_single_device_bits(tmp_path):
    """Four replicas with 10, 0, 31 and 23 rows all-reduce int32 states: every replica gets
    the bits of moments on all 64 rows."""
    x = _collective_data()
    out = _run_script("_state_tf_mirrored.py", tmp_path, x=x, cuts=np.array([0, 10, 10, 41, 64]))
    mean, var = tf_stable_moments.moments(tf.constant(x), [0], ddof=1)
    for replica in range(4):
        np.testing.assert_array_equal(bits(out["mean"][replica]), bits(mean.numpy()))
        np.testing.assert_array_equal(bits(out["var"][replica]), bits(var.numpy()))


# ------------------------------------------------------------------ layout, empty data, errors
def test_unmasked_layouts_and_the_empty_state():
    """Reduced axes in the middle and leading+trailing, split along a reduced axis; an empty
    input is the merge identity and rounds to NaN like moments of no data."""
    data = all_datasets()
    for key, split_axis in (("axes_0_2_strided", 2), ("axes_1_middle", 1)):
        x, axes, _ = data[key]
        cut = x.shape[split_axis] // 3
        first, second = np.split(x, [cut], axis=split_axis)
        merged = merge_states(
            moments_state(x=tf.constant(second), axes=axes), moments_state(first, axes)
        )
        whole = moments_state(x, axes)
        np.testing.assert_array_equal(merged.values.numpy(), whole.values.numpy())
        for ddof in (0, 1):
            got = state_moments(merged, ddof=ddof)
            want = tf_stable_moments.moments(tf.constant(x), list(axes), ddof=ddof)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(bits(g.numpy()), bits(w.numpy()))
    x = data["axes_1_middle"][0]
    empty = moments_state(x[:, :0], axes=1)
    assert empty.shape == (4, 5)
    state = moments_state(x, axes=1)
    np.testing.assert_array_equal(merge_states(state, empty).values.numpy(), state.values.numpy())
    mean, var = state_moments(empty)
    assert np.isnan(mean.numpy()).all() and np.isnan(var.numpy()).all()


def test_bad_input_raises_clear_errors():
    a = moments_state(np.ones((3, 2), np.float32), axes=0)
    with pytest.raises(ValueError, match=r"different dtypes; got a.dtype=float32, b.dtype=float64"):
        merge_states(a, moments_state(np.ones((3, 2)), axes=0))
    with pytest.raises(
        ValueError, match=r"different slice shapes; got a.shape=\(2,\), b.shape=\(3,\)"
    ):
        merge_states(a, moments_state(np.ones((2, 3), np.float32), axes=0))
    with pytest.raises(TypeError, match=r"merge_states: b must be a MomentsState; got b=1"):
        merge_states(a, 1)
    with pytest.raises(ValueError, match=r"78 digits per slice .* shape \(2, 5\)"):
        MomentsState(tf.zeros([2, 5], tf.int32), tf.float32)
    with pytest.raises(TypeError, match=r"values must be int32 digits; got values of dtype int64"):
        MomentsState(tf.zeros([2, 78], tf.int64), tf.float32)
    with pytest.raises(TypeError, match=r"got dtype int32"):
        moments_state(np.ones(3, np.int32), axes=0)
    with pytest.raises(TypeError, match=r"where must be a bool tensor; got where of dtype float32"):
        moments_state(np.ones(3, np.float32), axes=0, where=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"moments_state: axis 2 is out of range"):
        moments_state(np.ones(3, np.float32), axes=2)
    with pytest.raises(
        ValueError, match=r"state_moments: ddof must be a non-negative int; got ddof=-1"
    ):
        state_moments(a, ddof=-1)
    with pytest.raises(AttributeError, match="immutable"):
        a.values = None


@pytest.mark.parametrize(
    "dtype", DTYPES, ids=lambda d: np.dtype(getattr(d, "as_numpy_dtype", d)).name
)
def test_native_state_moments_has_the_bits_of_the_plain_finish(dtype):
    """state_moments through the native op (StableStateMoments: the CPU, outside XLA) and
    through plain TensorFlow operations (under `portable`) give the same bits, on a state
    and on an uncarried digit sum of states: slices on an offset, with NaN or infinities,
    of one element (n - ddof <= 0 for ddof 1 and 5), tiny, empty; the native op refuses a
    negative digit (no sum of states).  The same for JAX's FFI call.  With the native
    kernel off (TF_STABLE_MOMENTS_NATIVE=0) both sides are the plain finish."""
    dtype = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    rng = np.random.default_rng(8)
    x = rng.normal(0, 1, (40, 6)) * np.array([1, 1, 1e20, 1, 1e-30, 1])
    x[:, 1] += 1e6
    x[3, 3], x[5, 5], x[6, 5] = np.nan, np.inf, -np.inf
    if dtype.kind == "c":
        x = x + 1j * rng.normal(0, 1, x.shape)
    with np.errstate(all="ignore"):
        x = x.astype(dtype)
    graph = tf.function(lambda v: state_moments(MomentsState(v, x.dtype))[0])
    ops = graph.get_concrete_function(moments_state(x, axes=0).values).graph.get_operations()
    assert ("StableStateMoments" in {op.type for op in ops}) is (tf_native.op() is not None)
    for data in (x, x[:1], x[:0]):
        state = moments_state(tf.constant(data), axes=0)
        doubled = MomentsState(state.values * 2, state.dtype)  # the sum of two states
        for s in (state, doubled):
            for ddof in (0, 1, 5):
                native = state_moments(s, ddof=ddof)
                with tf_stable_moments.portable():
                    plain = state_moments(s, ddof=ddof)
                for got, want in zip(native, plain):
                    np.testing.assert_array_equal(bits(got.numpy()), bits(want.numpy()))
    if tf_native.op() is not None:  # the native finish checks; the plain one cannot
        bad = MomentsState(tf.fill(state.values.shape, -1), state.dtype)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"slice 0 is not a state"):
            state_moments(bad)
    _check_jax_native_finish(x)


def _check_jax_native_finish(x):
    """jax_kernel.state_moments through the native FFI call (lowered for the CPU) and its
    XLA finish (`_finish_fn(native=False)` jitted): the same bits, as above; the FFI call is in
    the CPU lowering and not in a `jax.export` artifact; vmap batches it."""
    import jax

    import jax_kernel
    from jax_kernel import _state as jax_state

    with jax.enable_x64(x.dtype in (np.float64, np.complex128)):
        # The XLA finish, one jitted function per ddof (n - ddof <= 0 on one element): every
        # state below has the same shape, so each compiles once.
        dtype = jax_kernel.moments_state(x, 0).dtype
        finish = {ddof: jax.jit(jax_state._finish_fn(False, dtype, ddof)) for ddof in (0, 1)}
        for data in (x, x[:1], x[:0]):
            state = jax_kernel.moments_state(data, 0)
            doubled = jax_kernel.MomentsState(state.values * 2, state.dtype)
            for s in (state, doubled):
                for ddof in (0, 1):
                    native = jax_kernel.state_moments(s, ddof)
                    xla = finish[ddof](s.values)
                    for got, want in zip(native, xla):
                        np.testing.assert_array_equal(bits(got), bits(want))
        fn = jax.jit(lambda v: jax_kernel.state_moments(jax_kernel.MomentsState(v, x.dtype)))
        values = jax_kernel.moments_state(x, 0).values
        native = jax_state._native.available()  # TF_STABLE_MOMENTS_NATIVE=0: the XLA finish
        assert (jax_state._native.FINISH_TARGET in fn.lower(values).as_text()) is native
        exported = jax.export.export(fn, platforms=("cpu", "cuda"))(values)
        assert jax_state._native.FINISH_TARGET not in exported.mlir_module()
        for got, want in zip(exported.call(values), fn(values)):
            np.testing.assert_array_equal(bits(got), bits(want))
        batched = jax.vmap(fn)(np.stack([values, 2 * values]))
        for got, want in zip(batched, fn(2 * values)):
            np.testing.assert_array_equal(bits(got[1]), bits(want))


# ------------------------------------------------------------------ streaming
def _stream_data():
    rng = np.random.default_rng(14)
    x = rng.normal(1e6, 1.0, (50, 3)).astype(np.float32)
    x[:, 2] = rng.normal(0.0, 1e-3, 50).astype(np.float32)
    return x


def test_accumulate_state_any_batching_gives_the_bits_of_the_whole():
    """Batches of 1, 7 (a short last one) and all at once, as lists and as a batched
    tf.data.Dataset: the state of the whole, and its moments the oracle's and moments' bits."""
    x = _stream_data()
    whole = moments_state(x, axes=0).values.numpy()
    want = [bits(v) for v in oracle(x, (0,), ddof=1)]
    np.testing.assert_array_equal(
        want, [bits(t.numpy()) for t in tf_stable_moments.moments(x, [0], ddof=1)]
    )
    streams = {size: [x[i : i + size] for i in range(0, len(x), size)] for size in (1, 7, len(x))}
    streams["dataset_7"] = tf.data.Dataset.from_tensor_slices(x).batch(7)
    streams["tensors_7"] = [tf.constant(b) for b in streams[7]]
    for label, batches in streams.items():
        state = tf_stable_moments.accumulate_state(batches, axes=0)
        np.testing.assert_array_equal(state.values.numpy(), whole, err_msg=str(label))
        got = [bits(t.numpy()) for t in state_moments(state, ddof=1)]
        np.testing.assert_array_equal(got, want, err_msg=str(label))
    empty = tf_stable_moments.accumulate_state(
        tf.data.Dataset.from_tensor_slices(x[:0]).batch(4), axes=0
    )
    assert empty.shape == (3,) and not empty.values.numpy().any()  # the empty state


def test_accumulate_state_jax_matches_tf():
    import jax_kernel

    x = _stream_data()
    # One batch shape (7 rows, 49 of the 50): one compilation (CI budget); TF tests 1/7/all.
    batches = (x[i : i + 7] for i in range(0, 49, 7))  # a generator
    state = jax_kernel.accumulate_state(batches, axes=0)
    np.testing.assert_array_equal(np.asarray(state.values), moments_state(x[:49], 0).values)
    got = [bits(np.asarray(t)) for t in jax_kernel.state_moments(state, ddof=1)]
    np.testing.assert_array_equal(got, [bits(v) for v in oracle(x[:49], (0,), ddof=1)])


def test_accumulate_state_bad_input_raises_clear_errors():
    import jax_kernel

    x = np.ones((7, 3), np.float32)  # the shape of the JAX test above: compiled once
    for accumulate in (tf_stable_moments.accumulate_state, jax_kernel.accumulate_state):
        with pytest.raises(TypeError, match=r"iterable of batches .* type ndarray"):
            accumulate(x, axes=0)
        with pytest.raises(ValueError, match=r"batches is empty"):
            accumulate([], axes=0)
        with pytest.raises(ValueError, match=r"batch 1 is float16 of shape \(7, 3\)"):
            accumulate([x, x.astype(np.float16)], axes=0)
        with pytest.raises(ValueError, match=r"kept dimensions of the first; batch 1 has shape"):
            accumulate([x, x[:, :2]], axes=0)
    dataset = tf.data.Dataset.from_tensor_slices((x, x)).batch(2)
    with pytest.raises(TypeError, match=r"single tensors .* element_spec="):
        tf_stable_moments.accumulate_state(dataset, axes=0)
    unknown = tf.data.Dataset.from_generator(
        lambda: iter([x]), output_signature=tf.TensorSpec([None, None], tf.float32)
    )
    with pytest.raises(ValueError, match=r"must give the kept dimensions"):
        tf_stable_moments.accumulate_state(unknown, axes=0)


# ------------------------------------------------------------------ merge trees (docs section 13)
def test_merge_trees_simulation_small():
    """benchmarks/merge_trees.py with 16 shards (TF: nothing compiled): chain, balanced and
    random binary trees, a ring all-reduce and one flat int32 sum all give the state of the
    whole and the bits of moments and of the oracle; the digit headroom is measured.  The
    certified merge's float64 all-reduce by the same trees: the oracle's bits."""
    import importlib.util

    path = HERE.parent / "benchmarks" / "merge_trees.py"
    spec = importlib.util.spec_from_file_location("merge_trees", path)
    merge_trees = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_trees)
    figures = merge_trees.run(devices=16, rows=24, channels=4, framework="tf", verbose=False)
    assert figures["trees"] == [
        "chain",
        "binary",
        "random_0",
        "random_1",
        "random_2",
        "ring",
        "psum",
    ]
    assert figures["state_int32_per_slice"] == state_size(tf.float32)
    assert 2**16 <= figures["headroom"][16] <= 16 * (2**16 - 1) < 2**31
    # The certified merge (JAX): its float64 all-reduce summed by seven trees, which give
    # different totals; every tree decides every slice but the NaN channel (3) alike on
    # every device, with the oracle's bits (run_certified asserts them).
    certified = merge_trees.run_certified(devices=16, rows=24, channels=4, verbose=False)
    assert all(o == [3] for o in certified["open"].values()), certified["open"]
    assert certified["distinct_totals"] > 1
