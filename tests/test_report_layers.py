"""The main job's layer section: keras's layers fail on offset data, ours do not."""

from tf_stable_moments import _report_layers


def test_layer_table_shows_keras_failing_and_ours_within_1e_5():
    rows = _report_layers.layer_rows()
    assert len(rows) == 4
    for name, per in rows.items():
        for offset, (keras_error, ours) in per.items():
            assert ours < 1e-5, (name, offset, ours)
            assert keras_error > 1e-2, (name, offset, keras_error)
    text = _report_layers.format_layer_rows(rows)
    assert all(name in text for name in rows)
