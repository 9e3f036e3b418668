"""The main job, `python -m tf_stable_moments`, on a user's .npy file."""

import numpy as np
import pytest

from tf_stable_moments import _report


def test_input_file_report(tmp_path, capsys):
    x = np.random.default_rng(0).normal(1e6, 1.0, (300, 3)).astype(np.float32)
    path = tmp_path / "data.npy"
    np.save(path, x)
    assert _report.main(["--input", str(path), "--axes", "0"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("data.npy"))
    cells = row.split()
    ours = [float(c) for c in cells[4:9]]  # eager, tf.function, XLA, XLA kernel, JAX
    theirs = [float(c) for c in cells[9:12]]
    assert max(ours) <= 0.5 and min(theirs) > 0.5 and cells[-1] == "yes"


@pytest.mark.parametrize(
    "data,axes,message",
    [
        (np.arange(6).reshape(2, 3), ["--axes", "0"], "must hold float32 or float64 data"),
        (np.zeros((2, 3), np.float32), [], "--axes is required with --input"),
    ],
    ids=["integer_data", "missing_axes"],
)
def test_input_errors_are_clear(tmp_path, capsys, data, axes, message):
    np.save(tmp_path / "data.npy", data)
    with pytest.raises(SystemExit):
        _report.main(["--input", str(tmp_path / "data.npy"), *axes])
    assert message in capsys.readouterr().err
