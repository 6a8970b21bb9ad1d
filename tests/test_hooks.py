"""When the engine gathers and frees, checked on a fake 8-rank process group in this process
(the fake group runs no data movement, so only the control flow is under test)."""
import pytest
import torch

from paro_fsdp import paro_shard
from paro_fsdp.hooks import register_pre_backward
from paro_fsdp.param_group import ParoParamGroup, ShardState
from paro_fsdp.train.estimate import fake_mesh, release_fake_world
from workloads import batch, make_model


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(8, 4)
    release_fake_world()


def test_frozen_block_is_freed_right_after_its_backward(mesh, monkeypatch):
    model = make_model()
    for p in model.layers[1].parameters():
        p.requires_grad_(False)
    model = paro_shard(model, mesh, "ING")
    blocks = {b.name: b for b in model._paro_state.blocks}
    events = []
    original = ParoParamGroup.reduce_grads

    def spy(self, grads):
        # when block 0's gradients arrive, the frozen block 1 (run backward before it) must be free
        events.append((self.name, blocks["layers.1"].groups[0].state))
        return original(self, grads)

    monkeypatch.setattr(ParoParamGroup, "reduce_grads", spy)
    model(batch(0, 0, 0)).loss.backward()
    states = dict(events)
    assert states["layers.0:ING"] == ShardState.SHARDED
    assert all(g.state == ShardState.SHARDED for b in blocks.values() for g in b.groups)


def test_an_output_that_reaches_no_loss_gets_no_zeros_gradient():
    """A block returning (logits, aux) whose aux never reaches the loss: autograd would hand
    OnBackward a zeros tensor of aux's shape, and aux's producer would run its backward on it,
    every micro-step. Its gradient stays None; the callback still runs once."""
    calls = []
    logits = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    out = register_pre_backward(lambda: calls.append(1), (logits * 1, {"aux": w * 3}))
    (out[0] * 2).sum().backward()
    assert calls == [1]
    assert torch.equal(logits.grad, torch.full((2, 3), 2.0))
    assert w.grad is None


def test_blocks_are_freed_after_forward_and_root_is_kept(mesh):
    model = paro_shard(make_model(), mesh, "IIG")
    with torch.no_grad():
        model(batch(0, 0, 0))
    assert all(g.state == ShardState.SHARDED for g in model._paro_state.groups)
    out = model(batch(0, 0, 0))
    root, *layers = model._paro_state.blocks
    assert all(g.state == ShardState.UNSHARDED for g in root.groups)
    assert all(g.state == ShardState.SHARDED for b in layers for g in b.groups)
    out.loss.backward()
    assert all(g.state == ShardState.SHARDED for g in model._paro_state.groups)


def test_next_block_is_prefetched_in_forward_and_backward(mesh, monkeypatch):
    model = paro_shard(make_model(), mesh, "GGG")
    log = []
    issue, finish = ParoParamGroup.issue_unshard, ParoParamGroup.unshard

    def spy_issue(self):
        if self.state == ShardState.SHARDED:
            log.append(("issue", self.name.split(":")[0]))
        return issue(self)

    def spy_finish(self):
        was_sharded = self.state != ShardState.UNSHARDED
        finish(self)
        if was_sharded:
            log.append(("use", self.name.split(":")[0]))

    monkeypatch.setattr(ParoParamGroup, "issue_unshard", spy_issue)
    monkeypatch.setattr(ParoParamGroup, "unshard", spy_finish)
    model(batch(0, 0, 0)).loss.backward()
    # forward: block i+1's all-gather is issued before block i computes; backward mirrors it
    assert log == [
        ("issue", "<root>"), ("use", "<root>"), ("issue", "layers.0"),
        ("use", "layers.0"), ("issue", "layers.1"), ("use", "layers.1"),
        ("issue", "layers.1"), ("use", "layers.1"), ("issue", "layers.0"), ("use", "layers.0"),
    ]


def test_root_hooks_go_where_calls_enter_and_never_on_a_container():
    """The root's hooks sit on the innermost module every parameter is under, so a wrapper that
    calls its inner model directly (PeftModel.generate) still gathers; but never on a container
    without a forward (ModuleList, ModuleDict): it is never called, so its hooks would never run."""
    import torch.nn as nn

    from paro_fsdp.api import _entry_module

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    layers = Layers()
    assert _entry_module(layers) is layers  # not its ModuleList
    wrapped = Wrapper(Layers())
    assert _entry_module(wrapped) is wrapped.inner  # the wrapper is bypassed by direct calls
    by_key = Wrapper(nn.ModuleDict({"a": Layers()}))
    assert _entry_module(by_key) is by_key  # a ModuleDict is never called itself


def test_default_blocks_are_the_outermost_container_elements():
    """A container inside a block (peft's lora_A / lora_B ModuleDicts) stays part of it: the
    blocks are the layers, one bucket each, not every LoRA matrix."""
    import torch.nn as nn

    from paro_fsdp.api import _default_blocks

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 1)})
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([Layer(), Layer()])

    model = Model()
    assert _default_blocks(model) == list(model.layers)
