"""Flax's own normalization tests, run on jax_kernel.flax's classes beside Flax's.

The behaviours that Flax's tests check of BatchNorm, LayerNorm and GroupNorm (flax
tests/linen/linen_test.py NormalizationTest, tests/linen/linen_transforms_test.py
test_vmap_batchnorm, tests/nnx/nn/normalization_test.py TestLinenConsistency, the nnx
view and training-step tests), written anew: each scenario runs with Flax's class and with
ours, which must give the same variable collections, names, shapes and dtypes, the same
output dtypes and exception types, and outputs and running statistics close to Flax's on
N(0, 1)-like data; where Flax's test compares with a formula written out in numpy, ours
is compared with the same formula evaluated in float64.  The last section pins where ours
differs from Flax on purpose.

What is particular to ours (accuracy on offset data, the oracle's bits, gradients, pmap
and shard_map over several devices) is in tests/test_flax.py and not repeated here.
Every scenario is compiled once (jax.jit, nnx.jit): eagerly, each of the kernel's
operations would be compiled on its own.
"""

import flax.linen as flax_linen  # the [flax] extra, a test dependency
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_kernel.flax import linen as stable
from jax_kernel.flax import nnx as stable_nnx

EPS = 1e-5
KEY = jax.random.key(0)
LINEN = {
    "BatchNorm": (stable.BatchNorm, flax_linen.BatchNorm),
    "LayerNorm": (stable.LayerNorm, flax_linen.LayerNorm),
    "GroupNorm": (stable.GroupNorm, flax_linen.GroupNorm),
}
NNX = {
    "BatchNorm": (stable_nnx.BatchNorm, nnx.BatchNorm),
    "LayerNorm": (stable_nnx.LayerNorm, nnx.LayerNorm),
    "GroupNorm": (stable_nnx.GroupNorm, nnx.GroupNorm),
}

# Ours beside Flax's on N(0, 1)-like data.  Flax's variance is the float32
# E[x**2] - E[x]**2 (use_fast_variance), a few ulps of E[x**2] off; ours is the correctly
# rounded one; outputs of size ~1 then differ by ~1e-6.  1e-5 leaves room for that and
# still catches a wrong axis, mask, group or parameter (errors of order 0.1 to 1).
NEAR_FLAX = {"rtol": 1e-5, "atol": 1e-5}
# Ours beside the float64 formula of Flax's tests: correctly rounded statistics and a few
# float32 roundings after them, a few ulps of values of size ~1 to 4.
NEAR_F64 = {"rtol": 2e-6, "atol": 2e-6}


def near_flax(dtype):
    """NEAR_FLAX for float32 (and wider) outputs; for half precision, Flax's and our float32
    results (1e-6 apart) may round to neighbouring values: two ulps of the output dtype
    (float16: 2**-10 relative, bfloat16: 2**-7)."""
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}.get(np.dtype(dtype).name)
    return NEAR_FLAX if ulp is None else {"rtol": 2 * ulp, "atol": 2 * ulp}


def normal(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).normal(size=shape).astype(dtype)


def random_mask(shape, seed, keep=0):
    """A random boolean mask whose first `keep` entries along the last axis are set."""
    mask = np.random.default_rng(seed).integers(0, 2, shape).astype(bool)
    mask[..., :keep] = True
    return mask


def wide(a):
    """A numpy copy, half precision widened to float32 (for np.testing)."""
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.itemsize < 4 and not np.iscomplexobj(a) else a


def layout(tree):
    """{path: (shape, dtype)} of every leaf: what a checkpoint holds."""
    return {
        jax.tree_util.keystr(path): (np.shape(leaf), np.dtype(leaf.dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def assert_same_layout(ours, theirs):
    """The same collections and names (structure), shapes and dtypes."""
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
    assert layout(ours) == layout(theirs)


def assert_trees_close(ours, theirs, **tolerance):
    assert_same_layout(ours, theirs)
    for p, q in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(wide(p), wide(q), **tolerance)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def normalized64(x, axes, mask=None, eps=EPS):
    """The formula of Flax's tests in float64 (complex128 for complex x): (x - mean) /
    sqrt(var + eps) with mean and var = mean(|x - mean|**2) over `axes` of the elements
    selected by `mask`.  Returns (y, mean, var), the statistics keeping their axes."""
    x = np.asarray(x, np.complex128 if np.iscomplexobj(x) else np.float64)
    where = True if mask is None else np.broadcast_to(mask, x.shape)
    mean = x.mean(axes, where=where, keepdims=True)
    var = (np.abs(x - mean) ** 2).mean(axes, where=where, keepdims=True)
    return (x - mean) / np.sqrt(var + eps), mean, var


def grouped64(x, groups, axes, mask=None, eps=EPS):
    """GroupNorm's formula in float64: x's channels split into `groups` consecutive
    groups, statistics over `axes` of the grouped array (its last axis: within a group)."""
    shape = x.shape[:-1] + (groups, x.shape[-1] // groups)
    if mask is not None:
        mask = np.broadcast_to(mask, x.shape).reshape(shape)
    return normalized64(x.reshape(shape), axes, mask, eps)[0].reshape(x.shape)


def init_apply(module, x, mask=None, **call):
    """Flax's scenario, compiled once: variables = module.init(x), then (y, updated) =
    module.apply(variables, x) with batch_stats mutable.  Numpy (variables, y, updated)."""

    def scenario(x, mask):
        # init without the mask: the variables do not depend on it, and a masked
        # kernel takes seconds to compile
        variables = module.init(KEY, x, **call)
        kwargs = dict(call) if mask is None else dict(call, mask=mask)
        y, updated = module.apply(variables, x, mutable=["batch_stats"], **kwargs)
        return variables, y, updated

    return jax.device_get(jax.jit(scenario)(x, mask))


def apply(module, variables, x, mask=None, **call):
    """(y, updated) of module.apply(variables, x) with batch_stats mutable, compiled."""

    def scenario(variables, x, mask):
        kwargs = dict(call) if mask is None else dict(call, mask=mask)
        return module.apply(variables, x, mutable=["batch_stats"], **kwargs)

    return jax.device_get(jax.jit(scenario)(variables, x, mask))


def perturbed(variables, seed):
    """The variables plus N(0, 0.5) noise: a trained checkpoint's (scale, bias and
    running statistics away from their initial values; var kept positive)."""
    rng = np.random.default_rng(seed)
    out = jax.tree_util.tree_map(
        lambda v: (np.asarray(v) + 0.5 * rng.normal(size=np.shape(v))).astype(v.dtype),
        variables,
    )
    if "batch_stats" in out:
        var = out["batch_stats"]["var"]
        out["batch_stats"]["var"] = np.abs(var) + np.asarray(0.5, var.dtype)
    return out


# ------------------------------------------------------------------ linen: BatchNorm


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_batch_norm_normalizes_the_batch_and_updates_the_running_averages(masked):
    """Flax's test_batch_norm: momentum 0.9; the output has mean 0 and variance 1 over
    the batch axes (of the selected rows), the running mean is 0.1 * the batch mean and
    the running variance 0.9 + 0.1 * the batch variance; masked-out entries are NaN and
    must not reach the statistics."""
    x = normal((4, 3, 2), seed=1)
    mask = None
    if masked:
        mask = random_mask((4, 3, 1), seed=2)
        x = np.where(mask, x, np.nan).astype(np.float32)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["BatchNorm"]):
        out[who] = init_apply(cls(momentum=0.9, use_running_average=False), x, mask)
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    assert_same_layout(updated, f_updated)
    assert y.shape == x.shape and y.dtype == f_y.dtype == np.float32

    want, mean, var = normalized64(x, (0, 1), mask)
    np.testing.assert_allclose(y, want, **NEAR_F64)
    selected = np.broadcast_to(True if mask is None else mask, x.shape)
    np.testing.assert_allclose(np.mean(y, (0, 1), where=selected), 0.0, atol=1e-6)
    np.testing.assert_allclose(
        np.var(y, (0, 1), where=selected), (var / (var + EPS)).ravel(), rtol=1e-6
    )
    np.testing.assert_allclose(updated["batch_stats"]["mean"], 0.1 * mean.ravel(), **NEAR_F64)
    np.testing.assert_allclose(updated["batch_stats"]["var"], 0.9 + 0.1 * var.ravel(), **NEAR_F64)

    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)
    assert_trees_close(updated, f_updated, **NEAR_FLAX)


def test_batch_norm_of_complex_inputs():
    """Flax's test_batch_norm_complex (its unmasked case; masks are the test above's):
    dtype complex64; the output complex64 with mean 0 and variance (mean |y - mean|**2)
    1; the running mean becomes complex64, the running variance stays float32, as
    Flax's."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(4, 3, 2)) + 1j * rng.normal(size=(4, 3, 2))).astype(np.complex64)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["BatchNorm"]):
        module = cls(momentum=0.9, use_running_average=False, dtype=jnp.complex64)
        out[who] = init_apply(module, x)
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    assert_same_layout(updated, f_updated)
    assert y.dtype == f_y.dtype == np.complex64
    assert updated["batch_stats"]["mean"].dtype == np.complex64
    assert updated["batch_stats"]["var"].dtype == np.float32

    want, mean, var = normalized64(x, (0, 1))
    np.testing.assert_allclose(y, want, **NEAR_F64)
    np.testing.assert_allclose(updated["batch_stats"]["mean"], 0.1 * mean.ravel(), **NEAR_F64)
    np.testing.assert_allclose(updated["batch_stats"]["var"], 0.9 + 0.1 * var.ravel(), **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)
    assert_trees_close(updated, f_updated, **NEAR_FLAX)


@pytest.mark.parametrize("given", ["constructor", "call"])
def test_batch_norm_running_averages_over_steps_then_evaluation(given):
    """Three training steps (momentum 0.8) on different batches, then evaluation with
    use_running_average=True, given to the constructor or at call time: the running
    averages follow momentum * average + (1 - momentum) * batch statistic, evaluation
    normalizes with them and leaves them unchanged."""
    momentum = 0.8
    batches = [normal((16, 3), seed=10 + s) * (1 + s) + s for s in range(3)]
    x_eval = normal((8, 3), seed=20) * 2 + 1
    results = {}
    for who, cls in zip(("ours", "flax"), LINEN["BatchNorm"]):
        if given == "constructor":
            train = cls(momentum=momentum, use_running_average=False)
            evaluate, train_call, eval_call = (
                cls(momentum=momentum, use_running_average=True),
                {},
                {},
            )
        else:
            train = evaluate = cls(momentum=momentum)
            train_call, eval_call = {"use_running_average": False}, {"use_running_average": True}

        def run(batches, x_eval, train=train, evaluate=evaluate, tc=train_call, ec=eval_call):
            variables = train.init(KEY, batches[0], **tc)
            variables = {
                **variables,
                "params": jax.tree_util.tree_map(lambda v: v + 0.5, variables["params"]),
            }
            history = []
            for x in batches:
                _, updated = train.apply(variables, x, mutable=["batch_stats"], **tc)
                variables = {**variables, **updated}
                history.append(updated["batch_stats"])
            y, unchanged = evaluate.apply(variables, x_eval, mutable=["batch_stats"], **ec)
            return variables, history, y, unchanged

        results[who] = jax.device_get(jax.jit(run)(batches, x_eval))
    (variables, history, y, unchanged), (_, f_history, f_y, _) = (
        results["ours"],
        results["flax"],
    )
    mean, var = np.zeros(3), np.ones(3)
    for x, stats in zip(batches, history):
        _, m, v = normalized64(x, (0,))
        mean = momentum * mean + (1 - momentum) * m.ravel()
        var = momentum * var + (1 - momentum) * v.ravel()
        np.testing.assert_allclose(stats["mean"], mean, **NEAR_F64)
        np.testing.assert_allclose(stats["var"], var, **NEAR_F64)
    assert_trees_close(history, f_history, **NEAR_FLAX)
    np.testing.assert_array_equal(
        unchanged["batch_stats"]["mean"], variables["batch_stats"]["mean"]
    )
    np.testing.assert_array_equal(unchanged["batch_stats"]["var"], variables["batch_stats"]["var"])
    stats = variables["batch_stats"]
    want = (x_eval.astype(np.float64) - stats["mean"]) / np.sqrt(
        stats["var"].astype(np.float64) + EPS
    )
    want = want * 1.5 + 0.5  # scale 1 + 0.5, bias 0 + 0.5
    np.testing.assert_allclose(y, want, **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


@pytest.mark.parametrize(
    "constructor, call, match",
    [
        (None, None, "must be passed to the constructor or at call time"),
        (False, True, "was passed to the constructor and at call time"),
    ],
    ids=["never", "twice"],
)
def test_batch_norm_use_running_average_once_and_only_once(constructor, call, match):
    x = jnp.ones((4, 3))
    for cls in LINEN["BatchNorm"]:
        with pytest.raises(ValueError, match=match):
            cls(use_running_average=constructor).init(KEY, x, use_running_average=call)


@pytest.mark.parametrize(
    "axis, shape, stats_axes",
    [(1, (4, 3, 5), (0, 2)), ((1, 2), (4, 3, 5), (0,))],
    ids=["axis=1", "axis=(1,2)"],
)
def test_batch_norm_feature_axes(axis, shape, stats_axes):
    """`axis` selects the features (scale, bias, running averages of their shape); the
    statistics are over all the other axes."""
    x = normal(shape, seed=5)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["BatchNorm"]):
        out[who] = init_apply(cls(axis=axis, momentum=0.5, use_running_average=False), x)
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    features = tuple(shape[a] for a in range(len(shape)) if a not in stats_axes)
    assert variables["params"]["scale"].shape == features
    want, mean, var = normalized64(x, stats_axes)
    np.testing.assert_allclose(y, want, **NEAR_F64)
    np.testing.assert_allclose(
        updated["batch_stats"]["mean"], 0.5 * mean.reshape(features), **NEAR_F64
    )
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)
    assert_trees_close(updated, f_updated, **NEAR_FLAX)


def test_batch_norm_with_axis_name_initializes_outside_the_named_axis():
    """Flax's test_batch_norm_multi_init: one BatchNorm with axis_name applied twice while
    initializing, with no named axis bound (the statistics are then local)."""

    class Twice(flax_linen.Module):
        cls: type

        @flax_linen.compact
        def __call__(self, x):
            norm = self.cls(name="norm", use_running_average=False, axis_name="batch")
            x = norm(x)
            return x, norm(x)

    x = jax.random.normal(jax.random.key(1), (2, 4))  # Flax's (2 rows: y2 = BN(y1) ~ y1)
    for cls in LINEN["BatchNorm"]:
        model = Twice(cls)
        (y1, y2), variables = jax.jit(lambda x, model=model: model.init_with_output(KEY, x))(x)
        np.testing.assert_allclose(y1, y2, rtol=0.005)
        assert set(variables) == {"params", "batch_stats"}
        assert set(variables["params"]) == {"norm"}


def test_batch_norm_axis_name_under_vmap():
    """Flax's test_vmap_batchnorm: BatchNorm(axis_name="batch") under nn.vmap over 5
    members normalizes with the statistics of all of them, as BatchNorm without axis_name
    on the 20 rows at once (Flax: atol 1e-5).  Ours: the same statistics and outputs bit
    for bit (the psum is of exact moments states; the output's roundings are fixed)."""
    x = normal((5, 4, 3), seed=7)
    results = {}
    for who, cls in zip(("ours", "flax"), LINEN["BatchNorm"]):
        single = cls(momentum=0.0, use_running_average=False)
        mapped = flax_linen.vmap(
            cls,
            in_axes=(0,),
            variable_axes={"params": None, "batch_stats": None},
            split_rngs={"params": False},
            axis_name="batch",
        )(momentum=0.0, use_running_average=False, axis_name="batch")

        def run(x, single=single, mapped=mapped):
            variables = single.init(KEY, x[0])
            variables = {
                **variables,
                "params": jax.tree_util.tree_map(lambda v: v + 0.25, variables["params"]),
            }
            flat = single.apply(variables, x.reshape(20, 3), mutable=["batch_stats"])
            return flat, mapped.apply(variables, x, mutable=["batch_stats"])

        results[who] = jax.device_get(jax.jit(run)(x))
    ((y, stats), (v_y, v_stats)), (_, (fv_y, fv_stats)) = results["ours"], results["flax"]
    for name in ("mean", "var"):
        np.testing.assert_array_equal(
            bits(v_stats["batch_stats"][name]), bits(stats["batch_stats"][name])
        )
    np.testing.assert_array_equal(bits(v_y.reshape(20, 3)), bits(y))
    np.testing.assert_allclose(v_y, fv_y, **NEAR_FLAX)
    assert_trees_close(v_stats, fv_stats, **NEAR_FLAX)


# ------------------------------------------------------------------ linen: LayerNorm


@pytest.mark.parametrize(
    "reduction_axes", [-1, 1, (1, 2), (0, 1, 2)], ids=["-1", "1", "(1,2)", "(0,1,2)"]
)
def test_layer_norm_reduction_axes(reduction_axes):
    """Flax's test_layer_norm: use_bias=use_scale=False, epsilon 1e-5; the output has
    x's shape and dtype and is the formula over reduction_axes; no variables."""
    x = normal((2, 3, 4), seed=8)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["LayerNorm"]):
        module = cls(use_bias=False, use_scale=False, epsilon=EPS, reduction_axes=reduction_axes)
        out[who] = init_apply(module, x)
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    assert jax.tree_util.tree_leaves(variables) == [] and updated == f_updated == {}
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_allclose(y, normalized64(x, reduction_axes)[0], **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


UNIFORM = {
    "bias_init": flax_linen.initializers.uniform(),
    "scale_init": flax_linen.initializers.uniform(),
}


@pytest.mark.parametrize(
    "kwargs, stats_axes",
    [
        ({"feature_axes": (1, 2)}, (3,)),
        ({"reduction_axes": (1, 2), "feature_axes": -1}, (1, 2)),
        ({"reduction_axes": -2, "feature_axes": (1, 3), **UNIFORM}, (2,)),
        ({"reduction_axes": (1, 2, 3), **UNIFORM}, (1, 2, 3)),
    ],
    ids=["features=(1,2)", "reduce=(1,2)", "reduce=-2,features=(1,3)", "reduce=(1,2,3)"],
)
def test_layer_norm_feature_axes(kwargs, stats_axes):
    """The LayerNorms of Flax's test_normalization_equivalence: scale and bias of the
    shape of feature_axes, the same initial values as Flax's (the same initializers and
    key), the output (x - mean) / sqrt(var + eps) * scale + bias."""
    x = normal((2, 3, 4, 5), seed=9)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["LayerNorm"]):
        out[who] = init_apply(cls(epsilon=EPS, **kwargs), x)
    (variables, y, _), (f_variables, f_y, _) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    for p, q in zip(jax.tree_util.tree_leaves(variables), jax.tree_util.tree_leaves(f_variables)):
        np.testing.assert_array_equal(p, q)
    features = [1] * x.ndim
    for a in np.atleast_1d(kwargs.get("feature_axes", -1)):
        features[a] = x.shape[a]
    scale = variables["params"]["scale"].reshape(features).astype(np.float64)
    bias = variables["params"]["bias"].reshape(features).astype(np.float64)
    np.testing.assert_allclose(y, normalized64(x, stats_axes)[0] * scale + bias, **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


@pytest.mark.parametrize(
    "layer_norm, group_norm",
    [
        ({"reduction_axes": (1, 2, 3)}, {"num_groups": 1}),
        ({"reduction_axes": (1, 2), "feature_axes": -1}, {"num_groups": None, "group_size": 1}),
    ],
    ids=["LayerNorm=GroupNorm(num_groups=1)", "InstanceNorm=GroupNorm(group_size=1)"],
)
def test_layer_norm_and_group_norm_that_coincide(layer_norm, group_norm):
    """Flax's test_normalization_equivalence between our own classes: a LayerNorm over
    all but the batch axis is GroupNorm with one group; one over the spatial axes
    (InstanceNorm) is GroupNorm with groups of one channel.  The same variables; Flax
    allows the outputs atol 1e-7, ours have the same bits (the correctly rounded
    statistics of the same elements, then the same fixed roundings)."""
    x = normal((2, 3, 4, 5), seed=11)
    ln_variables, ln_y, _ = init_apply(stable.LayerNorm(**layer_norm, **UNIFORM), x)
    gn_variables, gn_y, _ = init_apply(stable.GroupNorm(**group_norm, **UNIFORM), x)
    assert_same_layout(ln_variables, gn_variables)
    for p, q in zip(
        jax.tree_util.tree_leaves(ln_variables), jax.tree_util.tree_leaves(gn_variables)
    ):
        np.testing.assert_array_equal(p, q)
    np.testing.assert_array_equal(bits(ln_y), bits(gn_y))


@pytest.mark.parametrize("name", ["LayerNorm", "GroupNorm"])
def test_layer_and_group_norm_masks(name):
    """Flax's test_layer_norm_mask and test_group_norm_mask: masked-out entries are NaN;
    over the selected ones the output has mean 0 and variance 1 (per sample, per group)."""
    if name == "LayerNorm":
        shape, kwargs, groups = (3, 4, 5), {}, None
    else:
        shape, kwargs, groups = (13, 3, 5, 7 * 11), {"num_groups": 7}, 7
    x = normal(shape, seed=12)
    mask = random_mask(shape, seed=13, keep=2)  # at least 2 selected per row
    x = np.where(mask, x, np.nan).astype(np.float32)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN[name]):
        out[who] = init_apply(cls(use_bias=False, use_scale=False, epsilon=EPS, **kwargs), x, mask)
    (_, y, _), (_, f_y, _) = out["ours"], out["flax"]
    if groups is None:
        want = normalized64(x, (-1,), mask)[0]
        yy, mm, axes = y, mask, (-1,)
    else:
        want = grouped64(x, groups, (1, 2, 4), mask)
        yy = y.reshape(shape[:-1] + (groups, -1))
        mm, axes = mask.reshape(yy.shape), (1, 2, 4)
    np.testing.assert_allclose(y, want, **NEAR_F64)
    np.testing.assert_allclose(np.mean(yy, axes, where=mm, dtype=np.float64), 0, atol=1e-6)
    var = np.var(yy, axes, where=mm, dtype=np.float64)
    _, _, var_x = normalized64(x.reshape(yy.shape), axes, mm)
    np.testing.assert_allclose(var, (var_x / (var_x + EPS)).reshape(var.shape), rtol=1e-6)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


# ------------------------------------------------------------------ linen: GroupNorm


@pytest.mark.parametrize(
    "kwargs, stats_axes",
    [
        ({"num_groups": 2}, (1, 2, 3, 5)),
        ({"num_groups": None, "group_size": 16}, (1, 2, 3, 5)),
        ({"num_groups": 2, "reduction_axes": (0, 1, 3, 4)}, (0, 1, 3, 5)),
        ({"num_groups": 8, "reduction_axes": (-2, -1)}, (3, 5)),
    ],
    ids=["num_groups=2", "group_size=16", "unbatched(0,1,3,4)", "reduce=(-2,-1)"],
)
def test_group_norm(kwargs, stats_axes):
    """Flax's test_group_norm and test_group_norm_unbatched: (2, 5, 4, 4, 32), groups of
    consecutive channels, statistics over the reduction axes and the channels of each
    group; x's shape and dtype; with group_size as with the matching num_groups."""
    x = normal((2, 5, 4, 4, 32), seed=14)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["GroupNorm"]):
        out[who] = init_apply(cls(use_bias=False, use_scale=False, epsilon=EPS, **kwargs), x)
    (variables, y, _), (f_variables, f_y, _) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    assert y.shape == x.shape and y.dtype == x.dtype
    groups = kwargs["num_groups"] or 32 // kwargs["group_size"]
    np.testing.assert_allclose(y, grouped64(x, groups, stats_axes), **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


def test_group_norm_over_all_axes_of_a_stack():
    """Flax's test_group_norm_batched: reduction_axes=(-3, -2, -1) normalizes an input
    of rank 3 as a whole and, on a stack of 5 copies, each copy alike.  Ours: the same
    elements give the same correctly rounded statistics, and the output's roundings are
    fixed (module docstring): the copies' outputs have the bits of the single one's."""
    x = normal((3, 4, 32), seed=15)
    stack = np.stack([x] * 5)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN["GroupNorm"]):
        module = cls(
            num_groups=2, use_bias=False, use_scale=False, epsilon=EPS, reduction_axes=(-3, -2, -1)
        )
        out[who] = (init_apply(module, x)[1], apply(module, {}, stack)[0])
    (y, y_stack), (f_y, f_y_stack) = out["ours"], out["flax"]
    np.testing.assert_allclose(y, grouped64(x, 2, (0, 1, 3)), **NEAR_F64)
    np.testing.assert_allclose(y_stack, grouped64(stack, 2, (1, 2, 4)), **NEAR_F64)
    for copy in y_stack:
        np.testing.assert_array_equal(bits(copy), bits(y))
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)
    np.testing.assert_allclose(y_stack, f_y_stack, **NEAR_FLAX)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_groups": 3}, r"num_groups=3 does not divide the 32 channels"),
        ({"num_groups": 0}, r"num_groups=0 does not divide"),
        ({"num_groups": -2}, r"num_groups=-2 does not divide"),
        (
            {"num_groups": None, "group_size": 5},
            r"channels \(32\) are not a multiple of group_size=5",
        ),
        ({"num_groups": 2, "group_size": 16}, r"give exactly one of num_groups and group_size"),
        ({"num_groups": None}, r"give exactly one of num_groups and group_size"),
        (
            {"num_groups": 2, "reduction_axes": (0, 1, 2, 3)},
            r"must include the last \(feature\) axis",
        ),
    ],
    ids=[
        "3_groups_of_32",
        "0_groups",
        "-2_groups",
        "group_size=5",
        "both",
        "neither",
        "no_last_axis",
    ],
)
def test_group_norm_invalid_groups_raise_flaxs_exception(kwargs, match):
    """Flax's test_group_norm_raises and test_group_norm_raises_incorrect_reduction_axes
    (and the other checks of Flax's GroupNorm): ValueError, as Flax, with our message."""
    x = jnp.zeros((2, 5, 4, 4, 32))
    ours, theirs = LINEN["GroupNorm"]
    with pytest.raises(ValueError):
        theirs(**kwargs).init(KEY, x)
    with pytest.raises(ValueError, match=match):
        ours(**kwargs).init(KEY, x)


# ------------------------------------------------------------------ linen: all three


def reference64(name, x):
    """The float64 output of `_linen_module(name, ...)` on x [8, 4, 6] with epsilon EPS
    and initial parameters."""
    if name == "BatchNorm":
        return normalized64(x, (0, 1))[0]
    if name == "LayerNorm":
        return normalized64(x, (-1,))[0]
    return grouped64(x, 3, (1, 3))


def _linen_module(name, cls, **kwargs):
    if name == "BatchNorm":
        return cls(use_running_average=False, momentum=0.9, **kwargs)
    if name == "GroupNorm":
        return cls(num_groups=3, **kwargs)
    return cls(**kwargs)


@pytest.mark.parametrize(
    "use_bias, use_scale",
    [(True, False), (False, False)],
    ids=["no_scale", "neither"],
)
@pytest.mark.parametrize("name", LINEN)
def test_use_bias_and_use_scale(name, use_bias, use_scale):
    """Without use_bias (use_scale) there is no bias (scale) parameter; the output is
    Flax's (with the other parameter away from its initial value)."""
    x = normal((8, 4, 6), seed=16) * 2 + 1
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN[name]):
        module = _linen_module(name, cls, use_bias=use_bias, use_scale=use_scale)
        variables = jax.device_get(jax.jit(module.init)(KEY, x))
        out[who] = (variables, *apply(module, perturbed(variables, 17), x))
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    params = variables.get("params", {})
    assert ("bias" in params, "scale" in params) == (use_bias, use_scale)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)
    assert_trees_close(updated, f_updated, **NEAR_FLAX)


DTYPES = [
    # (input dtype, dtype, param_dtype)
    (jnp.float16, None, jnp.float32),
    (jnp.bfloat16, None, jnp.float32),
    (jnp.float32, jnp.float16, jnp.float32),
    (jnp.float32, None, jnp.bfloat16),
    (jnp.float16, jnp.float32, jnp.float16),
]
DTYPE_IDS = ["x16", "xbf16", "dtype=16", "pbf16", "x16,dtype=32,p16"]


@pytest.mark.parametrize("x_dtype, dtype, param_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", LINEN)
def test_dtype_and_param_dtype(name, x_dtype, dtype, param_dtype):
    """Parameters in param_dtype, running averages in float32 (as Flax), the output in
    Flax's dtype (dtype, else that of x and the parameters) and, at that precision, close
    to Flax's and to the float64 formula."""
    x = jnp.asarray(normal((8, 4, 6), seed=18), x_dtype)
    out = {}
    for who, cls in zip(("ours", "flax"), LINEN[name]):
        module = _linen_module(name, cls, dtype=dtype, param_dtype=param_dtype, epsilon=EPS)
        out[who] = init_apply(module, x)
    (variables, y, updated), (f_variables, f_y, f_updated) = out["ours"], out["flax"]
    assert_same_layout(variables, f_variables)
    assert_same_layout(updated, f_updated)
    assert y.dtype == f_y.dtype
    np.testing.assert_allclose(wide(y), wide(f_y), **near_flax(y.dtype))
    np.testing.assert_allclose(wide(y), reference64(name, x), **near_flax(y.dtype))
    assert_trees_close(updated, f_updated, **NEAR_FLAX)


# ------------------------------------------------------------------ nnx


def _nnx_module(name, cls, **kwargs):
    """(module, input shape) of Flax's TestLinenConsistency: 5 features (GroupNorm: 6, in
    3 groups); the linen twin is `_linen_module(name, ...)`."""
    if name == "BatchNorm":
        module = cls(5, use_running_average=False, momentum=0.9, rngs=nnx.Rngs(42), **kwargs)
        return module, (10, 5)
    if name == "GroupNorm":
        return cls(6, num_groups=3, rngs=nnx.Rngs(42), **kwargs), (10, 6)
    return cls(5, rngs=nnx.Rngs(42), **kwargs), (10, 5)


def nnx_call(module, x, mask=None, **call):
    """module(x, ...) compiled (nnx.jit: the module's state updates come back)."""
    return jax.device_get(nnx.jit(lambda m, x, mask: m(x, mask=mask, **call))(module, x, mask))


def linen_promotion(args, **_):
    """nnx's promote_dtype replaced by Linen's behaviour (x not cast to dtype before the
    statistics), as in Flax's TestLinenConsistency."""
    return args


NNX_LINEN_CASES = [
    pytest.param(name, dtype, param_dtype, False, id=f"{name}-dtype={d}-p{p}")
    for name in NNX
    for dtype, d in ((jnp.float32, 32), (jnp.float16, 16))
    for param_dtype, p in ((jnp.float32, 32), (jnp.float16, 16))
] + [
    # Masked: BatchNorm and GroupNorm only (a masked kernel takes seconds to compile);
    # LayerNorm's mask is test_layer_and_group_norm_masks's, nnx passes it as linen does.
    pytest.param(name, jnp.float32, jnp.float32, True, id=f"{name}-masked")
    for name in ("BatchNorm", "GroupNorm")
]


@pytest.mark.parametrize("name, dtype, param_dtype, masked", NNX_LINEN_CASES)
def test_nnx_matches_linen(name, dtype, param_dtype, masked):
    """Flax's TestLinenConsistency: the nnx module (num_features, rngs) with Linen's
    promotion gives the linen module's output and batch statistics exactly, also with its
    every-other-feature mask (which leaves BatchNorm's features 1 and 3 with no element:
    NaN statistics, as Flax); and is close to Flax's nnx module."""
    ours, theirs = NNX[name]
    kwargs = {"dtype": dtype, "param_dtype": param_dtype, "promote_dtype": linen_promotion}
    module, shape = _nnx_module(name, ours, **kwargs)
    x = np.asarray(jax.random.normal(jax.random.key(0), shape))
    mask = np.arange(shape[-1]) % 2 == 0 if masked else None
    y = nnx_call(module, x, mask)

    twin = _linen_module(name, LINEN[name][0], dtype=dtype, param_dtype=param_dtype)
    variables = jax.device_get(jax.jit(twin.init)(KEY, x))
    params = {"scale": np.asarray(module.scale[...]), "bias": np.asarray(module.bias[...])}
    assert layout(params) == layout(variables["params"])
    l_y, updated = apply(twin, {**variables, "params": params}, x, mask)
    assert y.dtype == l_y.dtype
    np.testing.assert_array_equal(wide(y), wide(l_y))
    if name == "BatchNorm":
        for stat in ("mean", "var"):
            np.testing.assert_array_equal(getattr(module, stat)[...], updated["batch_stats"][stat])

    # Flax's two-pass variance as the reference: its inputs give GroupNorm groups of two
    # channels, on which Flax's default fast variance loses ~2e-5 (measured).
    flax_module, _ = _nnx_module(name, theirs, use_fast_variance=False, **kwargs)
    assert_same_layout(nnx.state(module), nnx.state(flax_module))
    f_y = nnx_call(flax_module, x, mask)
    assert y.dtype == f_y.dtype
    np.testing.assert_allclose(wide(y), wide(f_y), **near_flax(y.dtype))
    assert_trees_close(nnx.state(module), nnx.state(flax_module), **NEAR_FLAX)


@pytest.mark.parametrize(
    "name, args, kwargs, shape",
    [
        ("BatchNorm", (3,), {"use_bias": False, "axis": 1}, (4, 3, 5)),
        ("BatchNorm", (5,), {"use_scale": False, "param_dtype": jnp.bfloat16}, (8, 5)),
        ("LayerNorm", (4,), {"use_bias": False, "use_scale": False}, (2, 3, 4)),
        ("LayerNorm", (4,), {"reduction_axes": (1, 2), "dtype": jnp.float16}, (2, 3, 4)),
        ("GroupNorm", (6,), {"num_groups": None, "group_size": 2}, (3, 4, 6)),
        ("GroupNorm", (6,), {"num_groups": 2, "use_scale": False}, (3, 4, 6)),
    ],
    ids=[
        "BN_axis=1_no_bias",
        "BN_no_scale_pbf16",
        "LN_neither",
        "LN_reduce=(1,2)_dtype16",
        "GN_group_size=2",
        "GN_no_scale",
    ],
)
def test_nnx_constructor_arguments(name, args, kwargs, shape):
    """num_features, rngs and the other arguments: the state (Param, BatchStat) of Flax's
    module, None where use_bias/use_scale is off; uniform initializers draw the same
    values from the same rngs; the output is close to Flax's."""
    ours, theirs = NNX[name]
    inits = {"bias_init": nnx.initializers.uniform(), "scale_init": nnx.initializers.uniform()}
    if name == "BatchNorm":
        kwargs = {**kwargs, "use_running_average": False}
    mine = ours(*args, **kwargs, **inits, rngs=nnx.Rngs(params=3))
    flax_module = theirs(*args, **kwargs, **inits, rngs=nnx.Rngs(params=3))
    assert_same_layout(nnx.state(mine), nnx.state(flax_module))
    for p, q in zip(
        jax.tree_util.tree_leaves(nnx.state(mine)),
        jax.tree_util.tree_leaves(nnx.state(flax_module)),
    ):
        np.testing.assert_array_equal(p, q)
    assert (mine.bias is None, mine.scale is None) == (
        not kwargs.get("use_bias", True),
        not kwargs.get("use_scale", True),
    )
    for attribute in ("num_features", "num_groups", "group_size", "axis", "reduction_axes"):
        assert getattr(mine, attribute, None) == getattr(flax_module, attribute, None)
    x = normal(shape, seed=19) * 2 + 1
    y, f_y = nnx_call(mine, x), nnx_call(flax_module, x)
    assert y.dtype == f_y.dtype
    np.testing.assert_allclose(wide(y), wide(f_y), **near_flax(y.dtype))
    assert_trees_close(nnx.state(mine), nnx.state(flax_module), **NEAR_FLAX)


def test_nnx_batch_norm_training_steps_then_view_for_evaluation():
    """The nnx integration tests' pattern: training steps under nnx.jit update the
    BatchStat running averages (momentum 0.9); nnx.view(use_running_average=True) gives an
    evaluation view that normalizes with them and leaves them unchanged."""
    batches = [normal((16, 4), seed=30 + s) * (1 + s) + s for s in range(3)]
    x_eval = normal((8, 4), seed=40) + 1
    results = {}
    for who, cls in zip(("ours", "flax"), NNX["BatchNorm"]):
        model = cls(4, momentum=0.9, use_running_average=False, rngs=nnx.Rngs(0))
        step = nnx.jit(lambda m, x: m(x))
        history = []
        for x in batches:
            step(model, x)
            history.append((np.asarray(model.mean[...]), np.asarray(model.var[...])))
        evaluation = nnx.view(model, use_running_average=True)
        assert evaluation.use_running_average is True and model.use_running_average is False
        y = np.asarray(step(evaluation, x_eval))
        assert np.array_equal(model.mean[...], history[-1][0])
        results[who] = history, y
    (history, y), (f_history, f_y) = results["ours"], results["flax"]
    mean, var = np.zeros(4), np.ones(4)
    for x, (m, v) in zip(batches, history):
        _, bm, bv = normalized64(x, (0,))
        mean, var = 0.9 * mean + 0.1 * bm.ravel(), 0.9 * var + 0.1 * bv.ravel()
        np.testing.assert_allclose(m, mean, **NEAR_F64)
        np.testing.assert_allclose(v, var, **NEAR_F64)
    np.testing.assert_allclose(history, f_history, **NEAR_FLAX)
    m, v = (a.astype(np.float64) for a in history[-1])
    np.testing.assert_allclose(y, (x_eval - m) / np.sqrt(v + EPS), **NEAR_F64)
    np.testing.assert_allclose(y, f_y, **NEAR_FLAX)


def test_nnx_batch_norm_use_running_average_required():
    """Neither the constructor nor the call gives use_running_average: ValueError."""
    x = jnp.ones((4, 3))
    ours, theirs = NNX["BatchNorm"]
    with pytest.raises(ValueError, match="use_running_average"):
        theirs(3, use_running_average=None, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match=r"no use_running_average was given"):
        ours(3, use_running_average=None, rngs=nnx.Rngs(0))(x)


@pytest.mark.parametrize(
    "args, match",
    [
        ((32, 3), r"Number of groups \(3\) does not divide the number of channels \(32\)"),
        ((32, 0), r"Number of groups \(0\) does not divide"),
        ((32, None, 5), r"Number of features \(32\) is not multiple of the group size \(5\)"),
        ((32, 2, 16), r"Either `num_groups` or `group_size` should be specified"),
        ((32, None, None), r"Either `num_groups` or `group_size` should be specified"),
    ],
    ids=["3_groups_of_32", "0_groups", "group_size=5", "both", "neither"],
)
def test_nnx_group_norm_invalid_groups_raise_at_construction(args, match):
    """nnx.GroupNorm checks num_groups/group_size against num_features when constructed:
    ours inherits the constructor, so the same ValueError and message."""
    for cls in NNX["GroupNorm"]:
        with pytest.raises(ValueError, match=match):
            cls(*args, rngs=nnx.Rngs(0))


# ------------------------------------------------------------------ intended differences


def _offset_case(name):
    """(module kwargs, input, float64 reference) of Flax's use_fast_variance=False case:
    N(1e6, 1) data (LayerNorm's test adds 1e6), which Flax's fast variance cannot take."""
    x = normal((4, 3, 8), seed=21) + np.float32(1e6)
    if name == "BatchNorm":
        return {"use_running_average": False}, x, normalized64(x, (0, 1))[0]
    if name == "LayerNorm":
        return {}, x, normalized64(x, (-1,))[0]
    return {"num_groups": 2}, x, grouped64(x, 2, (1, 3))


@pytest.mark.parametrize(
    "name, api",
    [(name, "linen") for name in LINEN] + [("BatchNorm", "nnx")],
    ids=[f"{name}-linen" for name in LINEN] + ["BatchNorm-nnx"],
)
def test_difference_use_fast_variance_is_accepted_and_ignored(name, api):
    """Difference (by design): Flax's use_fast_variance=True (its default) computes
    E[x**2] - E[x]**2 in float32, which fails on N(1e6, 1) data (Flax's test_layer_norm
    switches it off there); ours has one result, the correctly rounded one, for both
    values: the same bits, accurate where Flax's fast variance is not."""
    kwargs, x, want = _offset_case(name)
    ys = {}
    for fast in (True, False):
        for who, cls in zip(("ours", "flax"), (LINEN if api == "linen" else NNX)[name]):
            if api == "linen":
                ys[who, fast] = init_apply(cls(epsilon=EPS, use_fast_variance=fast, **kwargs), x)[1]
            else:
                module = cls(8, epsilon=EPS, use_fast_variance=fast, rngs=nnx.Rngs(0), **kwargs)
                ys[who, fast] = nnx_call(module, x)
    np.testing.assert_array_equal(bits(ys["ours", True]), bits(ys["ours", False]))
    np.testing.assert_allclose(ys["ours", True], want, rtol=0, atol=1e-5)
    assert np.abs(ys["flax", True] - want).max() > 0.1  # Flax's default is off


@pytest.mark.parametrize("name", LINEN)
def test_difference_force_float32_reductions_false_is_treated_as_true(name):
    """Difference (documented, "not yet"): Flax's force_float32_reductions=False computes
    the statistics of float16 inputs in float16 and keeps BatchNorm's running averages
    in param_dtype; ours computes them in float32 as with True (the same bits) and keeps
    the running averages in float32 (Flax's: float16, so the variables' dtypes differ)."""
    x = jnp.asarray(normal((8, 4, 6), seed=22), jnp.float16)
    ours, theirs = LINEN[name]
    kwargs = {"param_dtype": jnp.float16, "epsilon": EPS}
    y = {}
    for force in (True, False):
        variables, y[force], _ = init_apply(
            _linen_module(name, ours, force_float32_reductions=force, **kwargs), x
        )
        assert y[force].dtype == np.float16
        if name == "BatchNorm":
            assert layout(variables["batch_stats"]) == {
                "['mean']": ((6,), np.dtype(np.float32)),
                "['var']": ((6,), np.dtype(np.float32)),
            }
    np.testing.assert_array_equal(y[True].view(np.uint16), y[False].view(np.uint16))
    np.testing.assert_allclose(wide(y[False]), reference64(name, x), **near_flax(np.float16))
    f_variables, f_y, _ = init_apply(
        _linen_module(name, theirs, force_float32_reductions=False, **kwargs), x
    )
    assert f_y.dtype == np.float16
    if name == "BatchNorm":
        assert f_variables["batch_stats"]["mean"].dtype == np.float16  # ours: float32


def test_difference_nnx_group_norm_requires_the_feature_axis_in_reduction_axes():
    """Difference: Flax's nnx.GroupNorm does not check its reduction_axes (it replaces the
    last one by the group axis, so (0, 1, 2, 3) reduces over axes 0-2 and the group);
    ours raises as flax.linen.GroupNorm does (test_group_norm_invalid_groups_...)."""
    x = normal((2, 5, 4, 4, 32), seed=23)
    ours, theirs = NNX["GroupNorm"]
    y = theirs(32, num_groups=2, reduction_axes=(0, 1, 2, 3), rngs=nnx.Rngs(0))(x)
    assert y.shape == x.shape
    module = ours(32, num_groups=2, reduction_axes=(0, 1, 2, 3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"must include the last \(feature\) axis"):
        module(x)
