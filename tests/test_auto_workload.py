"""``strategy="auto"`` plans for the workload it sees (``paro_fsdp/cost/workload_probe.py``): one
micro-batch's activations measured from the model itself (``Workload(example_inputs=...)``), a
budget without a way to know the activations refused in one line, an assumed workload named in
the plan's header, and the first step checked against the workload the plan was made for.

The measurement is checked against what autograd really saves (saved-tensor hooks on a real
forward) and against the Llama formula the cost model was fitted on; nothing asserts on a timing.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paro_fsdp import paro_shard
from paro_fsdp.cost.budget import BudgetError, Workload, _size
from paro_fsdp.cost.cluster import load_cluster
from paro_fsdp.cost.model import activation_bytes, model_spec
from paro_fsdp.cost.workload_probe import measure_activations, watch_first_step
from paro_fsdp.models.llama import Llama, flavor
from paro_fsdp.train.estimate import fake_mesh, release_fake_world

CLUSTER = load_cluster("a100_ib")


class Mine(nn.Module):
    """A model of a user's own shape: embedding, residual MLP blocks (optionally checkpointed), head."""

    def __init__(self, ckpt: bool = False, blocks: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.emb = nn.Embedding(100, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(blocks))
        self.out = nn.Linear(dim, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + (checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h))
        return self.out(h)


def saved_bytes(model: nn.Module, *args, **kwargs) -> int:
    """The bytes autograd keeps from a real forward to its backward (each storage once)."""
    seen: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args, **kwargs)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_activations_match_the_llama_formula(dtype):
    """On the Llama the cost model's formula was fitted on, the measurement agrees with it (within
    4%: the formula's bf16 transient rounds the logits' cast up); both read one micro-batch."""
    args = flavor("debug", max_seq_len=128)
    tokens = torch.randint(0, args.vocab_size, (2, 129))
    got = measure_activations(Llama(args), tokens, dtype)
    want = activation_bytes(model_spec(args), 2, 128, dtype.itemsize)["peak"]
    assert got.activation_bytes == pytest.approx(want, rel=0.04)
    assert (got.micro_batch, got.seq_len) == (2, 129)


def test_a_model_of_its_own_shape_is_measured_with_its_checkpointing():
    """Not Llama-shaped: the measurement holds what autograd saves (and the backward's transients on
    top, under half as much again); checkpointing every block is seen as the smaller activations it is."""
    x = torch.randint(0, 100, (2, 32))
    plain, ckpt = measure_activations(Mine(), x, torch.float32), measure_activations(Mine(ckpt=True), x, torch.float32)
    saved = saved_bytes(Mine(), x)
    assert saved <= plain.activation_bytes <= 1.5 * saved
    assert ckpt.activation_bytes < 0.75 * plain.activation_bytes
    assert (plain.micro_batch, plain.seq_len) == (2, 32)


def test_the_backward_moments_and_a_loss_outside_the_model_are_measured():
    """With the blocks named, what is held while a block's backward runs and when it has finished
    (the reduction's moment) is measured too: less than the peak, in that order, the finished one
    about the first block backward runs less its own saved activations. A loss computed outside the
    model (``loss_fn``: cross-entropy on the logits) adds its log-softmax and the logits' gradient
    to the peak, which a sum of the output does not see."""
    x, y = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
    model = Mine()
    ce = lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731
    plain = measure_activations(model, x, torch.float32, list(model.blocks))
    outside = measure_activations(model, x, torch.float32, list(model.blocks), loss_fn=ce)
    assert plain.after_backward < plain.in_backward <= plain.activation_bytes
    block = saved_bytes(model.blocks[-1], torch.randn(2, 32, 64))
    assert plain.after_backward <= plain.activation_bytes - block
    assert outside.activation_bytes >= plain.activation_bytes
    head = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 1000))  # logits outweigh the rest
    y = torch.randint(0, 1000, (2, 32))
    logits = 2 * 32 * 1000 * 4
    summed, ce_head = (measure_activations(head, x, torch.float32, loss_fn=f) for f in (None, ce))
    assert ce_head.activation_bytes >= summed.activation_bytes + 2 * logits
    without = measure_activations(model, x, torch.float32)  # no blocks: every moment is the peak
    assert without.in_backward == without.after_backward == without.activation_bytes


def test_a_hugging_face_model_with_lora_is_measured_from_its_batch():
    """A batch as Hugging Face passes it (keyword arguments, the loss from ``labels``), LoRA's frozen
    base included: at least what autograd saves, the shape read from ``input_ids``."""
    pytest.importorskip("peft")
    from hf_models import make

    model = make("llama", lora={"target_modules": ["q_proj", "v_proj"]})
    ids = torch.randint(0, 256, (2, 24))
    got = measure_activations(model, {"input_ids": ids, "labels": ids}, torch.float32)
    assert got.activation_bytes >= saved_bytes(model, input_ids=ids, labels=ids)
    assert (got.micro_batch, got.seq_len) == (2, 24)
    assert all(not p.is_meta and p.device.type == "cpu" for p in model.parameters())  # the model is untouched


class Branchy(Mine):
    """``Mine`` with control flow on a tensor's values, which a fake forward cannot trace, and a
    BatchNorm and a dropout whose statistics and random draws a real measurement must not move."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop = nn.BatchNorm1d(64), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.emb(x).transpose(1, 2)).transpose(1, 2))
        for b in self.blocks:
            h = h + b(h) if h.sum() > -1e30 else h  # data-dependent: always true
        return self.out(h)


class Plain(Branchy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.emb(x).transpose(1, 2)).transpose(1, 2))
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def test_tied_weights_are_measured_once():
    """GPT-2 and T5 tie their head to the token embedding: each parameter passed once (they were
    passed under every name, which ``functional_call`` refuses for tied ones), by the fake forward."""
    pytest.importorskip("transformers")
    from hf_models import make
    from transformers import T5Config, T5ForConditionalGeneration

    ids = torch.randint(0, 256, (2, 16))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=272, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                             dropout_rate=0.0, decoder_start_token_id=0))
    for model in (make("gpt2"), t5):
        got = measure_activations(model, {"input_ids": ids, "labels": ids}, torch.float32)
        assert got.method == "a fake forward" and got.activation_bytes >= saved_bytes(model, input_ids=ids, labels=ids)


def test_a_forward_the_fake_mode_cannot_run_is_measured_for_real():
    """Control flow on a tensor's values: one real forward and backward measures what the fake one
    measures of the same model without the branch, and says so; the model's buffers (BatchNorm's
    running statistics), random state (dropout) and ``.grad`` are as before."""
    torch.manual_seed(0)
    model, x = Branchy(), torch.randint(0, 100, (2, 32))
    plain = Plain()
    plain.load_state_dict(model.state_dict())
    want = measure_activations(plain, x, torch.float32, list(plain.blocks))
    stats, rng = model.norm.running_mean.clone(), torch.get_rng_state()
    got = measure_activations(model, x, torch.float32, list(model.blocks))
    assert got.method.startswith("a real forward and backward (the fake one failed: ") and "\n" not in got.method
    assert (got.activation_bytes, got.in_backward, got.after_backward) == (
        want.activation_bytes, want.in_backward, want.after_backward)
    assert torch.equal(model.norm.running_mean, stats) and torch.equal(torch.get_rng_state(), rng)
    assert int(model.norm.num_batches_tracked) == 0 and all(p.grad is None for p in model.parameters())


def test_a_mixture_of_experts_whose_fake_kernel_refuses_fp32_is_measured_for_real():
    """transformers' Mixtral runs torch's ``grouped_mm``, whose fake kernel takes bf16 only, while the
    eager fp32 forward runs: the real measurement, at least what autograd saves."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    ids = torch.randint(0, 256, (2, 16))
    got = measure_activations(model, {"input_ids": ids, "labels": ids}, torch.float32)
    assert got.method.startswith("a real forward and backward (the fake one failed: ")
    assert got.activation_bytes >= saved_bytes(model, input_ids=ids, labels=ids) > 0


def test_a_meta_model_the_fake_mode_cannot_run_is_asked_for_its_activations():
    with torch.device("meta"):
        model = Branchy()
    with pytest.raises(ValueError, match=r"Branchy's fake forward failed .* pass Workload\(activation_bytes=") as info:
        measure_activations(model, torch.randint(0, 100, (2, 32)), torch.float32)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(4, 2)
    release_fake_world()


def test_a_budget_without_the_activations_is_refused_in_one_line(mesh):
    with pytest.raises(BudgetError, match=r"needs the activations of a micro-step.*Mine: pass "
                                          r"workload=Workload\(example_inputs=") as info:
        paro_shard(Mine(), mesh, "auto", memory_budget=2**30, cluster=CLUSTER)
    assert "\n" not in str(info.value)


def test_example_inputs_give_the_plan_its_activations(mesh, capsys):
    x = torch.randint(0, 100, (2, 32))
    want = measure_activations(Mine(), x, torch.float32).activation_bytes
    paro_shard(Mine(), mesh, "auto", memory_budget=2**30, workload=Workload(example_inputs=x, grad_accum=2),
               cluster=CLUSTER)
    out = capsys.readouterr().out
    assert "micro-batch 2 x 32, 2 micro-steps" in out
    assert f"; activations {_size(want)} measured from example_inputs" in out


def test_an_assumed_workload_is_named_in_the_header(mesh, capsys):
    paro_shard(Llama(flavor("debug", max_seq_len=64)), mesh, "auto", memory_budget=2**30, cluster=CLUSTER)
    header = capsys.readouterr().out.splitlines()[0]
    assert "micro-batch 2 x 2048, 4 micro-steps" in header
    assert "ASSUMED (no workload= given): pass workload=Workload(example_inputs=<one micro-batch>" in header


class _Group:
    last_backward = True


class _Sharded(nn.Embedding):
    """What watch_first_step reads of a sharded model: its groups' ``last_backward`` flag."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.group = _Group()

    def _paro_groups(self, recurse: bool = True) -> list:
        return [self.group]


def _first_step(model: _Sharded, micro_steps: int, shape: tuple[int, int]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(micro_steps + 1):  # and one forward of the next step
            model.group.last_backward = k == micro_steps - 1
            model(torch.zeros(*shape, dtype=torch.long))
    return [str(w.message) for w in caught if "paro auto" in str(w.message)]


def test_the_first_step_is_checked_against_the_planned_workload():
    model = _Sharded()
    watch_first_step(model, 2, 32, 2, announce=True)
    assert _first_step(model, 2, (2, 32)) == []  # as planned: nothing said
    model = _Sharded()
    watch_first_step(model, 2, 2048, 4, announce=True)
    said = _first_step(model, 2, (2, 32))
    assert said == ["paro auto: the plan was made for micro-batch 2 x 2048 and 4 micro-steps per step, the first "
                    "step ran micro-batch 2 x 32 and 2: its predicted peak and step time are another workload's; "
                    "pass workload=Workload(example_inputs=<one micro-batch>, grad_accum=2) to plan for this one"]
    model = _Sharded()
    watch_first_step(model, 2, 2048, 4, announce=False)  # ranks other than 0 say nothing
    assert _first_step(model, 2, (2, 32)) == []
