"""The package as users run it: the main job's stderr, the one-call swap, real models.

Subprocesses (the main job, the JAX backend) are started by module fixtures as
soon as a test that needs them is selected, so they run while the tests in this
process do.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class _Background:
    """A subprocess writing to files (a full pipe would block it while other tests run)."""

    def __init__(self, args, env, cwd=ROOT):
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(args, stdout=self.out, stderr=self.err, env=env, cwd=cwd)

    def result(self, timeout=300):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
        return self.proc.returncode, *texts

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


def _selected(request, prefix):
    return any(item.name.startswith(prefix) for item in request.session.items)


# ----------------------------------------------------------- the main job prints no warnings

# Lines TensorFlow's C++ runtime prints at start-up (not this package's code).
_RUNTIME_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} )")


@pytest.fixture(scope="module")
def main_job(request, tmp_path_factory):
    """`python -m tf_stable_moments` on three files of one shape, in a subprocess."""
    if not _selected(request, "test_main_job"):
        yield None
        return
    folder = tmp_path_factory.mktemp("main_job")
    rng = np.random.default_rng(0)
    files = []
    for name in "abc":
        files.append(str(folder / f"{name}.npy"))
        np.save(files[-1], rng.normal(1e6, 1.0, (200, 8)).astype(np.float32))
    args = [sys.executable, "-m", "tf_stable_moments", "--input", *files, "--axes", "0"]
    job = _Background(args, _env())
    yield job
    job.close()


def test_main_job_prints_no_warnings(main_job):
    """Before the fix every dataset traced fresh tf.functions: 'triggered tf.function retracing'."""
    rc, out, err = main_job.result()
    assert rc == 0, out[-2000:] + err[-4000:]
    rows = [line for line in out.splitlines() if line.startswith(("a.npy", "b.npy", "c.npy"))]
    assert len(rows) == 3 and all(row.endswith("yes") for row in rows), out
    own = [line for line in err.splitlines() if line.strip() and not _RUNTIME_LINE.match(line)]
    assert not [line for line in own if re.search("warn|retracing", line, re.I)], err[-4000:]
