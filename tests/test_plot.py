"""The plots draw the isotropic reference beside DLR, and keep every point inside the panel."""

import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from richness import plot  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save (their axes are read instead of the files)."""
    saved = []

    def keep(fig, prefix):
        saved.append(fig)
        return [str(prefix) + ".png"]

    monkeypatch.setattr(plot, "_save", keep)
    return saved


def _line(ax, label):
    lines = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert len(lines) == 1, [ln.get_label() for ln in ax.get_lines()]
    return lines[0]


def _records():
    return [{"step": 10 * (i + 1), "dlr": 0.3 + 0.01 * i, "nc1": 1.0 / (i + 1),
             "dlr_isotropic": 0.8 - 0.001 * i} for i in range(6)]


def test_history_draws_the_records_isotropic_reference(figures, tmp_path):
    records = _records()
    plot.history(records, tmp_path / "h")
    line = _line(figures[-1].axes[0], "isotropic reference")
    np.testing.assert_array_equal(line.get_ydata(), [r["dlr_isotropic"] for r in records])
    np.testing.assert_array_equal(line.get_xdata(), [r["step"] for r in records])


def test_history_from_a_log_file_draws_the_reference(figures, tmp_path):
    records = _records()
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot.history(log, tmp_path / "h")
    line = _line(figures[-1].axes[0], "isotropic reference")
    np.testing.assert_array_equal(line.get_ydata(), [r["dlr_isotropic"] for r in records])


def test_history_without_the_reference_draws_none(figures, tmp_path):
    plot.history([{"step": 1, "dlr": 0.4}, {"step": 2, "dlr": 0.5}], tmp_path / "h")
    assert all(ln.get_label() != "isotropic reference" for ln in figures[-1].axes[0].get_lines())


def test_history_refuses_a_reference_that_is_not_a_number(tmp_path):
    with pytest.raises(ValueError, match="dlr_isotropic"):
        plot.history([{"step": 1, "dlr": 0.4, "dlr_isotropic": "high"}], tmp_path / "h")


def test_sweep_draws_references_and_keeps_points_inside(figures, tmp_path):
    a = [0.1, 1.0, 10.0]
    acc = [0.987, 0.993, 0.983]
    iso = [0.80, 0.81, 0.82]
    plot.sweep(a, {"DLR": [0.2, 0.4, 0.5], "test accuracy": acc}, tmp_path / "s", xlabel="alpha",
               references={"DLR": iso})
    dlr_ax, acc_ax = figures[-1].axes[:2]
    np.testing.assert_array_equal(_line(dlr_ax, "isotropic reference").get_ydata(), iso)
    # the reference is inside its panel too, and no point sits on an edge
    assert dlr_ax.get_ylim()[1] > max(iso)
    lo, hi = acc_ax.get_ylim()
    assert lo == 0.0 and hi > max(acc) + 0.01


def test_sweep_refuses_references_of_unknown_series(tmp_path):
    with pytest.raises(ValueError, match="not plotted"):
        plot.sweep([1, 2], {"DLR": [0.1, 0.2]}, tmp_path / "s", xlabel="a", references={"NC1": [1, 2]})
