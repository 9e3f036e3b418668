"""Issue #27: every layer's outputs are the same bits in every mode, framework and
kernel (docs/algorithm.md section 14).

tests/_layer_modes_check.py runs every Stable Keras layer (BN training, inference,
masked, compensated, without scale or center, renorm; LN, GN, Normalization and their
variants) on N(1e6, 1) and N(0, 1) float32 data, and mixed_float16 / mixed_bfloat16 (and the
core cases under the float64 policy),
in TF eager, tf.function and jit_compile (TensorFlow backend) and in eager calls and
`stateless_call` under jax.jit (JAX backend, with the Flax modules next to them), each
with the native kernel on and off.  Every output, and the moving statistics a training
call leaves, must have the bits of TF eager.  The control runs the plain formulas
(1 / sqrt, r * f + b) and must see differences: XLA's contraction, TensorFlow's graph
rewriting.  The formulas themselves are checked against exact rational arithmetic in
tests/test_affine.py.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# (label, Keras backend, native kernel, scope: tests/_layer_modes_check.py), the longest
# first (measured alone: 60, 47, 38, 28, 24, 21 and 11 s), so that two at a time end
# together.
RUNS = (
    ("jax_native_off", "jax", "0", "core"),
    ("tf_float64", "tensorflow", "1", "float64"),
    ("tf_native_off", "tensorflow", "0", "core"),
    ("jax_float64", "jax", "1", "float64"),
    ("jax", "jax", "1", "full"),
    ("tf", "tensorflow", "1", "full"),
    ("tf_plain", "tensorflow", "1", "plain"),
)
# Cases (layer, data, dtype) each run must hold at least.
MINIMUM_CASES = {"tf": 60, "jax": 60, "tf_float64": 12, "jax_float64": 12}


def _start(directory, label, backend, native, scope):
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_STABLE_MOMENTS_NATIVE": native,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        **({"JAX_ENABLE_X64": "1"} if scope == "float64" else {}),
    }
    args = [sys.executable, str(REPO / "tests" / "_layer_modes_check.py")]
    args += [str(directory / f"{label}.npz"), scope]
    return subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _run_all(directory):
    """The script once per run, two processes at a time (the next starts when one ends);
    {label: {entry: array}}."""
    pending, running, out = list(RUNS), {}, {}
    deadline = time.monotonic() + 1800
    try:
        while pending or running:
            while pending and len(running) < 2:
                label, *rest = pending.pop(0)
                proc = _start(directory, label, *rest)
                # A thread drains its output, so that a full pipe never blocks the script.
                log = []
                reader = threading.Thread(target=lambda p=proc, a=log: a.append(p.stdout.read()))
                reader.start()
                running[label] = (proc, reader, log)
            assert time.monotonic() < deadline, f"still running: {sorted(running)}"
            for label, (proc, reader, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                reader.join()
                del running[label]
                assert proc.returncode == 0, f"{label} failed:\n{''.join(log)[-4000:]}"
                out[label] = dict(np.load(directory / f"{label}.npz"))
            time.sleep(0.2)
    finally:
        for proc, reader, _ in running.values():  # a failure stops the others
            proc.kill()
            reader.join()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """`_run_all`, once per test session: under pytest-xdist the first worker to get here
    runs it in a directory shared by the workers (the documented recipe, with an
    exclusive file creation as the lock); the others wait for its marker."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    directory = shared / "layer_modes"
    directory.mkdir(exist_ok=True)
    done, failed = directory / "done", directory / "failed"
    try:
        os.close(os.open(directory / "lock", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        deadline = time.monotonic() + 1800
        while not (done.exists() or failed.exists()) and time.monotonic() < deadline:
            time.sleep(1)
        assert done.exists(), "the worker running tests/_layer_modes_check.py failed"
        return {label: dict(np.load(directory / f"{label}.npz")) for label, *_ in RUNS}
    try:
        out = _run_all(directory)
    except BaseException:
        failed.touch()
        raise
    done.touch()
    return out


def _entries(result):
    """{(case, mode): array} of one run's results."""
    return {tuple(k.split("|")): v for k, v in result.items() if "|" in k}


def _differing(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return int(np.count_nonzero(a.view(unsigned) != b.view(unsigned)))


def _reference(results, case):
    """TF eager with the native kernel: what every other mode must reproduce."""
    run = "tf_float64" if "_float64" in case else "tf"
    return _entries(results[run])[(case, "tf_eager")]


@pytest.mark.parametrize("label", [r[0] for r in RUNS if r[3] != "plain"])
def test_every_mode_gives_the_bits_of_tf_eager(results, label):
    """Outputs of every case and mode, and the moving statistics they leave (compared
    within the backend: Normalization's count is int64 on TensorFlow, int32 on JAX)."""
    entries = _entries(results[label])
    eager = "tf_eager" if label.startswith("tf") else "jax_eager"
    cases = {case for case, _ in entries}
    assert len(cases) >= MINIMUM_CASES.get(label, 20)  # layers, data, dtypes
    differing = {}
    for (case, mode), value in sorted(entries.items()):
        reference = entries[(case, eager)] if case.endswith("_state") else None
        if reference is None:
            reference = _reference(results, case)
        n = _differing(value, reference)
        if n:
            differing[f"{case} {mode}"] = f"{n} of {value.size}"
    assert not differing, differing


@pytest.mark.parametrize("runs, minimum", [(("tf", "jax"), 20), (("tf_float64", "jax_float64"), 4)])
def test_states_agree_between_backends(results, runs, minimum):
    """Moving statistics after a training call: TF and JAX have the same bits (the
    layers' float32 or float64 weights; Normalization's int64 / int32 count excepted)."""
    tf_entries, jax_entries = (_entries(results[run]) for run in runs)
    compared = 0
    for (case, mode), value in tf_entries.items():
        if mode != "tf_eager" or not case.endswith("_state") or case.startswith("norm"):
            continue
        assert _differing(jax_entries[(case, "jax_eager")], value) == 0, case
        compared += 1
    assert compared >= minimum


def test_flax_modules_give_the_bits_of_the_keras_layers(results):
    """jax_kernel.flax linen and nnx BatchNorm (training, inference, the batch_stats it
    leaves), LayerNorm and GroupNorm, eager and jit: the Keras layers' bits."""
    entries = _entries(results["jax"])
    flax = [(c, m) for c, m in entries if m.startswith("flax_")]
    assert len(flax) >= 30
    for case, mode in flax:
        reference = _reference(results, case)
        assert _differing(entries[(case, mode)], reference) == 0, (case, mode)


def test_the_control_sees_compiler_differences(results):
    """The plain formulas (1 / sqrt(v), r * f + b, ...) run through the same script
    differ from TF eager under tf.function (graph rewriting: an approximate Reciprocal
    for 1 / s) or jit_compile (contraction into fused multiply-adds) in every control
    case: the comparison above can fail."""
    entries = _entries(results["tf_plain"])
    cases = {case for case, _ in entries if not case.endswith("_state")}
    assert len(cases) >= 10
    for case in cases:
        eager = entries[(case, "tf_eager")]
        graph, xla = (
            _differing(entries[(case, m)], eager) for m in ("tf_function", "tf_jit_compile")
        )
        assert graph + xla > 0, case
    assert all(
        _differing(entries[(c, "tf_jit_compile")], entries[(c, "tf_eager")])
        for c in cases
        if not c.startswith("norm")
    )
