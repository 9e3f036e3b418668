"""jax_kernel.flax.linen: Flax's normalization modules with correctly rounded statistics
(issue #25 items 1 and 5, in part).

The classes keep Flax's fields, variable collections and names (a Flax checkpoint
applies to them); their statistics are the oracle's bits (and those of
`jax_kernel.moments`); their outputs on offset data are accurate where Flax's are not;
on benign data they agree with Flax's, gradients included.
"""

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as flax_linen  # the [flax] extra, a test dependency
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from datasets import oracle
from modes import bits

import jax_kernel
from jax_kernel.flax import linen as stable

EPS = 1e-5
# name -> (our class, Flax's, keyword arguments, input shape, axes of the statistics of
# the input as laid out by `grouped`)
CASES = {
    "BatchNorm": (stable.BatchNorm, flax_linen.BatchNorm, {"use_running_average": False}, (64, 16)),
    "BatchNorm_conv": (
        stable.BatchNorm,
        flax_linen.BatchNorm,
        {"use_running_average": False},
        (8, 4, 4, 6),
    ),
    "LayerNorm": (stable.LayerNorm, flax_linen.LayerNorm, {}, (16, 64)),
    "LayerNorm_axes_12": (
        stable.LayerNorm,
        flax_linen.LayerNorm,
        {"reduction_axes": (1, 2), "feature_axes": (2,)},
        (4, 8, 16),
    ),
    "GroupNorm": (stable.GroupNorm, flax_linen.GroupNorm, {"num_groups": 4}, (4, 8, 16)),
    "GroupNorm_group_size": (
        stable.GroupNorm,
        flax_linen.GroupNorm,
        {"num_groups": None, "group_size": 2},
        (4, 3, 6),
    ),
}


def reference(name, x):
    """float64 (x - mean) / sqrt(var + EPS) of each case's statistics."""
    x = x.astype(np.float64)
    if name.startswith("BatchNorm"):
        axes = tuple(range(x.ndim - 1))
    elif name == "LayerNorm":
        axes = (1,)
    elif name == "LayerNorm_axes_12":
        axes = (1, 2)
    else:
        kwargs = CASES[name][2]
        groups = kwargs["num_groups"] or x.shape[-1] // kwargs["group_size"]
        g = x.reshape(x.shape[:-1] + (groups, -1))
        axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
        m, v = g.mean(axes, keepdims=True), g.var(axes, keepdims=True)
        return ((g - m) / np.sqrt(v + EPS)).reshape(x.shape)
    m, v = x.mean(axes, keepdims=True), x.var(axes, keepdims=True)
    return (x - m) / np.sqrt(v + EPS)


def assert_ours_near_theirs_off(ours, theirs, want):
    """Ours within 1e-5 of the float64 formula where Flax's is off by more than 1."""
    assert np.abs(np.asarray(ours) - want).max() <= 1e-5
    assert np.abs(np.asarray(theirs) - want).max() > 1.0


def apply(module, variables, x):
    out = module.apply(variables, x, mutable=["batch_stats"])
    return np.asarray(out[0])


@pytest.mark.parametrize("offset", [1e6, 1e7], ids=["N(1e6,1)", "N(1e7,1)"])
@pytest.mark.parametrize("name", CASES)
def test_output_matches_float64_where_flax_does_not(name, offset):
    ours, theirs, kwargs, shape = CASES[name]
    x = np.random.default_rng(25).normal(offset, 1.0, shape).astype(np.float32)
    want = reference(name, x)
    variables = ours(epsilon=EPS, **kwargs).init(jax.random.PRNGKey(0), x)
    assert_ours_near_theirs_off(
        apply(ours(epsilon=EPS, **kwargs), variables, x),
        apply(theirs(epsilon=EPS, **kwargs), variables, x),
        want,
    )


@pytest.mark.parametrize("name", CASES)
def test_variables_are_flaxs_and_benign_outputs_and_gradients_agree(name):
    ours, theirs, kwargs, shape = CASES[name]
    x = np.random.default_rng(7).normal(0.5, 2.0, shape).astype(np.float32)
    a, b = ours(**kwargs), theirs(**kwargs)
    key = jax.random.PRNGKey(1)
    va, vb = a.init(key, x), b.init(key, x)
    assert jax.tree_util.tree_structure(va) == jax.tree_util.tree_structure(vb)
    for p, q in zip(jax.tree_util.tree_leaves(va), jax.tree_util.tree_leaves(vb)):
        assert p.shape == q.shape and p.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    # A trained Flax checkpoint applies to ours: random scale and bias.
    va = jax.tree_util.tree_map(lambda v: v + jax.random.normal(key, v.shape, v.dtype), va)
    np.testing.assert_allclose(apply(a, va, x), apply(b, va, x), rtol=1e-5, atol=2e-6)

    def loss(module, xx):
        return jnp.sum(jnp.sin(3.0 * module.apply(va, xx, mutable=["batch_stats"])[0]))

    ga, gb = jax.grad(lambda xx: loss(a, xx))(x), jax.grad(lambda xx: loss(b, xx))(x)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask", [False, True], ids=["all", "masked"])
def test_batch_stats_are_the_oracles_bits(mask):
    """momentum=0: the running mean and variance are the batch statistics themselves,
    whose bits are the oracle's (of the selected rows) and jax_kernel.moments'."""
    x = np.random.default_rng(3).normal(1e4, 1.0, (48, 5)).astype(np.float32)
    select = np.ones(x.shape, bool)
    if mask:
        select[::3] = False
    module = stable.BatchNorm(use_running_average=False, momentum=0.0)
    variables = module.init(jax.random.PRNGKey(0), x)
    _, updated = module.apply(variables, x, mask=jnp.asarray(select), mutable=["batch_stats"])
    mean, var = (np.asarray(updated["batch_stats"][k]) for k in ("mean", "var"))
    kept = x[select[:, 0]]
    ref_mean, ref_var = oracle(kept, (0,))
    np.testing.assert_array_equal(bits(mean), bits(ref_mean))
    np.testing.assert_array_equal(bits(var), bits(ref_var))
    if not mask:
        jm, jv = jax_kernel.moments(x, (0,))
        np.testing.assert_array_equal(bits(var), bits(np.asarray(jv)))
        np.testing.assert_array_equal(bits(mean), bits(np.asarray(jm)))


def test_use_running_average_normalizes_with_the_stored_statistics():
    x = np.random.default_rng(4).normal(3.0, 2.0, (32, 6)).astype(np.float32)
    ours = stable.BatchNorm(use_running_average=True)
    theirs = flax_linen.BatchNorm(use_running_average=True)
    variables = ours.init(jax.random.PRNGKey(0), x)
    variables = jax.tree_util.tree_map(lambda v: v + 0.5, variables)
    np.testing.assert_allclose(apply(ours, variables, x), apply(theirs, variables, x), rtol=1e-6)


def test_bad_arguments_raise_errors_naming_them():
    x = jnp.ones((2, 3, 6))
    with pytest.raises(ValueError, match=r"give exactly one of num_groups and group_size.*"):
        stable.GroupNorm(num_groups=2, group_size=3).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"num_groups=4 does not divide the 6 channels"):
        stable.GroupNorm(num_groups=4).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"channels \(6\) are not a multiple of group_size=4"):
        stable.GroupNorm(num_groups=None, group_size=4).init(jax.random.PRNGKey(0), x)


def test_axis_name_gives_the_global_batchs_bits(tmp_path):
    """pmap and shard_map over 4 virtual CPU devices (tests/_flax_sync_check.py): the
    statistics and outputs of one device holding the global batch, bit for bit (the
    statistics also masked, and per group of axis_index_groups); gradients equal to
    float32 rounding."""
    dst = tmp_path / "out.npz"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    script = Path(__file__).with_name("_flax_sync_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(dst)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = dict(np.load(dst))
    x = np.random.default_rng(24).normal(1e4, 1.0, (32, 6)).astype(np.float32)
    ref_mean, ref_var = oracle(x, (0,))
    np.testing.assert_array_equal(bits(out["single_mean"]), bits(ref_mean))
    np.testing.assert_array_equal(bits(out["single_var"]), bits(ref_var))
    for kind in ("pmap", "shard_map"):
        for stat in ("mean", "var"):
            got = (
                np.broadcast_to(out[f"{kind}_{stat}"], (4, 6))
                if kind == "pmap"
                else out[f"{kind}_{stat}"][None]
            )
            np.testing.assert_array_equal(
                bits(got), bits(np.broadcast_to(out[f"single_{stat}"], got.shape))
            )
        # The same statistics and residuals, and an output whose every rounding is fixed
        # (docs section 14): the same bits in every program.
        np.testing.assert_array_equal(bits(out[f"{kind}_y"]), bits(out["single_y"]))
    for stat in ("mean", "var"):
        for device in range(4):
            want = out[f"half{device // 2}_{stat}"]
            np.testing.assert_array_equal(bits(out[f"groups_{stat}"][device]), bits(want))
        masked = out[f"masked_pmap_{stat}"]
        np.testing.assert_array_equal(bits(masked), bits(out[f"masked_single_{stat}"]))
    np.testing.assert_allclose(out["pmap_grad"], out["single_grad"], rtol=0, atol=1e-5)
    # The collectives of that training step (docs section 13b), on 6 channels: forward the
    # shared shift [C], the fast sums and exponent terms [3 C], mean_lo's sums with the
    # count of open slices [C + 1], and in the branch that runs only when a slice is open
    # the exact states [L C] and mean_lo's sums again [C]; backward one [2, C] psum of the
    # tangent rule's two sums.
    c, size = 6, jax_kernel._state.state_size(jnp.float32)
    want = sorted([c, 3 * c, c + 1, size * c, c, 2 * c])
    np.testing.assert_array_equal(out["grad_collectives"], want)


# ------------------------------------------------------------------ flax.nnx
from flax import nnx  # noqa: E402

from jax_kernel.flax import nnx as stable_nnx  # noqa: E402

NNX_CASES = {
    "BatchNorm": (
        lambda cls, c: cls(c, use_running_average=False, epsilon=EPS, rngs=nnx.Rngs(0)),
        stable_nnx.BatchNorm,
        nnx.BatchNorm,
        (64, 16),
    ),
    "LayerNorm": (
        lambda cls, c: cls(c, epsilon=EPS, rngs=nnx.Rngs(0)),
        stable_nnx.LayerNorm,
        nnx.LayerNorm,
        (16, 64),
    ),
    "GroupNorm": (
        lambda cls, c: cls(c, num_groups=4, epsilon=EPS, rngs=nnx.Rngs(0)),
        stable_nnx.GroupNorm,
        nnx.GroupNorm,
        (4, 8, 16),
    ),
}


@pytest.mark.parametrize("offset", [1e6, 1e7], ids=["N(1e6,1)", "N(1e7,1)"])
@pytest.mark.parametrize("name", NNX_CASES)
def test_nnx_output_matches_float64_where_flax_does_not(name, offset):
    make, ours, theirs, shape = NNX_CASES[name]
    x = np.random.default_rng(26).normal(offset, 1.0, shape).astype(np.float32)
    want = reference(name, x)
    assert_ours_near_theirs_off(make(ours, shape[-1])(x), make(theirs, shape[-1])(x), want)


@pytest.mark.parametrize("name", NNX_CASES)
def test_nnx_state_is_flaxs_and_benign_outputs_and_gradients_agree(name):
    make, ours, theirs, shape = NNX_CASES[name]
    a, b = make(ours, shape[-1]), make(theirs, shape[-1])
    sa, sb = nnx.state(a), nnx.state(b)
    assert jax.tree_util.tree_structure(sa) == jax.tree_util.tree_structure(sb)
    for p, q in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    # A Flax module's trained state loads into ours.
    sb = jax.tree_util.tree_map(lambda v: v + 0.5, sb)
    nnx.update(a, sb)
    nnx.update(b, sb)
    x = np.random.default_rng(5).normal(0.5, 2.0, shape).astype(np.float32)
    np.testing.assert_allclose(np.asarray(a(x)), np.asarray(b(x)), rtol=1e-5, atol=2e-6)

    def loss(module, v):
        return jnp.sum(jnp.sin(3.0 * module(v)))

    ga = nnx.grad(loss, argnums=1)(a, x)
    gb = nnx.grad(loss, argnums=1)(b, x)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-4, atol=1e-5)


def test_nnx_batch_stats_are_the_oracles_bits_and_running_average_is_used():
    x = np.random.default_rng(3).normal(1e4, 1.0, (48, 5)).astype(np.float32)
    module = stable_nnx.BatchNorm(5, momentum=0.0, rngs=nnx.Rngs(0))
    module(x, use_running_average=False)
    ref_mean, ref_var = oracle(x, (0,))
    np.testing.assert_array_equal(bits(np.asarray(module.mean[...])), bits(ref_mean))
    np.testing.assert_array_equal(bits(np.asarray(module.var[...])), bits(ref_var))
    theirs = nnx.BatchNorm(5, rngs=nnx.Rngs(0))
    nnx.update(theirs, nnx.state(module))
    y = np.random.default_rng(4).normal(1e4, 1.0, (8, 5)).astype(np.float32)
    got = module(y, use_running_average=True)
    np.testing.assert_allclose(got, theirs(y, use_running_average=True), rtol=1e-6, atol=1e-6)


def _trained_batch_stats(module, x, steps=3):
    """Variables of `module` after `steps` training-mode calls on shifted copies of x."""
    variables = module.init(jax.random.PRNGKey(0), x)
    for i in range(steps):
        _, updated = module.apply(variables, x + i, mutable=["batch_stats"])
        variables = {**variables, **updated}
    return variables


def test_checkpoint_round_trip_keeps_every_bit():
    """flax.serialization (the msgpack checkpoints Flax's and orbax's utilities write):
    a trained model's params and batch_stats saved and restored into a fresh model's
    variables give back the same bits, and the same inference outputs (issue #25 item 6)."""
    from flax import serialization

    x = np.random.default_rng(5).normal(1e4, 1.0, (32, 6)).astype(np.float32)
    module = stable.BatchNorm(use_running_average=False, momentum=0.9)
    trained = _trained_batch_stats(module, x)
    template = module.init(jax.random.PRNGKey(1), x)
    restored = serialization.from_bytes(template, serialization.to_bytes(trained))
    for a, b in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))
    inference = stable.BatchNorm(use_running_average=True)
    np.testing.assert_array_equal(
        bits(np.asarray(inference.apply(trained, x))),
        bits(np.asarray(inference.apply(restored, x))),
    )
    assert not np.array_equal(
        bits(np.asarray(template["batch_stats"]["mean"])),
        bits(np.asarray(trained["batch_stats"]["mean"])),
    )  # the round trip carried trained statistics, not the initial zeros


def test_a_flax_checkpoint_loads_into_ours_and_ours_into_flax():
    """One import apart: a checkpoint written from Flax's BatchNorm restores into ours
    (same tree, names, shapes, dtypes), and ours into Flax's; ours then normalizes with
    the stored statistics as the float64 formula does."""
    from flax import serialization

    x = np.random.default_rng(6).normal(3.0, 2.0, (32, 6)).astype(np.float32)
    theirs = _trained_batch_stats(flax_linen.BatchNorm(use_running_average=False), x)
    ours_template = stable.BatchNorm(use_running_average=False).init(jax.random.PRNGKey(1), x)
    loaded = serialization.from_bytes(ours_template, serialization.to_bytes(theirs))
    stats = {k: np.asarray(loaded["batch_stats"][k], np.float64) for k in ("mean", "var")}
    params = {k: np.asarray(loaded["params"][k], np.float64) for k in ("scale", "bias")}
    want = (x - stats["mean"]) / np.sqrt(stats["var"] + EPS) * params["scale"] + params["bias"]
    got = np.asarray(stable.BatchNorm(use_running_average=True).apply(loaded, x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # float32 outputs of size ~1
    ours = _trained_batch_stats(stable.BatchNorm(use_running_average=False), x)
    back = serialization.from_bytes(theirs, serialization.to_bytes(ours))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(theirs)
    np.testing.assert_array_equal(
        bits(np.asarray(back["batch_stats"]["var"])), bits(np.asarray(ours["batch_stats"]["var"]))
    )
