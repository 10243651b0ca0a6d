"""InferenceModule: calls go straight to forward, and the plain-attribute copies of submodules stay in step with
nn.Module's registry through assignment, replacement, None, deletion, dtype conversion and state_dict."""
import pytest
import torch
from torch import nn

from kvserve.module import InferenceModule


class Scale(InferenceModule):
    def __init__(self, factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), factor), requires_grad=False)

    def forward(self, x):
        return x * self.weight


class Parent(InferenceModule):
    def __init__(self):
        super().__init__()
        self.child = Scale(2.0)
        self.norm = None

    def forward(self, x):
        return self.child(x) + 1


def test_call_is_forward_and_children_are_plain_attributes():
    m = Parent()
    assert Parent.__call__ is Parent.forward
    assert torch.equal(m(torch.ones(3)), torch.full((3,), 3.0))
    assert m.__dict__["child"] is m._modules["child"]
    assert list(m.state_dict()) == ["child.weight"]
    assert [name for name, _ in m.named_modules()] == ["", "child"]


def test_replacing_clearing_and_deleting_a_child_keep_both_views_in_step():
    m = Parent()
    m.child = Scale(5.0)
    assert m.child is m._modules["child"] and torch.equal(m(torch.ones(3)), torch.full((3,), 6.0))
    m.child = None
    assert m.child is None and m._modules["child"] is None
    m.child = Scale(3.0)
    del m.child
    assert "child" not in m._modules
    with pytest.raises(AttributeError):
        m.child


def test_dtype_conversion_reaches_the_child_seen_through_the_attribute():
    m = Parent().to(torch.bfloat16)
    assert m.child.weight.dtype == torch.bfloat16
    assert m.child is m._modules["child"]
