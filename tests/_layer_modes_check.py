"""Every Stable Keras layer's outputs in every execution mode of one Keras backend.

Usage: KERAS_BACKEND=jax|tensorflow python tests/_layer_modes_check.py OUT.npz
[core|plain|float64]

TensorFlow: eager, tf.function and tf.function(jit_compile=True); JAX: eager calls and
`stateless_call` under jax.jit.  Each entry is "CASE|MODE".  tests/test_layer_modes.py
runs this once per backend (and with TF_STABLE_MOMENTS_NATIVE=0) and compares every
entry bit for bit with TF eager (docs section 14).  "core": the cases of CORE_CASES
only, with mixed_float16 as the one dtype policy (the runs with the native kernel off,
whose XLA kernel compiles in seconds per case: the output formulas are the same code).
"plain": the CORE_CASES in float32 with the layers' output formulas swapped for the
plain expressions (1 / sqrt, r * f + b): the control that shows the comparison can
fail on this machine.  "float64": the CORE_CASES under the float64 dtype policy (the
float64 formulas of docs section 14b; JAX with JAX_ENABLE_X64=1).
"""

import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402

import tf_stable_moments as tsm  # noqa: E402

BACKEND = keras.backend.backend()
SHAPE = (32, 4, 4, 32)
C = SHAPE[-1]
_rng = np.random.default_rng(0)
DATA = {
    "offset": _rng.normal(1e6, 1, SHAPE).astype(np.float32),
    "normal": _rng.normal(0, 1, SHAPE).astype(np.float32),
}
MASK = _rng.random(SHAPE[:-1]) < 0.7


def _plain_scale_shift(r, v, gamma=None, beta=None, shared=False):
    scale = 1.0 / keras.ops.sqrt(v)
    scale = scale if gamma is None else scale * gamma
    return r * scale if beta is None else r * scale + beta


def _plain_formulas():
    """The plain expressions in place of the certified ones (the negative control)."""
    from types import SimpleNamespace

    from tf_stable_moments import _formulas

    plain = SimpleNamespace(
        rsqrt=lambda v: 1.0 / keras.ops.sqrt(v),
        div=lambda a, s: a / s,
        recip=lambda s: 1.0 / s,
        times=lambda a, b: a * b,
        affine=lambda r, f, b=None: r * f if b is None else r * f + b,
        blend=lambda a, wa, b, wb: a * wa + b * wb,
        scale_shift=_plain_scale_shift,
    )
    _formulas.formulas = lambda backend: plain


def _weights(layer, kind):
    r = np.random.default_rng(1)
    if kind == "norm":
        return
    if layer.gamma is not None:
        layer.gamma.assign(r.normal(1, 0.3, layer.gamma.shape).astype(np.float32))
    if layer.beta is not None:
        layer.beta.assign(r.normal(0, 0.3, layer.beta.shape).astype(np.float32))
    if kind == "bn":
        layer.moving_mean.assign((1e6 + r.normal(0, 1, C)).astype(np.float32))
        layer.moving_variance.assign(r.uniform(0.5, 2, C).astype(np.float32))
        if layer.compensated_moving_stats:
            layer.moving_mean_correction.assign(r.normal(0, 0.01, C).astype(np.float32))


_BN, _LN = tsm.StableBatchNormalization, tsm.StableLayerNormalization
_GN, _NORM = tsm.StableGroupNormalization, tsm.StableNormalization
TRAIN, INFER = {"training": True}, {"training": False}
# (name, layer class, its arguments, call keyword arguments, uses a mask)
CASES = [
    ("bn_train", _BN, {}, TRAIN, False),
    ("bn_infer", _BN, {}, INFER, False),
    ("bn_train_mask", _BN, {}, TRAIN, True),
    ("bn_infer_compensated", _BN, {"compensated_moving_stats": True}, INFER, False),
    ("bn_train_compensated", _BN, {"compensated_moving_stats": True}, TRAIN, False),
    ("bn_train_noscale", _BN, {"scale": False}, TRAIN, False),
    ("bn_train_nocenter", _BN, {"center": False}, TRAIN, False),
    ("bn_train_renorm", _BN, {"renorm": True}, TRAIN, False),
    ("ln", _LN, {}, {}, False),
    ("ln_three_axes", _LN, {"axis": [1, 2, 3]}, {}, False),
    ("ln_nocenter", _LN, {"center": False}, {}, False),
    ("ln_noscale", _LN, {"scale": False}, {}, False),
    ("ln_rms", _LN, {"rms_scaling": True}, {}, False),
    ("gn", _GN, {"groups": 8}, {}, False),
    ("gn_instance", _GN, {"groups": -1}, {}, False),
    ("norm", _NORM, {"axis": -1}, {}, False),
    ("norm_invert", _NORM, {"axis": -1, "invert": True}, {}, False),
]


def _layer(make, kind, dtype_policy):
    layer = make() if dtype_policy is None else _with_policy(make, dtype_policy)
    layer.build(SHAPE)
    if kind == "norm":
        layer.adapt(DATA["offset"][:16] + np.arange(C, dtype=np.float32))
    _weights(layer, kind)
    return layer


def _with_policy(make, policy):
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return make()
    finally:
        keras.config.set_dtype_policy(old)


def _run(layer, x, kwargs, mask, out, key):
    """Each mode starts from the same weights (a training call updates the moving and
    renorm statistics, which renorm's output depends on)."""
    if mask is not None:
        kwargs = {**kwargs, "mask": mask}
    weights = layer.get_weights()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)

        def call(v):
            return layer(v, **kwargs)

        for mode, fn in (
            ("tf_eager", call),
            ("tf_function", tf.function(call)),
            ("tf_jit_compile", tf.function(call, jit_compile=True)),
        ):
            layer.set_weights(weights)
            out[key + "|" + mode] = keras.ops.convert_to_numpy(fn(xt))
            out[key + "_state|" + mode] = _state(layer.non_trainable_variables)
        return
    import jax

    out[key + "|jax_eager"] = np.asarray(layer(x, **kwargs))
    out[key + "_state|jax_eager"] = _state(layer.non_trainable_variables)
    layer.set_weights(weights)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    @jax.jit
    def step(t, n, v):
        return layer.stateless_call(t, n, v, **kwargs)

    y, state = step(trainable, non_trainable, x)
    out[key + "|jax_jit"] = np.asarray(y)
    out[key + "_state|jax_jit"] = _state(state)


def _state(variables):
    """The non-trainable weights after a call (moving, renorm statistics): their bytes."""
    values = [np.ascontiguousarray(keras.ops.convert_to_numpy(v)).view(np.uint8) for v in variables]
    return np.concatenate([v.ravel() for v in values] + [np.zeros(0, np.uint8)])


def _flax(out):
    """Flax's modules (jax_kernel.flax linen and nnx) with the Keras layers' settings and
    weights, applied eagerly and under jax.jit: entries "CASE|flax_linen_eager" etc.,
    compared with the Keras layers' bits (docs section 14: the same formulas)."""
    import jax
    from flax import nnx

    from jax_kernel.flax import linen
    from jax_kernel.flax import nnx as stable_nnx

    r = np.random.default_rng(1)  # the draws of `_weights`, in its order
    gamma = r.normal(1, 0.3, C).astype(np.float32)
    beta = r.normal(0, 0.3, C).astype(np.float32)
    moving_mean = (1e6 + r.normal(0, 1, C)).astype(np.float32)
    moving_var = r.uniform(0.5, 2, C).astype(np.float32)
    params = {"scale": gamma, "bias": beta}
    stats = {"mean": moving_mean, "var": moving_var}
    eps = 1e-3
    modules = {
        "bn_train": (linen.BatchNorm(False, momentum=0.99, epsilon=eps), stable_nnx.BatchNorm),
        "bn_infer": (linen.BatchNorm(True, momentum=0.99, epsilon=eps), stable_nnx.BatchNorm),
        "ln": (linen.LayerNorm(epsilon=eps), stable_nnx.LayerNorm),
        "gn": (linen.GroupNorm(num_groups=8, epsilon=eps), stable_nnx.GroupNorm),
    }
    for name, (module, nnx_cls) in modules.items():
        batch_norm = name.startswith("bn")
        variables = {"params": params, **({"batch_stats": stats} if batch_norm else {})}

        def apply(v, x, module=module, batch_norm=batch_norm):
            if batch_norm:
                return module.apply(v, x, mutable=["batch_stats"])
            return module.apply(v, x), {}

        for data_name, x in DATA.items():
            key = f"{name}_{data_name}"
            for mode, fn in (("eager", apply), ("jit", jax.jit(apply))):
                y, updated = fn(variables, x)
                out[f"{key}|flax_linen_{mode}"] = np.asarray(y)
                if name == "bn_train":
                    state = [updated["batch_stats"][k] for k in ("mean", "var")]
                    out[f"{key}_state|flax_linen_{mode}"] = _state(state)
            kwargs = {"num_features": C, "epsilon": eps, "rngs": nnx.Rngs(0)}
            if batch_norm:
                kwargs.update(momentum=0.99, use_running_average=name == "bn_infer")
            elif name == "gn":
                kwargs["num_groups"] = 8
            model = nnx_cls(**kwargs)
            model.scale[...], model.bias[...] = gamma, beta
            if batch_norm:
                model.mean[...], model.var[...] = moving_mean, moving_var
            graph, state = nnx.split(model)

            @jax.jit
            def jitted(state, x, graph=graph):
                m = nnx.merge(graph, state)
                return m(x), nnx.state(m)

            out[f"{key}|flax_nnx_jit"] = np.asarray(jitted(state, x)[0])
            out[f"{key}|flax_nnx_eager"] = np.asarray(model(x))


# Every layer once (BN in training, inference and masked).
CORE_CASES = ("bn_train", "bn_infer", "bn_train_mask", "ln", "gn", "norm")


def main():
    scope = sys.argv[2] if len(sys.argv) > 2 else "full"
    if scope == "plain":
        _plain_formulas()
    policies = {
        "full": (None, "mixed_float16", "mixed_bfloat16"),
        "core": (None, "mixed_float16"),
        "float64": ("float64",),
    }
    dtypes = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16", "float64": "float64"}
    out = {}
    for name, cls, arguments, kwargs, masked in CASES:
        if scope != "full" and name not in CORE_CASES:
            continue
        kind = name.split("_")[0]
        make = functools.partial(cls, **arguments)
        for data_name, x in DATA.items():
            for policy in policies.get(scope, (None,)):
                mixed = policy is not None and policy.startswith("mixed")
                if mixed and (data_name == "offset" or kind == "norm"):
                    continue  # 1e6 does not survive float16; Normalization keeps float32
                layer = _layer(make, kind, policy)
                xin = x if policy is None else x.astype(dtypes[policy])
                key = f"{name}_{data_name}" + ("" if policy is None else "_" + policy)
                _run(layer, xin, kwargs, MASK if masked else None, out, key)
    if BACKEND == "jax" and scope not in ("plain", "float64"):
        _flax(out)
    out = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in out.items()}
    np.savez(sys.argv[1], backend=BACKEND, **out)


if __name__ == "__main__":
    main()
