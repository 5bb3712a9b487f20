"""Rules the package decides in one place: a refusal before the core carries
the core's fields."""

import numpy as np
import pytest

import richness
from richness import _core
from richness._engine import adapt as _adapt


def _refusal(fn):
    with pytest.raises((_core.InputError, _core.DTypeError)) as info:
        fn()
    return info.value


X = np.zeros((4, 3))


@pytest.mark.parametrize("case, stream, cls, row, limit", [
    (lambda: _adapt.as_matrix(np.zeros(4), "features"), "features", _core.InputError, None, None),
    (lambda: _adapt.as_matrix(np.zeros((2, 2, 2)), "outputs", allow_1d=True), "outputs", _core.InputError, None, None),
    (lambda: _adapt.as_matrix(np.zeros((4, 2), np.complex128), "targets"), "targets", _core.DTypeError, None, None),
    (lambda: _adapt.as_matrix(np.zeros((4, 2), np.int8), "outputs"), "outputs", _core.DTypeError, None, None),
    (lambda: _adapt.as_matrix(np.ma.masked_array(X), "features"), "features", _core.DTypeError, None, None),
    (lambda: _adapt.as_labels(np.zeros((4, 2), np.int64)), "labels", _core.InputError, None, None),
    (lambda: _adapt.as_labels(np.zeros(4)), "labels", _core.DTypeError, None, None),
    (lambda: _adapt.as_labels(np.array([0, 1, 2**63 + 1], np.uint64)), "labels", _core.InputError, 2, "int64"),
])
def test_each_refusal_of_the_adapter_carries_its_stream(case, stream, cls, row, limit):
    e = _refusal(case)
    assert type(e) is cls
    assert (e.stream, e.row, e.limit) == (stream, row, limit)


def test_torch_refusals_of_the_adapter_carry_their_stream():
    torch = pytest.importorskip("torch")
    cases = [
        (lambda: _adapt.as_matrix(torch.zeros(2, 2, 2), "features"), "features", _core.InputError),
        (lambda: _adapt.as_matrix(torch.zeros(4, 2, dtype=torch.complex64), "outputs"), "outputs", _core.DTypeError),
        (lambda: _adapt.as_matrix(torch.zeros(4, 2, dtype=torch.int8), "targets"), "targets", _core.DTypeError),
        (lambda: _adapt.as_labels(torch.zeros(4, 2, dtype=torch.int64)), "labels", _core.InputError),
        (lambda: _adapt.as_labels(torch.zeros(4)), "labels", _core.DTypeError),
        (lambda: _adapt.as_matrix(torch.zeros(4, 2).to_sparse(), "outputs"), "outputs", _core.DTypeError),
    ]
    for case, stream, cls in cases:
        e = _refusal(case)
        assert type(e) is cls and e.stream == stream


def test_a_refusal_through_update_keeps_its_class_and_message():
    m = richness.Moments()
    with pytest.raises(ValueError, match=r"^labels must be 1-D \(n,\), got shape \(4, 1\)$") as info:
        m.update(X, labels=np.zeros((4, 1), np.int64))
    assert isinstance(info.value, _core.InputError) and info.value.stream == "labels"
    with pytest.raises(TypeError, match="^outputs has dtype") as info2:
        m.update(X, outputs=np.zeros((4, 2), np.complex64))
    assert isinstance(info2.value, _core.DTypeError) and info2.value.stream == "outputs"


def test_a_name_outside_a_batch_carries_no_stream():
    e = _refusal(lambda: _adapt.refuse_unreadable(np.ma.masked_array(X), "it"))
    assert e.stream is None


def test_every_route_validates_a_precision_name_through_one_function():
    from richness import _state

    names = _state.precisions()
    for make in (lambda: richness.Moments(precision="fp16"), lambda: richness.Similarity(precision="fp16")):
        with pytest.raises(ValueError, match=f"^precision must be one of {names!r} or None, got 'fp16'$".replace(
                "(", r"\(").replace(")", r"\)")):
            make()
    state = richness.Moments().state_dict()
    state["precision"] = "fp16"
    with pytest.raises(ValueError) as info:
        _state.checked(state)
    assert str(info.value) == f"state entry 'precision' is 'fp16', expected one of {names}"
    with pytest.raises(ValueError) as info:
        _state.precision_mode("fp16")
    assert str(info.value) == f"unknown precision 'fp16'; expected one of {names}"
