"""The public surface names one thing once: ``head=`` is a module to hook
(``evaluate``, ``Monitor``, the callbacks, the torchmetrics ``DLR``), a linear
read-out's weights go to ``head_weights=`` (``Moments.compute``,
``richness.dlr``, the torchmetrics ``DLR``), and the CUDA backend's tuning is one
``CudaOptions`` object, never loose ``Moments`` arguments."""

import dataclasses
import inspect

import numpy as np
import pytest

import richness
from conftest import linear_data
from reference import dlr_naive, states_equal


def test_compute_and_dlr_refuse_head_and_name_head_weights():
    X, F, _, W = linear_data(n=200, p=6, c=3, head=True)
    m = richness.Moments()
    m.update(X, F)
    before = m.state_dict()
    with pytest.raises(TypeError, match=r"compute\(\) got an unexpected keyword argument 'head'.*head_weights="):
        m.compute(head=W)
    with pytest.raises(TypeError, match=r"dlr\(\) got an unexpected keyword argument 'head'.*head_weights="):
        richness.dlr(X, head=W)
    assert states_equal(m.state_dict(), before)
    # the signatures inspect and help() show are the functions' own
    assert "head_weights" in inspect.signature(richness.Moments.compute).parameters
    assert "head" not in inspect.signature(richness.Moments.compute).parameters
    assert list(inspect.signature(richness.dlr).parameters) == ["features", "outputs", "head_weights", "rtol"]


@pytest.mark.parametrize("form", ["W", "(W, b)", "Linear"])
def test_head_weights_give_the_dlr_of_the_head_outputs(form):
    X, _, _, W = linear_data(n=300, p=8, c=4, seed=3, head=True)
    b = np.arange(4.0)
    want, _ = dlr_naive(X, X @ W.T + b)  # the bias is a constant: it drops out
    if form == "W":
        weights = W
    elif form == "(W, b)":
        weights = (W, b)
    else:
        torch = pytest.importorskip("torch")
        weights = torch.nn.Linear(8, 4).double()
        with torch.no_grad():
            weights.weight.copy_(torch.from_numpy(W))
            weights.bias.copy_(torch.from_numpy(b))
    m = richness.Moments()
    m.update(X)  # features only: the outputs come from the weights
    assert abs(m.compute(head_weights=weights).dlr - want) < 1e-10
    assert abs(richness.dlr(X, head_weights=weights) - want) < 1e-10


def test_torchmetrics_dlr_takes_a_module_as_head_and_weights_as_head_weights():
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchmetrics")
    from richness.torchmetrics import DLR

    X, _, _, W = linear_data(n=120, p=5, c=3, head=True)
    with pytest.raises(TypeError, match=r"head must be a torch.nn.Module.*head_weights="):
        DLR(head=torch.from_numpy(W))
    with pytest.raises(ValueError, match="not both"):
        DLR(head=torch.nn.Linear(5, 3), head_weights=W)
    metric = DLR(head_weights=torch.from_numpy(W))
    metric.update(features=torch.from_numpy(X))
    assert float(metric.compute()) == pytest.approx(dlr_naive(X, X @ W.T)[0], abs=1e-10)


def test_cuda_options_are_checked_when_made():
    assert richness.CudaOptions() == richness.CudaOptions(stack_rows=0, stack_joint=True, product=None)
    assert richness.CudaOptions(stack_rows=np.int64(64)).stack_rows == 64
    assert type(richness.CudaOptions(stack_rows=np.int64(64)).stack_rows) is int
    for bad in (-1, 2**31, 2.0, True, "64", None):
        with pytest.raises(ValueError, match=r"stack_rows must be an integer in \[0, 2\*\*31\)"):
            richness.CudaOptions(stack_rows=bad)
    for bad in (0, 1, None, np.bool_(True), "yes"):
        with pytest.raises(TypeError, match="stack_joint must be True or False"):
            richness.CudaOptions(stack_joint=bad)
    for bad in ("tiles:", "Tiles", "tiles:16x", "tiles:1234567890", 16, ("tiles", 16)):
        with pytest.raises(ValueError, match="product must be None or an algorithm's name"):
            richness.CudaOptions(product=bad)
    options = richness.CudaOptions(stack_rows=64, stack_joint=False, product="tiles:16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.stack_rows = 0  # type: ignore[misc]
    with pytest.raises(TypeError, match="cuda must be a richness.CudaOptions or None, got dict"):
        richness.Moments(cuda={"stack_rows": 64})


@pytest.mark.parametrize("options,refused", [
    (dict(stack_rows=64), r"CudaOptions\(stack_rows=...\) is an option of the CUDA backend"),
    (dict(stack_joint=False), r"CudaOptions\(stack_joint=False\) is an option of the CUDA backend"),
    (dict(product="gemm"), r"CudaOptions\(product=...\) is an option of the CUDA backend"),
])
def test_cpu_refuses_non_default_cuda_options(options, refused):
    X, F, _ = linear_data(n=50, p=4, c=2)
    with pytest.raises(ValueError, match=refused):
        richness.Moments(device="cpu", cuda=richness.CudaOptions(**options))
    later = richness.Moments(cuda=richness.CudaOptions(**options))  # the device comes with the first batch
    with pytest.raises(ValueError, match=refused):
        later.update(X, F)
    assert later.n == 0 and later.device is None
    for default in (None, richness.CudaOptions()):  # the defaults run anywhere
        m = richness.Moments(device="cpu", cuda=default)
        m.update(X, F)
        assert m.n == 50


def test_moments_signatures_carry_no_internals():
    init = inspect.signature(richness.Moments.__init__).parameters
    assert not {"stack_rows", "stack_joint", "cuda_product"} & set(init)
    assert init["cuda"].kind is inspect.Parameter.KEYWORD_ONLY and init["cuda"].default is None
    assert list(inspect.signature(richness.Moments.update).parameters) == [
        "self", "features", "outputs", "labels", "targets"]
    assert "CudaOptions" in richness.__all__ and "CudaOptions" in dir(richness)
    assert richness.CudaOptions.__doc__ and "stack_rows" in richness.CudaOptions.__doc__
