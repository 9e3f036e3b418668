"""in_xla_context: True while building a graph that XLA compiles as a whole."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_stable_moments._xla_context import in_xla_context


def _traced(fn, *args):
    """The in_xla_context() values seen while `fn` traces (and runs) on `args`."""
    seen = []

    def record():
        seen.append(in_xla_context())

    fn(record, *args)
    assert seen, "the probe did not run"
    return seen


def _eager(record, x):
    record()
    return x


def _plain(record, x):
    @tf.function
    def f(x):
        record()
        return x + 1

    return f(x)


def _jit(record, x):
    @tf.function(jit_compile=True)
    def f(x):
        record()
        return x + 1

    return f(x)


def _nested(inner_jit, outer_jit):
    """A tf.function of a tf.function: inner_jit None (plain), True or False (an explicit
    jit_compile=False, compiled with a jit outer function all the same)."""

    def case(record, x):
        kwargs = {} if inner_jit is None else {"jit_compile": inner_jit}

        @tf.function(**kwargs)
        def inner(x):
            record()
            return x * 2

        @tf.function(jit_compile=outer_jit)
        def outer(x):
            return inner(x) + 1

        return outer(x)

    return case


_plain_inside_jit = _nested(None, True)
_jit_inside_plain = _nested(True, None)
_jit_false_inside_jit = _nested(False, True)


def _cond_inside_jit(record, x):
    @tf.function(jit_compile=True)
    def f(x):
        def branch():
            record()
            return x

        return tf.cond(x > 0, branch, lambda: -x)

    return f(x)


def _while_inside_jit(record, x):
    @tf.function(jit_compile=True)
    def f(x):
        def body(i, x):
            record()
            return i + 1, x * 2

        return tf.while_loop(lambda i, x: i < 3, body, [0, x])[1]

    return f(x)


def _init_scope_inside_jit(record, x):
    @tf.function(jit_compile=True)
    def f(x):
        with tf.init_scope():  # eager again: not compiled
            record()
        return x + 1

    return f(x)


def _tf1_graph(record, x):
    with tf.Graph().as_default():
        record()
    return x


CASES = [
    (_eager, False),
    (_plain, False),
    (_tf1_graph, False),
    (_init_scope_inside_jit, False),
    (_jit, True),
    (_plain_inside_jit, True),
    (_jit_inside_plain, True),
    (_jit_false_inside_jit, True),
    (_cond_inside_jit, True),
    (_while_inside_jit, True),
]


@pytest.mark.parametrize("fn,expected", CASES, ids=[f.__name__.strip("_") for f, _ in CASES])
def test_in_xla_context(fn, expected):
    assert _traced(fn, tf.constant(1.0)) == [expected]


def test_after_leaving_a_jit_function_eager_and_plain_graphs_are_not_xla():
    _traced(_jit, tf.constant(1.0))
    assert _traced(_eager, tf.constant(1.0)) == [False]
    assert _traced(_plain, tf.constant(1.0)) == [False]


class _Probe(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = set()

    def call(self, x, training=None):
        if not tf.executing_eagerly():
            self.seen.add((bool(training), in_xla_context()))
        return x


@pytest.mark.parametrize("jit_compile", [True, False], ids=["jit", "no_jit"])
def test_keras_fit_and_predict_steps(jit_compile):
    probe = _Probe()
    model = keras.Sequential(
        [keras.Input([4]), keras.layers.Dense(3), probe, keras.layers.Dense(1)]
    )
    model.compile("sgd", "mse", jit_compile=jit_compile)
    assert model.jit_compile is jit_compile
    x = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32)
    y = np.zeros((10, 1), np.float32)
    probe.seen.clear()  # the symbolic build call is no compiled graph: not asserted
    model.fit(x, y, batch_size=4, epochs=1, validation_data=(x, y), verbose=0)
    # Train steps (training=True) and validation steps (training=False).
    assert probe.seen == {(True, jit_compile), (False, jit_compile)}
    probe.seen.clear()
    model.predict(x, verbose=0)
    assert probe.seen == {(False, jit_compile)}
