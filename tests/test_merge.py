"""The certified merge across devices (docs section 13b): one all-reduce of every device's
fast sums and bounds decides the slices of the union; exact states only for the rest.

tests/_merge_check.py runs the cases on 8 virtual CPU devices (XLA_FLAGS must be set
before JAX starts: its own process) and writes what every device computed; here they
are compared with the exact oracle of the global batch, bit for bit.
"""

import os
import subprocess
import sys
from pathlib import Path

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
from modes import bits

from tf_stable_moments._oracle import exact_moments

# Cases whose every slice the merged fast path must decide (no second round): N(0, 1),
# N(1e4, 1), N(1e6, 1) and ReLU data on 1-8 devices, float16, bfloat16, uneven and empty
# shards (a selection), and exact global ties (decided on the lattice).
DECIDED = [
    *(f"normal{loc}_r{r}" for loc in ("0", "10000", "1e+06") for r in (1, 2, 4, 8)),
    "relu_r8",
    "float16_r4",
    "bfloat16_r4",
    "uneven_r8",
]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    dst = tmp_path_factory.mktemp("merge") / "out.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_STABLE_MOMENTS_NATIVE="0")
    script = Path(__file__).with_name("_merge_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(dst)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(dst))


@pytest.fixture(scope="module")
def merged(raw):
    names = sorted({k[: -len("_dtype")] for k in raw if k.endswith("_dtype")})
    return {name: _case(raw, name) for name in names}


def _case(out, name):
    dtype = jnp.dtype(str(out[f"{name}_dtype"]))
    x = out[f"{name}_x"]
    x = x.view(dtype) if x.dtype != dtype else x
    case = {"x": x, "mask": out[f"{name}_mask"], "todo": out[f"{name}_todo"]}
    for key in ("mean", "var", "mean_lo", "single_mean_lo"):
        if f"{name}_{key}" in out:
            v = out[f"{name}_{key}"]
            case[key] = v.view(dtype) if v.dtype != dtype and key != "single_mean_lo" else v
    return case


def _oracle(x, mask):
    if mask.all():
        return datasets.oracle(x, (0,))
    stats = [exact_moments(x[mask[:, j], j], x.dtype) for j in range(x.shape[1])]
    return tuple(np.array([s[i] for s in stats], x.dtype) for i in (0, 1))


def test_every_device_gets_the_oracle_bits_of_the_global_batch(merged):
    for name, case in merged.items():
        mean, var = _oracle(case["x"], case["mask"])
        for device in range(case["mean"].shape[0]):
            for got, want, what in ((case["mean"], mean, "mean"), (case["var"], var, "var")):
                assert np.array_equal(bits(got[device]), bits(want)), (name, device, what)


@pytest.mark.parametrize("name", DECIDED)
def test_the_merged_fast_path_decides_every_slice(merged, name):
    assert merged[name]["todo"].sum() == 0, merged[name]["todo"]


def test_only_the_slices_no_bound_decides_take_the_exact_round_on_every_device(merged):
    # special_r8: a NaN in one device's part of slice 2, an inf in slice 5; ties_r8: slice
    # 3 is a near-tie of 2**-106 that only the exact states decide.
    for name, open_slices in (("special_r8", {2, 5}), ("ties_r8", {3})):
        todo = merged[name]["todo"]
        assert (todo == todo[0]).all(), todo  # every device decided alike
        assert set(np.flatnonzero(todo[0])) == open_slices, todo[0]
    mean = merged["ties_r8"]["mean"][0]
    assert mean[0] == np.float32(1.0)  # a tie, to even
    assert mean[3] == np.float32(1 + 2.0**-23)  # just above the midpoint: up
    special = merged["special_r8"]
    assert np.isnan(special["mean"][0][2]) and special["mean"][0][5] == np.inf
    assert np.isnan(special["var"][0][2]) and np.isnan(special["var"][0][5])


@pytest.mark.parametrize("replicas", [1, 2, 8, 255, 1000])
def test_the_smallest_magnitude_rides_in_the_sum_exactly_below_256_replicas(replicas):
    """Each replica's 2**(8 (-e)) (e: the exponent of its smallest |x|, or nothing), summed
    in any order, gives 2**(min e) exactly for R < 256; with more, a power of two no
    larger and at most 2 binades smaller (a finer lattice, still valid: section 13b)."""
    import jax

    from jax_kernel import _ops
    from moments_core import _kernel

    rng = np.random.default_rng(replicas)
    with jax.enable_x64(True):
        for trial in range(20):
            e = rng.integers(-126, 128, replicas)
            if trial % 4 == 0:  # exponents piled up at the minimum: the sum's worst case
                e[:] = e.min()
            smallest = np.ldexp(1.0 + rng.random(replicas), e)
            if trial % 5 == 1:
                smallest[rng.random(replicas) < 0.5] = np.inf  # replicas with no nonzero x
            terms = np.asarray(_kernel._min_exponent_term(_ops, jnp.asarray(smallest)))
            for order in (terms, terms[::-1], rng.permutation(terms)):
                total = 0.0
                for t in order:
                    total += t
                got = float(_kernel._min_exponent(_ops, jnp.asarray([total]))[0])
                finite = smallest[np.isfinite(smallest)]
                if not finite.size:
                    assert got == np.inf
                    continue
                want = 2.0 ** int(np.floor(np.log2(finite.min())))
                if replicas < 256:
                    assert got == want, (trial, got, want)
                else:
                    assert want / 4 <= got <= want, (trial, got, want)


def test_mean_lo_has_the_bits_of_one_device_holding_everything(merged):
    for name, case in merged.items():
        if "single_mean_lo" not in case:
            continue
        lo = case["mean_lo"]
        want = case["single_mean_lo"]
        for device in range(lo.shape[0]):
            assert np.array_equal(bits(lo[device]), want), (name, device)


def test_moments_with_axis_name_gives_the_oracle_bits_of_the_union(raw):
    x, z = raw["api_x"], raw["api_z"]
    for ddof in (0, 1):
        mean, var = datasets.oracle(x, (0,), ddof)
        assert np.array_equal(bits(raw[f"api_ddof{ddof}_mean"]), bits(mean)), ddof
        assert np.array_equal(bits(raw[f"api_ddof{ddof}_var"]), bits(var)), ddof
    mean, var = datasets.oracle(z, (0,))
    assert np.array_equal(bits(raw["api_complex_mean"]), bits(mean))
    assert np.array_equal(bits(raw["api_complex_var"]), bits(var))
    # pmap over 4 devices of 16 rows, groups [[0, 1], [2, 3]]: each group's 32 rows.
    for device in range(4):
        half = x[32 * (device // 2) : 32 * (device // 2 + 1)]
        mean, var = datasets.oracle(half, (0,))
        assert np.array_equal(bits(raw["api_groups_mean"][device]), bits(mean)), device
        assert np.array_equal(bits(raw["api_groups_var"][device]), bits(var)), device


def test_the_gradient_with_axis_name_is_one_devices_to_float32_rounding(raw):
    want, got = raw["api_single_grad"], raw["api_grad"]
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_moments_refuses_groups_without_an_axis_name():
    import jax_kernel

    with pytest.raises(ValueError, match=r"axis_index_groups needs axis_name.*\[\[0, 1\]\]"):
        jax_kernel.moments(np.ones((4, 2), np.float32), 0, axis_index_groups=[[0, 1]])


# ------------------------------------------------------------------ TensorFlow replicas
def _bfloat16(x):
    """x rounded to bfloat16, as float32 (exact)."""
    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)


def _tf_cases():
    """{name: (x, cuts)}: the global batch and the rows of each of four replicas (one
    traced function per dtype: tracing the merge for four replicas takes seconds)."""
    rng = np.random.default_rng(29)
    x = rng.normal(1e6, 1, (64, 8)).astype(np.float32)
    x[5, 2], x[40, 4] = np.nan, np.inf  # one replica's NaN, another's inf
    x[:32, 6:] = 1.0  # the union's mean a midpoint, no shard's
    x[32:, 6:] = 1 + 2.0**-23
    x[63, 7] = 1 + 2.0**-22  # the union's mean 2**-29 above the midpoint
    wide = rng.normal(1e8, 1, (40, 3))  # float64: the exact states
    z = (rng.normal(1e3, 1, (40, 3)) + 1j * rng.normal(0, 1, (40, 3))).astype(np.complex64)
    # bfloat16 (held as float32 here, cast in the replicas): the open slices' elements
    # travel as 16-bit patterns; slice 1 a NaN, slice 2 a near-tie no bound decides (the
    # mean 1 + 2**-8 + 2**-100 / 24, as in the float32 case), slice 3 -0.0 and 2**-126.
    half = _bfloat16(rng.normal(100, 1, (24, 4)))
    half[5, 1] = np.nan
    half[:, 2] = 1.0
    half[10:22, 2] = 1 + 2.0**-7
    half[22, 2], half[23, 2] = 2.0, 2.0**-100
    half[:, 3], half[20, 3] = -0.0, 2.0**-126
    return {
        "bfloat16": (half, np.array([0, 3, 3, 17, 24])),
        "float32": (x, np.array([0, 10, 10, 41, 64])),
        "float64": (wide, np.array([0, 1, 20, 39, 40])),
        "complex64": (z, np.array([0, 0, 13, 27, 40])),
    }


@pytest.fixture(scope="module")
def tf_replicas(tmp_path_factory):
    arrays = {}
    for name, (x, cuts) in _tf_cases().items():
        arrays[f"{name}_x"], arrays[f"{name}_cuts"] = x, cuts
    rng = np.random.default_rng(30)
    arrays["grad_x"] = rng.normal(100, 3, (40, 3)).astype(np.float32)
    arrays["grad_cuts"] = np.array([0, 7, 20, 20, 40])
    arrays["grad_coef"] = rng.normal(0, 1, (4, 2, 3)).astype(np.float32)
    tmp = tmp_path_factory.mktemp("tf_replicas")
    src, dst = tmp / "in.npz", tmp / "out.npz"
    np.savez(src, **arrays)
    script = Path(__file__).with_name("_moments_tf_mirrored.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, str(script), str(src), str(dst)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return arrays, dict(np.load(dst))


@pytest.mark.parametrize("name", sorted(_tf_cases()))
def test_tf_moments_synchronized_gives_every_replica_the_oracle_bits_of_the_union(
    tf_replicas, name
):
    """moments(..., synchronized=True) in a MirroredStrategy of four replicas (uneven and
    empty shards; NaN and inf in one replica's rows; a global tie and a near-tie; bfloat16;
    float64 and complex64 data, through the exact states): every replica's mean and
    variance are the oracle's of the union, ddof 0 and 1."""
    arrays, out = tf_replicas
    x = arrays[f"{name}_x"]
    for ddof in (0, 1):
        if name == "bfloat16":  # the script's results come back as float32 (exact)
            mean, var = datasets.oracle(x.astype(jnp.bfloat16), (0,), ddof)
            mean, var = mean.astype(np.float32), var.astype(np.float32)
        else:
            mean, var = datasets.oracle(x, (0,), ddof)
        for replica in range(4):
            got_mean = out[f"{name}_ddof{ddof}_mean"][replica]
            got_var = out[f"{name}_ddof{ddof}_var"][replica]
            assert np.array_equal(bits(got_mean), bits(mean)), (ddof, replica, got_mean, mean)
            assert np.array_equal(bits(got_var), bits(var)), (ddof, replica, got_var, var)
    if name == "float32":
        assert out["float32_ddof0_mean"][0][6] == np.float32(1.0)  # the tie, to even
        assert out["float32_ddof0_mean"][0][7] == np.float32(1 + 2.0**-23)  # above it: up


def test_tf_moments_synchronized_gradient_is_that_of_the_union(tf_replicas):
    """The gradient of every replica's loss c_mean . mean + c_var . var (ddof 1) with
    respect to its rows is that of the summed losses on one device holding the union:
    (sum of c_mean) / N + 2 (x - mean) (sum of c_var) / (N - 1), to float32 rounding."""
    arrays, out = tf_replicas
    x, coef = arrays["grad_x"].astype(np.float64), arrays["grad_coef"].astype(np.float64)
    c = coef.sum(0)
    n = x.shape[0]
    want = c[0] / n + 2 * (x - x.mean(0)) * c[1] / (n - 1)
    np.testing.assert_allclose(out["grad"], want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_tf_moments_synchronized_outside_replicas():
    """With no strategy (one replica in sync) the local statistics, the same bits; in a
    cross-replica context a clear error; synchronized must be a bool."""
    import tensorflow as tf

    import tf_stable_moments

    x = np.random.default_rng(2).normal(1e4, 1, (33, 3)).astype(np.float32)
    got = tf_stable_moments.moments(x, [0], synchronized=True)
    want = tf_stable_moments.moments(x, [0])
    for g, w in zip(got, want):
        assert np.array_equal(bits(g.numpy()), bits(w.numpy()))
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope(), pytest.raises(ValueError, match=r"synchronized=True.*strategy\.run"):
        tf_stable_moments.moments(x, [0], synchronized=True)
    with pytest.raises(TypeError, match=r"synchronized must be a bool; got synchronized='yes'"):
        tf_stable_moments.moments(x, [0], synchronized="yes")
