"""richness._checks, the one home of scalar argument checks: bools refused,
numpy integers accepted wherever Python ints are, bounds, None, messages that
name the argument; and the public arguments it checks, given numpy integers,
giving the same results as the Python ints."""

import json
import warnings

import numpy as np
import pytest

from richness import _checks
from richness._checks import check_bool_or_none, check_int, is_int


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int64(5), np.int8(-1), np.uint64(2**63), np.int32(0)])
def test_is_int_accepts_python_and_numpy_integers(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False), 1.0, np.float64(2.0), "3", None,
                                   np.array(3), np.array([3]), 1 + 0j])
def test_is_int_refuses_bools_floats_strings_and_arrays(value):
    assert not is_int(value)


def test_check_int_returns_a_python_int():
    for value in (7, np.int64(7), np.uint16(7)):
        out = check_int(value, "k", low=1)
        assert out == 7 and type(out) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, "2", None])
def test_check_int_refuses_non_integers_naming_argument_and_value(value):
    with pytest.raises(ValueError) as e:
        check_int(value, "every", low=1)
    assert str(e.value) == f"every must be a positive integer, got {value!r}"


def test_check_int_bounds_are_inclusive():
    assert check_int(2, "g", low=2, high=4) == 2 and check_int(np.int64(4), "g", low=2, high=4) == 4
    for bad in (1, 5, np.int64(5)):
        with pytest.raises(ValueError, match=r"^g must be an integer in \[2, 4\], got "):
            check_int(bad, "g", low=2, high=4)
    with pytest.raises(ValueError, match=r"^g must be an integer <= 4, got 9$"):
        check_int(9, "g", high=4)
    with pytest.raises(ValueError, match=r"^g must be an integer >= 3, got 2$"):
        check_int(2, "g", low=3)
    with pytest.raises(ValueError, match=r"^g must be a non-negative integer, got -1$"):
        check_int(-1, "g", low=0)


def test_check_int_none():
    assert check_int(None, "lag", low=1, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^lag must be a positive integer, got None$"):
        check_int(None, "lag", low=1)
    with pytest.raises(ValueError, match=r"^lag must be a positive integer or None, got 0$"):
        check_int(0, "lag", low=1, allow_none=True)


def test_check_int_what_and_note_word_the_message():
    with pytest.raises(ValueError) as e:
        check_int(9, "groups", low=2, high=4, allow_none=True, note="each group holds a whole state")
    assert str(e.value) == "groups must be an integer in [2, 4] or None, got 9 (each group holds a whole state)"
    with pytest.raises(ValueError) as e:
        check_int(4, "'next'", high=3, low=0, what="a group index in [0, 4)")
    assert str(e.value) == "'next' must be a group index in [0, 4), got 4"


def test_check_bool_or_none():
    for value in (True, False, None):
        assert check_bool_or_none(value, "distributed") is value
    for value in (1, np.bool_(True), "yes"):
        with pytest.raises(TypeError, match=r"^distributed must be True, False or None, got "):
            check_bool_or_none(value, "distributed")


def test_module_needs_neither_torch_nor_the_core():
    import subprocess
    import sys
    code = ("import sys; import richness._checks; "
            "assert 'torch' not in sys.modules and 'richness._core' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "numpy integer" in (_checks.__doc__ or "")


# -- the public arguments, given numpy integers --------------------------------------------------------------


def _monitor_history(route, **kw):
    """A Monitor's records over 12 steps of a tiny training run (without their timings), and the Monitor."""
    torch = pytest.importorskip("torch")
    import richness
    from tiny_models import make

    model, X, y = make(n=12 * 24, seed=3, dtype=torch.float32)
    model.drop.p = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with richness.Monitor(model, route(richness), **kw) as mon:
            for i in range(12):
                loss = torch.nn.functional.cross_entropy(model(X[i * 24:(i + 1) * 24]), y[i * 24:(i + 1) * 24])
                opt.zero_grad()
                loss.backward()
                opt.step()
                mon.step(labels=y[i * 24:(i + 1) * 24])
    return [{k: v for k, v in r.items() if k != "time"} for r in mon.history], mon


def test_monitor_takes_numpy_integers_as_its_ints():
    ints, _ = _monitor_history(lambda r: r.Window(4, 2), first_step=5)
    nps, mon = _monitor_history(lambda r: r.Window(np.int64(4), np.int32(2)), first_step=np.int64(5))
    assert nps == ints and [r["step"] for r in ints] == [8, 12, 16]
    assert type(mon.route.every) is int and type(mon.route.window) is int and type(mon.first_step) is int
    json.dumps(mon.history)  # records hold Python numbers
    lagged, mon = _monitor_history(lambda r: r.EveryStep(np.int64(3)))
    assert lagged == _monitor_history(lambda r: r.EveryStep(3))[0] and len(lagged) == 12
    assert type(mon.route.lag) is int


def test_monitor_still_refuses_bools_and_floats():
    torch = pytest.importorskip("torch")
    import richness
    model = torch.nn.Linear(3, 2)
    for make, match in ((lambda: richness.Window(every=True), "every must be a positive integer"),
                        (lambda: richness.Window(every=np.bool_(True)), "every must be a positive integer"),
                        (lambda: richness.Probe(torch.ones(2, 3), every=4.0), "every must be a positive integer"),
                        (lambda: richness.Window(4, np.int64(5)), r"window must be an integer in \[1, every=4\]"),
                        (lambda: richness.EveryStep(np.int64(0)), "lag must be a positive integer or None"),
                        (lambda: richness.Monitor(model, first_step=np.bool_(False)),
                         "first_step must be an integer")):
        with pytest.raises(ValueError, match=match):
            make()


def test_moments_groups_and_cuda_stack_rows_take_numpy_integers():
    import richness
    from reference import states_equal

    rng = np.random.default_rng(0)
    X, F, y = rng.normal(size=(90, 5)), rng.normal(size=(90, 3)), rng.integers(0, 3, 90)
    states = []
    for groups, seed in ((3, 11), (np.int64(3), np.int64(11))):
        m = richness.Moments(groups=groups, group_seed=seed, cuda=richness.CudaOptions(stack_rows=np.int64(0)))
        for i in range(0, 90, 30):
            m.update(X[i:i + 30], F[i:i + 30], y[i:i + 30])
        states.append(m.state_dict())
    assert states_equal(*states)


def test_dask_takes_numpy_integers():
    da = pytest.importorskip("dask.array")
    dask = pytest.importorskip("dask")
    import richness.dask as rd
    from reference import states_equal

    X = np.random.default_rng(1).normal(size=(120, 4))
    with dask.config.set(scheduler="sync"):
        a = rd.moments(da.from_array(X, chunks=(20, -1)), split_every=2, chunks_per_task=2)
        b = rd.moments(da.from_array(X, chunks=(20, -1)), split_every=np.int64(2), chunks_per_task=np.int32(2))
    assert states_equal(a.state_dict(), b.state_dict())


def test_plot_history_takes_numpy_integer_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from richness import plot

    recs = [{"step": s, "dlr": 0.5} for s in (10, 20)]
    assert len(plot.history([{"step": np.int64(r["step"]), "dlr": r["dlr"]} for r in recs], tmp_path / "h")) == 2
    with pytest.raises(ValueError, match=r"record 0: step is not a number \(True\)"):
        plot.history([{"step": True, "dlr": 0.5}], tmp_path / "b")
