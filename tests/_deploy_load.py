"""Load an exported artifact and serve it in a process where this package cannot be
imported (run by tests/test_deploy.py): usage `_deploy_load.py KIND ARTIFACT INPUT OUTPUT`.

KIND: "savedmodel" (tf.saved_model.load, the "serve" or "serving_default" endpoint, or
the `f` function of a saved tf.Module), "jax" (jax.export.deserialize, then call) or
"tflite" (a TensorFlow Lite flatbuffer run by tf.lite.Interpreter, its input resized to
the input's shape).
Writes the outputs to OUTPUT (.npz, arrays out_0, out_1, ...).
"""

import os
import sys

sys.modules["tf_stable_moments"] = None  # any import of the package fails
sys.modules["jax_kernel"] = None
sys.modules["moments_core"] = None
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

kind, artifact, source, target = sys.argv[1:5]
x = np.load(source)
if kind == "savedmodel":
    import tensorflow as tf

    loaded = tf.saved_model.load(artifact)
    if hasattr(loaded, "f"):
        out = loaded.f(tf.constant(x))
    else:
        out = loaded.serve(tf.constant(x))
    outs = out if isinstance(out, (list, tuple)) else [out]
    outs = [o.numpy() for o in outs]
elif kind == "tflite":
    import warnings

    import tensorflow as tf

    warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
    interpreter = tf.lite.Interpreter(model_path=artifact)
    index = interpreter.get_input_details()[0]["index"]
    interpreter.resize_tensor_input(index, x.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(index, x)
    interpreter.invoke()
    outs = [interpreter.get_tensor(d["index"]) for d in interpreter.get_output_details()]
else:
    import jax
    from jax import export

    with open(artifact, "rb") as f:
        exported = export.deserialize(bytearray(f.read()))
    outs = [np.asarray(o) for o in jax.tree_util.tree_leaves(exported.call(x))]
np.savez(target, **{f"out_{i}": o for i, o in enumerate(outs)})
