"""The workload ``strategy="auto"`` plans for: what one step does, and where its activations come from."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, Union

from ..models.llama import LlamaArgs
from .knapsack import BudgetError, _size
from .model import ModelSpec, model_spec

__all__ = ["Workload", "seen_workload", "spec_of"]


@dataclass(frozen=True)
class Workload:
    """What one step does (the advisor's defaults). ``model``: a flavor, ``LlamaArgs`` or ``ModelSpec``
    (default: read from this package's Llama or a Hugging Face Llama-like config); ``activation_bytes``:
    the activations' peak per rank, for a model not Llama-shaped; ``activations_in_backward`` /
    ``activations_after_backward``: those held while a block's backward runs / when it has finished
    (default: ``activation_bytes``); ``example_inputs``: one micro-batch (a tensor, the forward's
    arguments, or a dict of keyword arguments), from which activations, micro-batch and sequence
    length are measured; ``loss_fn``: the loss of the output when the model returns none
    (e.g. ``lambda logits: F.cross_entropy(...)``)."""

    micro_batch: int = 2
    seq_len: int = 2048
    grad_accum: int = 4
    activation_checkpoint: bool = False
    model: Union[str, LlamaArgs, ModelSpec, None] = None
    activation_bytes: Optional[float] = None
    activations_in_backward: Optional[float] = None
    activations_after_backward: Optional[float] = None
    example_inputs: Any = field(default=None, compare=False, hash=False, repr=False)
    loss_fn: Optional[Callable[[Any], Any]] = field(default=None, compare=False, hash=False, repr=False)


def seen_workload(model: Any, workload: Optional[Workload], spec: Optional[ModelSpec], param_dtype: Any,
                  budgeted: bool, block_modules: Sequence[Any] = ()) -> tuple[Workload, str]:
    """The workload ``auto`` plans for and where its activations come from: measured, given, the Llama
    formula, or under a budget a one-line refusal (a plan without activations never fits one)."""
    work = workload or Workload()
    if not isinstance(work, Workload):
        raise TypeError(f"workload= takes a paro_fsdp.cost.budget.Workload, got {type(work).__name__}")
    if work.example_inputs is not None and work.activation_bytes is None:
        from .workload_probe import measure_activations

        seen = measure_activations(model, work.example_inputs, param_dtype, block_modules, work.loss_fn)
        work = replace(work, activation_bytes=seen.activation_bytes, activations_in_backward=seen.in_backward,
                       activations_after_backward=seen.after_backward, micro_batch=seen.micro_batch,
                       seq_len=seen.seq_len, example_inputs=None, loss_fn=None)
        return work, f"; activations {_size(seen.activation_bytes)} measured from example_inputs ({seen.method})"
    if work.activation_bytes is not None:
        return work, f"; activations {_size(work.activation_bytes)} as given"
    fix = "workload=Workload(example_inputs=<one micro-batch>, grad_accum=<micro-steps per step>)"
    if spec is not None:
        return work, "" if workload is not None else f"; ASSUMED (no workload= given): pass {fix} for yours"
    if budgeted:
        raise BudgetError(f"memory_budget= needs the activations of a micro-step, which auto cannot model for "
                          f"{type(model).__name__}: pass {fix} to measure them, or Workload(activation_bytes=...)")
    return work, ""  # plan_blocks' header says the activations are not modelled


def spec_of(model: Any, workload: Workload) -> Optional[ModelSpec]:
    """The workload's spec, this package's Llama's, or a Hugging Face config's Llama fields; or None."""
    if workload.model is not None:
        return model_spec(workload.model)
    args = getattr(model, "args", None)
    if isinstance(args, LlamaArgs):
        return model_spec(args)
    c = getattr(model, "config", None)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if c is not None and all(isinstance(getattr(c, k, None), int) for k in keys):
        kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return model_spec(LlamaArgs(dim=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
                                    n_kv_heads=kv, ffn_dim=c.intermediate_size, vocab_size=c.vocab_size))
    return None
