"""The main job's layer section: keras's and Flax's layers fail on offset data, ours do not."""

from tf_stable_moments import _report_layers


def test_layer_table_shows_keras_failing_and_ours_within_1e_5():
    rows = _report_layers.layer_rows()
    assert len(rows) == 7  # four keras layers, three Flax modules (flax: a test dependency)
    assert sum(name.startswith("flax.linen.") for name in rows) == 3
    for name, per in rows.items():
        for offset, (their_error, ours) in per.items():
            assert ours < 1e-5, (name, offset, ours)
            assert their_error > 1e-2, (name, offset, their_error)
    text = _report_layers.format_layer_rows(rows)
    assert all(name in text for name in rows)
