"""stabilize(model): a copy of a Keras model with its normalization layers on the exact kernel."""

import keras
from keras.src.models.functional import Functional

import tf_stable_moments

# keras class -> the name of its replacement in tf_stable_moments (looked up when called:
# a replacement that this version of the package does not have is skipped).
_REPLACEMENTS = (
    (keras.layers.BatchNormalization, "StableBatchNormalization"),
    (keras.layers.LayerNormalization, "StableLayerNormalization"),
    (keras.layers.GroupNormalization, "StableGroupNormalization"),
    (keras.layers.Normalization, "StableNormalization"),
)


def _replacements():
    found = {}
    for keras_class, name in _REPLACEMENTS:
        ours = getattr(tf_stable_moments, name, None)
        if ours is not None:
            found[keras_class] = ours
    return found


def _clonable(model):
    """Sequential and functional models are cloned layer by layer; subclassed ones are not."""
    return isinstance(model, (keras.Sequential, Functional))


def _copy_weights(old, new):
    """new gets old's weights; a replacement's extra weights (appended) keep their initial value."""
    src, dst = old.weights, new.weights
    if [v.name for v in dst[: len(src)]] != [v.name for v in src]:
        raise ValueError(
            f"cannot copy the weights of layer '{old.name}' ({type(old).__name__}: "
            f"{[v.name for v in src]}) into its replacement ({[v.name for v in dst]})"
        )
    for source, target in zip(src, dst):
        # A copy: on JAX, assign would share the buffer, which fit then donates (deletes).
        target.assign(keras.ops.convert_to_numpy(source))


def _normalization_paths(model, replacements, limit=6):
    """[(path, class name)] of the replaceable layers a subclassed model holds: attributes,
    lists, tuples and dicts of attributes, nested layers; as `self.a.b[0]['k']`."""
    found, seen = [], set()

    def walk(value, path, depth):
        if len(found) >= limit or depth > 6 or id(value) in seen:
            return
        seen.add(id(value))
        if type(value) in replacements:
            found.append((path, type(value).__name__))
        elif isinstance(value, keras.layers.Layer):
            for name, attr in vars(value).items():
                if not name.startswith("_"):
                    walk(attr, f"{path}.{name}", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}[{key!r}]", depth + 1)

    walk(model, "self", 0)
    return found


def stabilize(model, *, compensated_moving_stats=False):
    """A copy of `model` with every Keras normalization layer replaced by this package's.

    Every `keras.layers.BatchNormalization` becomes a `StableBatchNormalization` with
    the same configuration (also the dtype policy) and the same weights, in nested
    Sequential and functional models too; so do LayerNormalization,
    GroupNormalization and Normalization where this version of the package has a
    stable counterpart.  Subclasses of those keras classes are kept as they are.
    Other layers are cloned as `keras.models.clone_model` clones them, with their
    weights copied.  The original model is not changed.  The copy is not compiled:
    call `compile` on it before `fit`.

        model = tf_stable_moments.stabilize(keras.applications.ResNet50(weights=None))

    Args:
        model: a `keras.Sequential` or functional `keras.Model`.  (Subclassed
            models cannot be cloned layer by layer: construct them with
            StableBatchNormalization instead.)
        compensated_moving_stats: keyword only, default False: the option of the
            same name of every StableBatchNormalization made from a keras
            BatchNormalization (the correction weights start at 0).

    Returns:
        The new, uncompiled model.

    Raises:
        TypeError: `model` is not a keras.Model.
        ValueError: `model`, or a model nested in it that holds a normalization
            layer, is a subclassed model; compensated_moving_stats is not a bool.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model must be a keras.Model (Sequential or functional); received model={model!r}"
        )
    if not isinstance(compensated_moving_stats, bool):
        raise ValueError(
            "compensated_moving_stats must be a bool; "
            f"received: compensated_moving_stats={compensated_moving_stats!r}"
        )
    replacements = _replacements()
    pairs = []

    def check_clonable(m, where):
        if not _clonable(m):
            found = _normalization_paths(m, replacements)
            where_found = ", ".join(f"{path} ({kind})" for path, kind in found[:6]) or "none"
            kinds = {kind for _, kind in found}
            names = [name for cls, name in _REPLACEMENTS if cls.__name__ in kinds]
            raise ValueError(
                f"model must be a Sequential or functional keras.Model; {where} is a subclassed "
                f"model of class {type(m).__name__}: its layers cannot be replaced by cloning. "
                f"Its keras normalization layers: {where_found}.  In its __init__, construct "
                f"tf_stable_moments.{' / '.join(names) or 'StableBatchNormalization'} with the "
                "same arguments instead; to keep trained weights, build the new model and call "
                "new_layer.set_weights(old_layer.get_weights()) for each of them"
            )

    check_clonable(model, f"model={model.name!r}")

    def clone(layer):
        if isinstance(layer, keras.Model):  # reached only for models clone_model cannot recurse
            if any(type(sub) in replacements for sub in layer._flatten_layers()):
                check_clonable(layer, f"the nested model {layer.name!r}")
        new_class = replacements.get(type(layer), type(layer))
        config = layer.get_config()
        if type(layer) is keras.layers.BatchNormalization and compensated_moving_stats:
            config["compensated_moving_stats"] = True
        new = new_class.from_config(config)
        if isinstance(layer, keras.layers.Layer):  # operations (h + a) hold no weights
            pairs.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for old, new in pairs:
        _copy_weights(old, new)
    return new_model
