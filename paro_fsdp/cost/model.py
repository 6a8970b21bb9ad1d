"""The model the cost model prices: a Llama's shapes and parameter counts, its activation memory, its FLOPs
and the engine's buckets of it. Why apart from the time model: facts about the model alone, checked against
the engine's buckets and what autograd saves (tests/test_advisor.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from .ledger import Bucket
from ..models.llama import FLAVORS, LlamaArgs, flavor
from ..plan import plan_of
from ..strategy import Strategy, StrategyLike
from .cluster import AdvisorError

__all__ = ["ModelSpec", "activation_bytes", "buckets", "flops_per_token", "model_spec"]

@dataclass(frozen=True)
class ModelSpec:
    """A Llama-shaped model's shapes and parameter counts. ``root``: parameters outside the layers, gathered
    once per micro-step; ``layer``: one layer's. The first ``trainable_layers`` train; the root trains only
    when all layers do (as ``train.estimate`` counts)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    trainable_layers: int

    @property
    def layer(self) -> int:
        h = self.dim  # wq, wo; wk, wv (grouped-query heads); w1, w2, w3; two norms
        return 2 * h * h + 2 * h * self.n_kv_heads * (h // self.n_heads) + 3 * h * self.ffn_dim + 2 * h

    @property
    def root(self) -> int:
        return 2 * self.vocab_size * self.dim + self.dim

    #: tensors of a layer (wq, wk, wv, wo, w1, w2, w3, two norms) and of the root (embedding, norm, output):
    #: the end of backward asks, a byte each, which of them some rank used (ParoState.used_grads)
    layer_tensors = 9
    root_tensors = 3

    @property
    def root_trainable(self) -> bool:
        return self.trainable_layers == self.n_layers

    @property
    def psi(self) -> int:
        return self.root + self.n_layers * self.layer

    @property
    def psi_trainable(self) -> int:
        return self.trainable_layers * self.layer + (self.root if self.root_trainable else 0)

    @property
    def layer_matmul(self) -> int:
        return self.layer - 2 * self.dim

    @property
    def root_matmul(self) -> int:
        return self.vocab_size * self.dim  # the output layer; the embedding is a lookup


def _flavor_name(args: LlamaArgs) -> str:
    """The flavor whose shapes ``args`` has (a trainer may widen the vocabulary), else "custom"."""
    shape = lambda a: (a.dim, a.n_layers, a.n_heads, a.n_kv_heads or a.n_heads, a.ffn_dim)  # noqa: E731
    for name, f in FLAVORS.items():
        if shape(f) == shape(args):
            return name if f.vocab_size == args.vocab_size else f"{name} (vocab {args.vocab_size})"
    return "custom"


def model_spec(model: Union[str, LlamaArgs, ModelSpec], trainable_fraction: float = 1.0) -> ModelSpec:
    """A :class:`ModelSpec` from a flavor name (``llama7b``) or ``LlamaArgs``; a spec as it is."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        if model not in FLAVORS:
            raise AdvisorError(f"unknown model flavor {model!r}; valid: {', '.join(sorted(FLAVORS))}")
        name, args = model, flavor(model)
    elif isinstance(model, LlamaArgs):
        name, args = _flavor_name(model), model
    else:
        raise AdvisorError(f"model must be a flavor name, LlamaArgs or ModelSpec, got {type(model).__name__}")
    if args.dim % args.n_heads:
        raise AdvisorError(f"dim {args.dim} is not divisible by n_heads {args.n_heads}")
    spec = ModelSpec(name, args.dim, args.n_layers, args.n_heads, args.n_kv_heads or args.n_heads, args.ffn_dim,
                     args.vocab_size, args.n_layers)
    fraction = trainable_fraction
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise AdvisorError(f"trainable fraction must be in (0, 1], got {fraction!r}")
    if fraction == 1:
        return spec
    # the first t layers are trainable, t >= 1 closest to fraction x Psi
    return replace(spec, trainable_layers=min(range(1, spec.n_layers + 1),
                                              key=lambda t: abs(t * spec.layer - fraction * spec.psi)))


def activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, act_bytes: int = 2,
                     checkpoint: bool = False) -> dict[str, float]:
    """Activation bytes of one micro-step per GPU. ``saved``: what autograd keeps for this Llama, counted from
    its code (checked against saved-tensor hooks, tests/test_advisor.py); ``peak``: saved + the transient
    measured on CPU ranks (``tools.bench.memory_peak``): the logits' fp32 gradients at the start of backward,
    or with checkpointing 0.8 of the recomputed layer; ``held``: saved once the last block's backward is done
    (its layer and the root's log-softmax freed)."""
    h, f, nh, V, L = spec.dim, spec.ffn_dim, spec.n_heads, spec.vocab_size, spec.n_layers
    tokens = micro_batch * seq_len
    a = act_bytes
    norm = 4 * h + 4 + 2 * a * h  # RMSNorm: x.float() (x itself when fp32), rsqrt, cast, x * weight
    # per token: 2 norms, q, k, v (k and v after the GQA repeat), SDPA's log-sum-exp (4 bytes per
    # head), the attention output (wo's input), SwiGLU: w1 out, silu out, w3 out, their product
    per_layer = 2 * norm + 3 * a * h + 4 * nh + a * h + 4 * a * f
    root = norm + 4 * V + 8 + 8  # final norm, fp32 log-softmax, tokens, targets (int64)
    kept = L * a * h if checkpoint else L * per_layer  # checkpointing keeps each block's input only
    saved = (kept + root) * tokens + 8 * micro_batch + 4  # + the tokens column, the loss weight
    transient = (0.8 * per_layer if checkpoint else 8 * V + (a * V if a < 4 else 0)) * tokens
    held = saved - (kept / L + 4 * V) * tokens
    return {"saved": float(saved), "peak": float(saved + transient), "held": float(held),
            "per_layer_token": float(per_layer), "root_token": float(root)}


def buckets(spec: ModelSpec, strategy: StrategyLike, reshard_after_forward: bool = True) -> list[Bucket]:
    """The engine's buckets for a whole-model strategy: root, trainable layers, frozen layers."""
    s = Strategy.parse(strategy)
    once = 0 if plan_of(s).params_whole else 1
    twice = 2 * once if reshard_after_forward else once
    out = [Bucket(s, spec.root, spec.root if spec.root_trainable else 0, once, spec.root_tensors)]
    out += [Bucket(s, spec.layer, spec.layer, twice, spec.layer_tensors)] * spec.trainable_layers
    out += [Bucket(s, spec.layer, 0, twice)] * (spec.n_layers - spec.trainable_layers)
    return out


def flops_per_token(spec: ModelSpec, seq_len: int, checkpoint: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs per token: 2 Psi_mm + 4 L s h forward (attention in full),
    2 Psi_mm + 2 Psi'_mm + 8 L s h backward (weight gradients for trainable weights only)."""
    L, h = spec.n_layers, spec.dim
    mm = L * spec.layer_matmul + spec.root_matmul
    mm_t = spec.trainable_layers * spec.layer_matmul + (spec.root_matmul if spec.root_trainable else 0)
    attn = 4 * L * seq_len * h
    fwd = 2 * mm + attn
    bwd = 2 * mm + 2 * mm_t + 2 * attn
    if checkpoint:
        bwd += 2 * L * spec.layer_matmul + attn
    return float(fwd), float(bwd)
