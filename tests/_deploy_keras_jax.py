"""Keras on the JAX backend: train a small model with this package's layers one epoch and
`model.export` it (jax2tf) (run by tests/test_deploy.py with KERAS_BACKEND=jax): usage
`_deploy_keras_jax.py INPUT ARTIFACT LIVE` writes the artifact and the live model's
inference outputs on INPUT (.npy) to LIVE (.npy)."""

import sys

import keras
import numpy as np

import tf_stable_moments as tsm

source, artifact, live = sys.argv[1:4]
assert keras.backend.backend() == "jax"
x = np.load(source)
inputs = keras.Input((x.shape[1],))
h = keras.layers.Dense(x.shape[1])(inputs)
h = tsm.StableBatchNormalization()(h)
outputs = tsm.StableLayerNormalization()(h)
model = keras.Model(inputs, outputs)
model.compile("sgd", "mse")
model.fit(x, x, epochs=1, verbose=0)
model.export(artifact, verbose=False)
np.save(live, np.asarray(model(x, training=False)))
