"""The strategy advisor: PARO_SPEC.md section 5's guideline as a calibrated cost model.

Why: PaRO's benefit depends on the model, the cluster and the batch, so the user needs to know
*which* of the 27 strategies to run before renting GPUs, and the trainer's
``paro_strategy = "auto"`` needs the same answer at start-up. This module predicts, for every
strategy, the per-GPU memory and the step time, and picks the fastest strategy that fits.
It is plain arithmetic (no process group, no tensors) except :func:`calibrate_in_process`,
which measures a real mesh and returns the :class:`Cluster` the model reads.

Model states and bytes are exact, not modelled: both come from ``paro_fsdp.ledger``
(``memory_of`` / ``traffic_of`` over the engine's buckets: the root block, gathered once per
micro-step, and one bucket per transformer layer, gathered twice), which tests check against
the engine's ``memory_report`` / ``comm_stats`` on real ranks and on a fake 64-rank mesh.

Memory per GPU = model states (ledger, exact)
  + gathered-parameter working set: P != N: the current and the prefetched block's whole
    parameters (2 x layer x param bytes) + the root's (kept from forward to backward);
    with ``reshard_after_forward=False`` every block stays gathered until its backward (Psi);
  + gradient working set: one block's whole gradient before its reduction and the one in
    flight (2 x layer x max(param, grad bytes));
  + activations (:func:`activation_bytes`): the tensors autograd saves for this Llama, per token
    per layer 24h + 8f + 4 heads + 8 bytes with 2-byte activations, root 8h + 4V + 20 (equal to
    what saved-tensor hooks count: on CPU in tests/test_advisor.py, and on an H200 with CUDA's
    SDPA for the LLaMA-7B shape, 3.459 GiB for 4 layers x 2 x 2048 tokens); with activation
    checkpointing only each block's input (2h per token) + one recomputed layer; plus a transient
    of max(one layer, 6V per token: the logits, their fp32 copy and log-softmax at the loss).
  It fits when it is at most ``memory_gib x usable_memory_fraction`` of the cluster's GPU.

Step time = A x (compute_fwd + compute_bwd + exposed_fwd + exposed_bwd) + boundary + optimizer.
  Compute. FLOPs per token (Psi_mm = weights used in matmuls: all but norms and the embedding
  table, Psi'_mm their trainable part, L layers, h hidden, s seq_len):
    forward  2 Psi_mm + 4 L s h                  (attention scores and values counted in full)
    backward 2 Psi_mm + 2 Psi'_mm + 8 L s h      (activation grads always: gradients flow back
                                                  to the earliest trainable layer; weight grads
                                                  only for trainable weights)
    + one more forward of the layers with activation checkpointing.
  Full training: 6 Psi_mm + 12 L s h per token (the usual 6 Psi). Divided by the cluster's
  ``achieved_tflops``: an end-to-end figure for this model's kernels (``tools.calibrate``
  measures it by timing a transformer block's forward + backward at the model's shape).
  Communication. A collective on k ranks over a mesh dimension takes
    hops x latency + ring bytes / bandwidth,     hops = k - 1 (AG, RS) or 2(k - 1) (AR),
  ring bytes from the ledger (S(k-1)/k, 2S(k-1)/k), bandwidth = bus bandwidth per GPU of the
  links that dimension's rings use: the ``intra`` link (NVLink) when its rings stay inside a
  node, else the node's network shared by the rings that leave the node at once (with groups
  = nodes: the m inter rings of a node each get 1/m of its NICs, ``inter.bandwidth_gbs``;
  see ``_link_for`` for other layouts). Intra and inter parts of a hierarchical collective add
  up (one communication stream; each bucket's inter phase waits for / feeds its intra phase).
  Overlap. Per micro-step collectives overlap that micro-step's compute up to a fraction
  ``overlap`` of it (prefetched all-gathers in forward and backward, reduce-scatters behind the
  next block's backward), except what cannot be prefetched: in forward the root's and the first
  layer's gathers, in backward the first re-gathered layer and the last reduction (the root's,
  or the earliest trainable layer's). So
    exposed_fwd = first + max(0, rest - overlap x compute_fwd)   (and the same for backward).
  Boundary collectives (grads to the OS level, updated params to the P level, the clip-norm
  all-reduce) are fully exposed, and so is the optimizer: AdamW on the OS shard, memory bound,
  (28 + grad bytes) bytes per element / ``memory_bandwidth_gbs``.
Not modelled: per-call framework overhead, gradient accumulation adds, stragglers, network
congestion beyond the per-node NIC share, and PaRO-CC's chunked overlap of the intra and inter
phases of one collective (the model adds them, which is what unchunked collectives do).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from .ledger import Bucket, Traffic, memory_of, traffic_of
from .models.llama import FLAVORS, LlamaArgs, flavor
from .strategy import ALL_STRATEGIES, Level, Strategy, StrategyLike

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "ACTIVATION_CHECKPOINT_MODES",
    "CLUSTER_DIR",
    "NAMED_STRATEGIES",
    "AdvisorError",
    "Cluster",
    "Link",
    "ModelSpec",
    "Prediction",
    "activation_bytes",
    "buckets",
    "calibrate_in_process",
    "choose_strategy",
    "cluster_from_dict",
    "cluster_to_toml",
    "custom_model",
    "format_table",
    "load_cluster",
    "model_spec",
    "predict",
    "rank_strategies",
    "traffic_time",
]

GiB, GB = 2**30, 1e9
CLUSTER_DIR = Path(__file__).resolve().parent.parent / "tools" / "clusters"
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "bfloat16": 2, "float16": 2, "float32": 4}
ACTIVATION_CHECKPOINT_MODES = ("none", "full", "auto")
NAMED_STRATEGIES = ("NNN", "NNG", "NGG", "GGG", "III", "NIG", "IIG", "IGG", "ING")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
OS_BYTES = 12  # fp32 master + AdamW's two fp32 moments: the spec's K
_N, _I, _G = Level.N, Level.I, Level.G


class AdvisorError(ValueError):
    """Bad input to the advisor (flavor, sizes, cluster file), in one line naming what is wrong."""


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One kind of link as seen by one GPU: ring bus bandwidth (GB/s, 1e9 bytes, per GPU while
    every GPU of the node uses the link at once) and latency per ring step (microseconds).
    ``per_kind`` overrides both per collective kind (``tools.calibrate`` measures each kind:
    e.g. gloo runs reduce-scatter as an all-reduce, so its effective bandwidth is lower)."""

    bandwidth_gbs: float
    latency_us: float
    per_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def cost(self, kind: str) -> tuple[float, float]:
        """(bytes per second, seconds per ring step) for a collective of ``kind``."""
        bw, lat = self.per_kind.get(kind, (self.bandwidth_gbs, self.latency_us))
        return bw * GB, lat * 1e-6


@dataclass(frozen=True)
class Cluster:
    """What the cost model knows about the hardware; read from a TOML file (:func:`load_cluster`).

    ``inter.bandwidth_gbs`` is the per-GPU share of the node's network: the node's line rate in
    GB/s x achieved efficiency / GPUs per node. ``node_gbps`` / ``inter_efficiency`` document
    where it came from and let the inter-bandwidth sweep convert Gb/s per node into it."""

    name: str
    gpus_per_node: int
    memory_gib: float
    achieved_tflops: float
    memory_bandwidth_gbs: float
    intra: Link
    inter: Link
    overlap: float = 0.8
    usable_memory_fraction: float = 0.9
    node_gbps: Optional[float] = None
    inter_efficiency: Optional[float] = None
    description: str = ""
    source: str = ""
    measured: Mapping[str, Any] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float:
        return self.memory_gib * GiB * self.usable_memory_fraction

    def efficiency(self) -> float:
        """Fraction of the node's line rate the inter link achieves (for Gb/s conversions)."""
        if self.inter_efficiency is not None:
            return self.inter_efficiency
        if self.node_gbps:
            return self.inter.bandwidth_gbs * self.gpus_per_node * 8 / self.node_gbps
        return 0.9

    def with_node_gbps(self, gbps: float) -> "Cluster":
        """The same cluster with ``gbps`` Gbit/s of network per node (same efficiency)."""
        if gbps <= 0:
            raise AdvisorError(f"inter-node bandwidth must be > 0 Gb/s, got {gbps}")
        eff = self.efficiency()
        inter = replace(self.inter, bandwidth_gbs=gbps / 8 * eff / self.gpus_per_node, per_kind={})
        return replace(self, inter=inter, node_gbps=gbps, inter_efficiency=eff,
                       name=f"{self.name}@{gbps:g}Gbps")

    def node_gbps_equivalent(self, per_gpu_gbs: float) -> float:
        """Gbit/s per node that gives ``per_gpu_gbs`` GB/s per GPU on the inter link."""
        return per_gpu_gbs * self.gpus_per_node * 8 / self.efficiency()


_REQUIRED = {
    "gpus_per_node": int, "memory_gib": float, "achieved_tflops": float, "memory_bandwidth_gbs": float,
}
_OPTIONAL = {
    "name": str, "description": str, "source": str, "overlap": float, "usable_memory_fraction": float,
    "peak_tflops": float, "matmul_tflops": float,
}
_LINK_REQUIRED = {"bandwidth_gbs": float, "latency_us": float}
_LINK_OPTIONAL = {f"{k}_{u}": float for k in KINDS for u in ("gbs", "latency_us")}
_INTER_OPTIONAL = {"node_gbps": float, "efficiency": float}


def _typed(where: str, key: str, value: Any, typ: type) -> Any:
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is str and isinstance(value, str):
        return value
    raise AdvisorError(f"{where}: field {key!r} must be a {typ.__name__}, got {value!r}")


def _link(where: str, section: str, table: Any, extra: Mapping[str, type]) -> tuple[Link, dict[str, Any]]:
    if not isinstance(table, dict):
        raise AdvisorError(f"{where}: missing section [{section}] (fields: {', '.join(_LINK_REQUIRED)})")
    allowed = {**_LINK_REQUIRED, **_LINK_OPTIONAL, **extra}
    for key in table:
        if key not in allowed:
            raise AdvisorError(f"{where}: unknown field '{section}.{key}'; valid: {', '.join(allowed)}")
    values: dict[str, Any] = {}
    for key, typ in _LINK_REQUIRED.items():
        if key not in table:
            raise AdvisorError(f"{where}: missing field '{section}.{key}'")
        values[key] = _typed(where, f"{section}.{key}", table[key], typ)
        if values[key] < 0 or (key == "bandwidth_gbs" and values[key] == 0):
            raise AdvisorError(f"{where}: field '{section}.{key}' must be > 0, got {values[key]}")
    per_kind = {}
    for kind in KINDS:
        bw = table.get(f"{kind}_gbs", values["bandwidth_gbs"])
        lat = table.get(f"{kind}_latency_us", values["latency_us"])
        bw = _typed(where, f"{section}.{kind}_gbs", bw, float)
        lat = _typed(where, f"{section}.{kind}_latency_us", lat, float)
        if bw <= 0 or lat < 0:
            raise AdvisorError(f"{where}: field '{section}.{kind}_gbs' / '_latency_us' must be > 0 / >= 0")
        if (bw, lat) != (values["bandwidth_gbs"], values["latency_us"]):
            per_kind[kind] = (bw, lat)
    rest = {k: _typed(where, f"{section}.{k}", table[k], extra[k]) for k in extra if k in table}
    return Link(values["bandwidth_gbs"], values["latency_us"], per_kind), rest


def cluster_from_dict(data: Mapping[str, Any], where: str = "cluster") -> Cluster:
    """Validate a parsed cluster TOML; every problem names the field."""
    sections = {"intra", "inter", "measured"}
    for key in data:
        if key not in _REQUIRED and key not in _OPTIONAL and key not in sections:
            raise AdvisorError(f"{where}: unknown field {key!r}; valid: "
                               f"{', '.join([*_REQUIRED, *_OPTIONAL, '[intra]', '[inter]', '[measured]'])}")
    values: dict[str, Any] = {}
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise AdvisorError(f"{where}: missing field {key!r}")
        values[key] = _typed(where, key, data[key], typ)
        if values[key] <= 0:
            raise AdvisorError(f"{where}: field {key!r} must be > 0, got {values[key]}")
    opt = {k: _typed(where, k, data[k], t) for k, t in _OPTIONAL.items() if k in data}
    for key in ("overlap", "usable_memory_fraction"):
        if key in opt and not 0 <= opt[key] <= 1:
            raise AdvisorError(f"{where}: field {key!r} must be in [0, 1], got {opt[key]}")
    intra, _ = _link(where, "intra", data.get("intra"), {})
    inter, extra = _link(where, "inter", data.get("inter"), _INTER_OPTIONAL)
    measured = data.get("measured", {})
    if not isinstance(measured, dict):
        raise AdvisorError(f"{where}: [measured] must be a table")
    return Cluster(
        name=opt.get("name", Path(str(where)).stem), gpus_per_node=values["gpus_per_node"],
        memory_gib=values["memory_gib"], achieved_tflops=values["achieved_tflops"],
        memory_bandwidth_gbs=values["memory_bandwidth_gbs"], intra=intra, inter=inter,
        overlap=opt.get("overlap", 0.8), usable_memory_fraction=opt.get("usable_memory_fraction", 0.9),
        node_gbps=extra.get("node_gbps"), inter_efficiency=extra.get("efficiency"),
        description=opt.get("description", ""), source=opt.get("source", ""), measured=dict(measured),
    )


def resolve_cluster_path(name: Union[str, os.PathLike]) -> Path:
    """A path as given, else a preset in tools/clusters/ (with or without ``.toml``)."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CLUSTER_DIR / p.name, CLUSTER_DIR / f"{p.name}.toml"):
        if cand.is_file():
            return cand
    presets = sorted(q.name for q in CLUSTER_DIR.glob("*.toml")) if CLUSTER_DIR.is_dir() else []
    raise AdvisorError(f"cluster file {str(name)!r} not found (as a path, or in {CLUSTER_DIR}); presets: {', '.join(presets)}")


def load_cluster(name: Union[str, os.PathLike]) -> Cluster:
    """Read and validate a cluster TOML (a path, or a preset name such as ``a100_ib``)."""
    path = resolve_cluster_path(name)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AdvisorError(f"cluster file {path}: not valid TOML: {exc}") from None
    return cluster_from_dict(data, str(path))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(float(f"{v:.9g}") if isinstance(v, float) else v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    return f'"{s}"'


def cluster_to_toml(c: Cluster, comments: Sequence[str] = ()) -> str:
    """A cluster as TOML text that :func:`load_cluster` reads back."""
    lines = [f"# {line}" for line in comments]
    for key in ("name", "description", "source"):
        if getattr(c, key):
            lines.append(f"{key} = {_toml_value(getattr(c, key))}")
    for key in ("gpus_per_node", "memory_gib", "usable_memory_fraction", "achieved_tflops",
                "memory_bandwidth_gbs", "overlap"):
        lines.append(f"{key} = {_toml_value(getattr(c, key))}")
    for section, link in (("intra", c.intra), ("inter", c.inter)):
        lines += ["", f"[{section}]", f"bandwidth_gbs = {_toml_value(link.bandwidth_gbs)}",
                  f"latency_us = {_toml_value(link.latency_us)}"]
        for kind, (bw, lat) in sorted(link.per_kind.items()):
            lines += [f"{kind}_gbs = {_toml_value(bw)}", f"{kind}_latency_us = {_toml_value(lat)}"]
        if section == "inter":
            if c.node_gbps is not None:
                lines.append(f"node_gbps = {_toml_value(c.node_gbps)}")
            if c.inter_efficiency is not None:
                lines.append(f"efficiency = {_toml_value(c.inter_efficiency)}")
    if c.measured:
        lines += ["", "[measured]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in c.measured.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """The shapes and parameter counts the cost model needs, for a Llama-shaped model.

    ``root``: parameters outside the layers (embeddings, final norm, output), one engine block
    gathered once per micro-step; ``layer``: parameters of one layer. The first
    ``trainable_layers`` layers are trainable; the root is trainable only when all layers are
    (the convention of ``tools.estimate``)."""

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
        hd = self.dim // self.n_heads
        return 2 * self.dim * self.dim + 2 * self.dim * self.n_kv_heads * hd + 3 * self.dim * self.ffn_dim + 2 * self.dim

    @property
    def root(self) -> int:
        return 2 * self.vocab_size * self.dim + self.dim

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


def _trainable_layers(root: int, layer: int, n_layers: int, fraction: float) -> int:
    """The first t layers are trainable, t >= 1 closest to ``fraction`` x Psi (all at 1);
    the same rule as ``tools.estimate.trainable_layers``."""
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise AdvisorError(f"trainable fraction must be in (0, 1], got {fraction!r}")
    if fraction == 1:
        return n_layers
    target = fraction * (root + n_layers * layer)
    return min(range(1, n_layers + 1), key=lambda t: abs(t * layer - target))


def _flavor_name(args: LlamaArgs) -> str:
    """The flavor whose shapes ``args`` has (a trainer may widen the vocabulary), else "custom"."""
    shape = lambda a: (a.dim, a.n_layers, a.n_heads, a.n_kv_heads or a.n_heads, a.ffn_dim)  # noqa: E731
    for name, f in FLAVORS.items():
        if shape(f) == shape(args):
            return name if f.vocab_size == args.vocab_size else f"{name} (vocab {args.vocab_size})"
    return "custom"


def model_spec(model: Union[str, LlamaArgs, ModelSpec], trainable_fraction: float = 1.0) -> ModelSpec:
    """A :class:`ModelSpec` from a flavor name (``llama7b``), ``LlamaArgs`` or a spec."""
    if isinstance(model, ModelSpec):
        spec = model
        name, args = spec.name, LlamaArgs(dim=spec.dim, n_layers=spec.n_layers, n_heads=spec.n_heads,
                                          n_kv_heads=spec.n_kv_heads, ffn_dim=spec.ffn_dim, vocab_size=spec.vocab_size)
    elif isinstance(model, str):
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
    t = _trainable_layers(spec.root, spec.layer, spec.n_layers, trainable_fraction)
    return replace(spec, trainable_layers=t)


def custom_model(params: float, layers: int, hidden: int, vocab_size: int = 32000, heads: Optional[int] = None,
                 trainable_fraction: float = 1.0) -> ModelSpec:
    """A Llama-shaped model from Psi, depth and width (LLaMA-style: head dim 128, SwiGLU FFN
    sized so the total is ``params``)."""
    if layers < 1 or hidden < 1 or params <= 0:
        raise AdvisorError(f"--params, --layers, --hidden must be positive, got {params}, {layers}, {hidden}")
    heads = heads or max(1, hidden // 128)
    root = 2 * vocab_size * hidden + hidden
    per_layer = (params - root) / layers
    ffn = round((per_layer - 4 * hidden * hidden - 2 * hidden) / (3 * hidden))
    if ffn < 1:
        raise AdvisorError(f"{params:.3g} parameters are too few for {layers} layers of width {hidden} "
                           f"(attention and embeddings alone need {root + layers * 4 * hidden * hidden:.3g})")
    args = LlamaArgs(dim=hidden, n_layers=layers, n_heads=heads, ffn_dim=ffn, vocab_size=vocab_size)
    return replace(model_spec(args, trainable_fraction), name=f"{params / 1e9:.3g}B")


def activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int, act_bytes: int = 2,
                     checkpoint: bool = False) -> dict[str, float]:
    """Activation memory of one micro-step, per GPU, in bytes.

    ``saved``: the tensors autograd keeps from forward to backward for this Llama, counted from
    its code and checked against saved-tensor hooks on CPU (tests/test_advisor.py) for 2- and
    4-byte activations; ``peak``: saved + the largest transient (one layer's worth of gradients
    in backward, the recomputed layer with checkpointing, or the logits at the loss)."""
    h, f, nh, V, L = spec.dim, spec.ffn_dim, spec.n_heads, spec.vocab_size, spec.n_layers
    tokens = micro_batch * seq_len
    a = act_bytes
    norm = 4 * h + 4 + 2 * a * h  # RMSNorm: x.float() (x itself when fp32), rsqrt, cast, x * weight
    # per token: 2 norms, q, k, v (k and v after the GQA repeat), SDPA's log-sum-exp (4 bytes per
    # head), the attention output (wo's input), SwiGLU: w1 out, silu out, w3 out, their product
    per_layer = 2 * norm + 3 * a * h + 4 * nh + a * h + 4 * a * f
    root = norm + 4 * V + 8 + 8  # final norm, fp32 log-softmax, tokens, targets (int64)
    logits = a * V + (4 * V if a < 4 else 0)  # at the loss: the logits and their fp32 copy
    if checkpoint:
        saved = L * a * h * tokens + root * tokens + 8 * micro_batch + 4  # each block's input
        transient = per_layer * tokens + max(per_layer, logits) * tokens  # + the recomputed layer
    else:
        saved = (L * per_layer + root) * tokens + 8 * micro_batch + 4  # + tokens column, loss weight
        transient = max(per_layer, logits) * tokens
    return {"saved": float(saved), "peak": float(saved + transient), "per_layer_token": float(per_layer),
            "root_token": float(root)}


def buckets(spec: ModelSpec, strategy: StrategyLike, reshard_after_forward: bool = True) -> list[Bucket]:
    """The engine's buckets for a whole-model strategy: root, trainable layers, frozen layers
    (one ``ParoParamGroup`` each; the ledger sums over them)."""
    s = Strategy.parse(strategy)
    once = 0 if s.p == _N else 1
    twice = 0 if s.p == _N else (2 if reshard_after_forward else 1)
    out = [Bucket(s, spec.root, spec.root if spec.root_trainable else 0, once)]
    out += [Bucket(s, spec.layer, spec.layer, twice)] * spec.trainable_layers
    out += [Bucket(s, spec.layer, 0, twice)] * (spec.n_layers - spec.trainable_layers)
    return out


# ---------------------------------------------------------------------------------------------
# Prediction
# ---------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    """One strategy's predicted cost; times in seconds, memory and traffic in bytes, per GPU."""

    strategy: str
    known_as: str
    step_time: float
    tokens_per_step: int
    compute: float
    exposed_comm: float  # per step: A x exposed per micro-step + boundary collectives
    optimizer: float
    comm_total: float  # all collective time per step, hidden or not
    memory: dict[str, float]  # P, G, OS, states, gathered, grad_work, activations, total
    fits: bool
    activation_checkpoint: bool
    traffic: Traffic
    breakdown: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def intra_bytes(self) -> float:
        return self.traffic.bytes(dim="intra")

    @property
    def inter_bytes(self) -> float:
        return self.traffic.bytes(dim="inter")

    @property
    def global_bytes(self) -> float:
        return self.traffic.bytes(dim="global")


def _check_sizes(n: int, m: int, micro_batch: int, grad_accum: int, seq_len: int) -> None:
    for name, v in (("number of GPUs", n), ("group size", m), ("micro-batch", micro_batch),
                    ("gradient accumulation", grad_accum), ("seq_len", seq_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise AdvisorError(f"{name} must be a positive integer, got {v!r}")
    if n % m:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise AdvisorError(f"group size {m} does not divide the number of GPUs {n}; valid group sizes: {divisors}")


def _scaled(link: Link, factor: float, cap: Link) -> Link:
    """``link`` with ``factor`` times its bandwidth, at most ``cap``'s, kind by kind."""
    def bw(kind: str) -> float:
        return min(link.cost(kind)[0] * factor, cap.cost(kind)[0]) / GB

    per_kind = {k: (bw(k), link.cost(k)[1] * 1e6) for k in KINDS}
    return Link(bw("all_gather"), link.latency_us, per_kind)


def _link_for(dim: str, n: int, m: int, cluster: Cluster) -> Link:
    """The links a mesh dimension's rings run on, as seen per GPU.

    A dimension whose rings stay inside a node runs on NVLink (``intra``). Otherwise each ring
    is as slow as its node-crossing hop, and the node's network (``inter.bandwidth_gbs`` x GPUs
    per node) is shared by the rings of that dimension that leave the node at once:
      inter dim, m dividing the GPUs per node: each node holds (GPUs/node) / m members of each of
        m rings, so m rings share it: per GPU inter x (GPUs/node) / m (= inter when m = GPUs/node);
      intra dim, groups spanning whole nodes (m a multiple of GPUs/node): one ring per node:
        inter x GPUs/node;
    never faster than NVLink; any other layout gets the plain per-GPU share (conservative)."""
    gpn = cluster.gpus_per_node
    if dim == "intra":
        if m <= gpn and gpn % m == 0:
            return cluster.intra
        return _scaled(cluster.inter, gpn, cluster.intra) if m % gpn == 0 else cluster.inter
    if n <= gpn:
        return cluster.intra
    if m <= gpn and gpn % m == 0:
        return _scaled(cluster.inter, gpn / m, cluster.intra) if m != gpn else cluster.inter
    return cluster.inter


def traffic_time(t: Traffic, cluster: Cluster) -> dict[str, float]:
    """Seconds per mesh dimension for the collectives in ``t`` (alpha-beta ring model)."""
    n, m, g = t.n, t.m, t.g
    out = {"intra": 0.0, "inter": 0.0, "global": 0.0}
    for key, e in t.as_dict().items():
        kind, dim = key.split("/")
        if dim == "global":  # the clip-norm scalar: latency of a hierarchical all-reduce
            lat = 0.0
            for d, k in (("intra", m), ("inter", g)):
                lat += 2 * (k - 1) * _link_for(d, n, m, cluster).cost("all_reduce")[1]
            bw = _link_for("inter", n, m, cluster).cost("all_reduce")[0]
            out[dim] += e["count"] * lat + e["bytes"] / bw
            continue
        k = m if dim == "intra" else g
        bw, lat = _link_for(dim, n, m, cluster).cost(kind)
        hops = 2 * (k - 1) if kind == "all_reduce" else k - 1
        out[dim] += e["count"] * hops * lat + e["bytes"] / bw
    return out


def _ttime(t: Traffic, cluster: Cluster) -> float:
    return sum(traffic_time(t, cluster).values())


def _flops_per_token(spec: ModelSpec, seq_len: int, checkpoint: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs per token; see the module docstring."""
    L, h = spec.n_layers, spec.dim
    mm = L * spec.layer_matmul + spec.root_matmul
    mm_t = spec.trainable_layers * spec.layer_matmul + (spec.root_matmul if spec.root_trainable else 0)
    attn = 4 * L * seq_len * h
    fwd = 2 * mm + attn
    bwd = 2 * mm + 2 * mm_t + 2 * attn
    if checkpoint:
        bwd += 2 * L * spec.layer_matmul + attn
    return float(fwd), float(bwd)


def predict(
    model: Union[str, LlamaArgs, ModelSpec],
    strategy: StrategyLike,
    n: int,
    m: int,
    micro_batch: int,
    grad_accum: int,
    seq_len: int,
    cluster: Cluster,
    trainable_fraction: float = 1.0,
    dtype: str = "bf16",
    reduce_dtype: Optional[str] = None,
    activation_checkpoint: str = "none",
    reshard_after_forward: bool = True,
    accumulate_dtype: Optional[str] = "fp32",
) -> Prediction:
    """Predicted memory and step time of one strategy (see the module docstring for the model).

    ``activation_checkpoint``: "none", "full" or "auto" (full only if needed to fit).
    ``dtype`` / ``reduce_dtype``: parameter / gradient dtype (bf16, fp16, fp32);
    ``accumulate_dtype``: the G-level accumulator's (None: the reduce dtype)."""
    spec = model_spec(model, trainable_fraction) if not isinstance(model, ModelSpec) else model
    _check_sizes(n, m, micro_batch, grad_accum, seq_len)
    if activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
        raise AdvisorError(f"activation_checkpoint must be one of {ACTIVATION_CHECKPOINT_MODES}, got {activation_checkpoint!r}")
    for d in (dtype, reduce_dtype or dtype, accumulate_dtype or reduce_dtype or dtype):
        if d not in DTYPE_BYTES:
            raise AdvisorError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {d!r}")
    if activation_checkpoint == "auto":
        plain = predict(spec, strategy, n, m, micro_batch, grad_accum, seq_len, cluster, dtype=dtype,
                        reduce_dtype=reduce_dtype, activation_checkpoint="none",
                        reshard_after_forward=reshard_after_forward, accumulate_dtype=accumulate_dtype)
        if plain.fits:
            return plain
        return predict(spec, strategy, n, m, micro_batch, grad_accum, seq_len, cluster, dtype=dtype,
                       reduce_dtype=reduce_dtype, activation_checkpoint="full",
                       reshard_after_forward=reshard_after_forward, accumulate_dtype=accumulate_dtype)
    ckpt = activation_checkpoint == "full"
    s = Strategy.parse(strategy)
    pb, gb = DTYPE_BYTES[dtype], DTYPE_BYTES[reduce_dtype or dtype]
    A = grad_accum
    bks = buckets(spec, s, reshard_after_forward)

    # ---- memory ---------------------------------------------------------------------------
    ab = DTYPE_BYTES[accumulate_dtype or reduce_dtype or dtype]
    mem = memory_of(bks, n, m, pb, ab, OS_BYTES)
    states = mem.pop("total")
    if s.p == _N:
        gathered = 0.0
    elif reshard_after_forward:
        gathered = pb * (spec.root + min(2, spec.n_layers) * spec.layer)
    else:
        gathered = pb * spec.psi
    grad_work = 2 * spec.layer * max(pb, gb) if spec.psi_trainable else 0.0
    acts = activation_bytes(spec, micro_batch, seq_len, pb, ckpt)["peak"]
    memory = {**mem, "states": states, "gathered": gathered, "grad_work": grad_work, "activations": acts,
              "total": states + mem["master_grads"] + gathered + grad_work + acts}

    # ---- traffic (exact, from the ledger) ----------------------------------------------------
    traffic = traffic_of(bks, n, m, A, pb, gb)
    boundary = traffic_of(bks, n, m, 0, pb, gb)  # A = 0: only the once-per-step collectives

    def gather_time(b: Bucket) -> float:
        t = Traffic(n, m)
        if s.p != _N:
            t.all_gather(s.p, b.numel, pb)
        return _ttime(t, cluster)

    def reduce_time(b: Bucket) -> float:
        t = Traffic(n, m)
        if b.trainable:
            t.reduce_scatter(s.g, b.trainable, gb)
        return _ttime(t, cluster)

    root_b, layers_b = bks[0], bks[1:]
    g_root, g_layer = gather_time(root_b), gather_time(layers_b[0]) if layers_b else 0.0
    regather = layers_b[0].gathers == 2 if layers_b else False
    fwd_all = sum(gather_time(b) for b in bks)
    fwd_first = g_root + g_layer
    bwd_gathers = (len(layers_b) * g_layer) if regather else 0.0
    bwd_first = g_layer if regather else 0.0
    reductions = [reduce_time(b) for b in bks]
    # backward finishes with the root's reduction (its embedding gradient comes last), or, when
    # the root is frozen, with the earliest trainable layer's
    last_red = reductions[0] if root_b.trainable else (reductions[1] if len(reductions) > 1 else 0.0)
    bwd_all = bwd_gathers + sum(reductions)

    fwd_flops, bwd_flops = _flops_per_token(spec, seq_len, ckpt)
    tokens = micro_batch * seq_len
    rate = cluster.achieved_tflops * 1e12
    c_fwd, c_bwd = fwd_flops * tokens / rate, bwd_flops * tokens / rate
    phi = cluster.overlap
    exp_fwd = fwd_first + max(0.0, fwd_all - fwd_first - phi * c_fwd)
    exp_bwd = bwd_first + last_red + max(0.0, bwd_all - bwd_first - last_red - phi * c_bwd)
    t_boundary = _ttime(boundary, cluster)
    os_shard = spec.psi_trainable / s.os.divisor(n, m)
    t_opt = os_shard * (28 + gb) / (cluster.memory_bandwidth_gbs * GB)
    step = A * (c_fwd + c_bwd + exp_fwd + exp_bwd) + t_boundary + t_opt
    return Prediction(
        strategy=s.name, known_as=s.known_as, step_time=step, tokens_per_step=n * A * tokens,
        compute=A * (c_fwd + c_bwd), exposed_comm=A * (exp_fwd + exp_bwd) + t_boundary, optimizer=t_opt,
        comm_total=A * (fwd_all + bwd_all) + t_boundary, memory=memory,
        fits=memory["total"] <= cluster.usable_bytes, activation_checkpoint=ckpt, traffic=traffic,
        breakdown={"compute_fwd": c_fwd, "compute_bwd": c_bwd, "exposed_fwd": exp_fwd, "exposed_bwd": exp_bwd,
                   "comm_fwd": fwd_all, "comm_bwd": bwd_all, "boundary": t_boundary, "optimizer": t_opt},
    )


def rank_strategies(
    model: Union[str, LlamaArgs, ModelSpec],
    n: int,
    m: int,
    micro_batch: int,
    grad_accum: int,
    seq_len: int,
    cluster: Cluster,
    trainable_fraction: float = 1.0,
    dtype: str = "bf16",
    reduce_dtype: Optional[str] = None,
    activation_checkpoint: str = "auto",
    reshard_after_forward: bool = True,
    strategies: Optional[Iterable[StrategyLike]] = None,
) -> list[Prediction]:
    """Every strategy's prediction, ranked: those that fit by step time, then the OOM ones."""
    spec = model_spec(model, trainable_fraction) if not isinstance(model, ModelSpec) else model
    names = [Strategy.parse(x).name for x in (strategies or ALL_STRATEGIES)]
    preds = [predict(spec, x, n, m, micro_batch, grad_accum, seq_len, cluster, dtype=dtype,
                     reduce_dtype=reduce_dtype, activation_checkpoint=activation_checkpoint,
                     reshard_after_forward=reshard_after_forward) for x in names]
    return sorted(preds, key=lambda p: (not p.fits, p.step_time, p.memory["total"]))


def format_table(preds: Sequence[Prediction], cluster: Optional[Cluster] = None, header: str = "") -> str:
    """The ranked predictions as a fixed-width table (the advisor's output). Memory in GiB and
    traffic in GB per GPU per step, or MiB / MB when the model is too small to read in those."""
    base = next((p for p in preds if p.strategy == "GGG"), None)
    big_mem = max((p.memory["total"] for p in preds), default=0) >= GiB / 8
    big_comm = max((p.intra_bytes + p.inter_bytes for p in preds), default=0) >= GB / 8
    mu, ms = ("GiB", GiB) if big_mem else ("MiB", 2**20)
    cu, cs = ("GB", GB) if big_comm else ("MB", 1e6)
    lines = [header] if header else []
    head = (f"{'#':>2} {'strat':5} {'known as':16} {'step s':>8} {'tokens/s':>10} {'vs GGG':>7} {'mem ' + mu:>8} "
            f"{'fits':>4} {'AC':>2} {'intra ' + cu:>9} {'inter ' + cu:>9} {'exposed':>8} {'compute':>8}")
    lines += [head, "-" * len(head)]
    for i, p in enumerate(preds, 1):
        vs = f"{base.step_time / p.step_time:6.2f}x" if base else "   -   "
        lines.append(
            f"{i:>2} {p.strategy:5} {p.known_as[:16]:16} {p.step_time:8.3f} {p.tokens_per_s:10.0f} {vs:>7} "
            f"{p.memory['total'] / ms:8.1f} {'yes' if p.fits else 'OOM':>4} {'on' if p.activation_checkpoint else '-':>2} "
            f"{p.intra_bytes / cs:9.2f} {p.inter_bytes / cs:9.3f} {p.exposed_comm:8.3f} {p.compute:8.3f}")
    if cluster is not None:
        lines.append(f"(memory: model states + gathered params + grad working set + activations; fits = at most "
                     f"{cluster.usable_bytes / GiB:.1f} GiB = {cluster.usable_memory_fraction:.0%} of {cluster.memory_gib:g} GiB; "
                     f"{cu} sent per GPU per step; exposed = communication not hidden behind compute, s/step; "
                     f"AC = activation checkpointing)")
    return "\n".join(lines)


def choose_strategy(
    model_args: Union[str, LlamaArgs, ModelSpec],
    n: int,
    m: int,
    micro_batch: int,
    grad_accum: int,
    seq_len: int,
    dtype: str,
    cluster: Union[Cluster, str, os.PathLike],
    trainable_fraction: float = 1.0,
    reduce_dtype: Optional[str] = None,
    activation_checkpoint: str = "none",
    reshard_after_forward: bool = True,
    strategies: Optional[Iterable[StrategyLike]] = None,
) -> tuple[Strategy, str]:
    """The fastest strategy that fits, and the ranked table to log (the trainer's ``auto``).

    ``activation_checkpoint``/``reshard_after_forward``: what the run will actually do (the
    trainer passes its config; "auto" is not used there). Raises :class:`AdvisorError` when no
    candidate fits, naming the smallest memory need."""
    c = load_cluster(cluster) if not isinstance(cluster, Cluster) else cluster
    spec = model_spec(model_args, trainable_fraction) if not isinstance(model_args, ModelSpec) else model_args
    preds = rank_strategies(spec, n, m, micro_batch, grad_accum, seq_len, c, trainable_fraction, dtype,
                            reduce_dtype, activation_checkpoint, reshard_after_forward, strategies)
    size = f"{spec.psi / 1e9:.3f} B" if spec.psi >= 1e8 else f"{spec.psi / 1e6:.3f} M"
    header = (f"advisor: {spec.name} ({size} params, {spec.psi_trainable / spec.psi:.1%} trainable), "
              f"{n} GPUs = {n // m} groups x {m}, micro-batch {micro_batch} x {seq_len} tokens, {grad_accum} micro-steps, "
              f"{dtype}/{reduce_dtype or dtype}, cluster {c.name}")
    table = format_table(preds, c, header)
    best = preds[0]
    if not best.fits:
        small = min(preds, key=lambda p: p.memory["total"])
        raise AdvisorError(f"no strategy fits in {c.usable_bytes / GiB:.1f} GiB per GPU: the smallest, {small.strategy}, "
                           f"needs {small.memory['total'] / GiB:.1f} GiB (try activation checkpointing, a smaller "
                           f"micro-batch or more GPUs)\n{table}")
    return Strategy.parse(best.strategy), table


# ---------------------------------------------------------------------------------------------
# Calibration on a real mesh (every rank calls it; all get the same Cluster)
# ---------------------------------------------------------------------------------------------
def _fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Fit time = a + bytes / bw to (bytes, seconds) points, least squares in *relative* error
    (so the small messages set the latency and the large ones the bandwidth); returns
    (bw in bytes/s, a in s) with a >= 0 and bw > 0."""
    pts = [(x, y) for x, y in points if y > 0]
    if not pts:
        raise ValueError("no positive timings to fit")
    if len(pts) == 1 or max(x for x, _ in pts) == min(x for x, _ in pts):
        x, y = max(pts)
        return x / y, 0.0
    # minimise sum(((a + s x) / y - 1)^2): normal equations in (a, s) with u = 1/y, v = x/y
    suu = sum(1 / y**2 for _, y in pts)
    svv = sum((x / y) ** 2 for x, y in pts)
    suv = sum(x / y**2 for x, y in pts)
    su = sum(1 / y for _, y in pts)
    sv = sum(x / y for x, y in pts)
    det = suu * svv - suv**2
    a = (su * svv - sv * suv) / det
    slope = (suu * sv - suv * su) / det
    if slope <= 0:  # noise dominates: the largest message's throughput, the smallest's time
        return max(pts)[0] / max(pts)[1], min(pts)[1]
    if a < 0:  # no measurable latency: a line through the origin, relative least squares
        return sum((x / y) ** 2 for x, y in pts) / sum(x / y for x, y in pts), 0.0
    return 1.0 / slope, a


def calibrate_in_process(
    mesh: Any,
    model_args: Optional[Union[str, LlamaArgs]] = None,
    micro_batch: int = 1,
    seq_len: int = 128,
    dtype: str = "bf16",
    sizes_mib: Optional[Sequence[float]] = None,
    reps: int = 3,
    name: str = "calibrated",
) -> Cluster:
    """Measure the mesh this process belongs to and return a :class:`Cluster`.

    Collective: every rank of ``mesh`` (the PaRO ("inter", "intra") mesh) must call it. For each
    mesh dimension of size > 1 and each of all-gather / reduce-scatter / all-reduce, times
    ``reps`` calls at several buffer sizes (every group of the dimension runs at once, as in
    training; the fastest call counts), fits time = hops x latency + ring bytes / bandwidth, and keeps the slowest rank's
    numbers; measures matmul FLOP/s, a transformer block's forward + backward at
    ``model_args``' shape (the ``achieved_tflops`` the advisor uses), memory bandwidth (an
    in-place add), and how much a collective overlaps with compute. All ranks agree on the result
    (max-reduced). ``gpus_per_node`` is set to the intra size, so the intra dimension maps to the
    ``intra`` link."""
    import torch
    import torch.distributed as dist

    from .models.llama import TransformerBlock, rope_tables

    # the non-deprecated names where this torch has them (same c10d collectives)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    info_dims = {d: mesh.get_group(d) for d in ("intra", "inter")}
    sizes = {d: dist.get_world_size(grp) for d, grp in info_dims.items()}
    m, g = sizes["intra"], sizes["inter"]
    device = mesh.device_type
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if sizes_mib is None:
        sizes_mib = (0.0625, 1, 8, 64) if device == "cuda" else (0.0625, 0.5, 2, 8)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, r: int) -> float:
        """The fastest of ``r`` timed calls after a warm-up: the figure least disturbed by other
        work on a shared machine (a collective's figure is then the slowest rank's)."""
        fn()
        sync()
        ts = []
        for _ in range(r):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    def slowest(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu().tolist()

    measured: dict[str, Any] = {"ranks": m * g, "intra_size": m, "inter_size": g, "backend": dist.get_backend(),
                                "device": device, "sizes_mib": list(sizes_mib)}
    links: dict[str, Link] = {}
    for d in ("intra", "inter"):
        k, grp = sizes[d], info_dims[d]
        if k == 1:
            continue
        per_kind: dict[str, tuple[float, float]] = {}
        for kind in KINDS:
            raw: list[float] = []
            ring: list[float] = []
            for mib in sizes_mib:
                numel = max(k, int(mib * 2**20 / 4) // k * k)  # fp32 elements, divisible by k
                full = torch.ones(numel, device=dev)
                shard = torch.ones(numel // k, device=dev)
                if kind == "all_gather":
                    fn = lambda: all_gather(full, shard, group=grp)  # noqa: E731
                elif kind == "reduce_scatter":
                    fn = lambda: reduce_scatter(shard, full, group=grp)  # noqa: E731
                else:
                    fn = lambda: dist.all_reduce(full, group=grp)  # noqa: E731
                dist.barrier()
                raw.append(timed(fn, reps))
                per = numel * 4 * (k - 1) / k
                ring.append(2 * per if kind == "all_reduce" else per)
            times = slowest(raw)
            bw, a = _fit_alpha_beta(list(zip(ring, times)))
            hops = 2 * (k - 1) if kind == "all_reduce" else k - 1
            per_kind[kind] = (bw / GB, a / hops * 1e6)
            measured[f"{d}_{kind}_seconds"] = [round(t, 7) for t in times]
        default_bw, default_lat = per_kind["all_gather"]
        links[d] = Link(default_bw, default_lat, {kd: v for kd, v in per_kind.items() if v != (default_bw, default_lat)})
    for d, other in (("intra", "inter"), ("inter", "intra")):
        measured[f"{d}_link"] = "measured" if d in links else (f"copied from {other}" if other in links else
                                                                "not measured (one rank): placeholder")
    if not links:  # a single rank: nothing to time; the advisor then sees communication as free
        links["intra"] = links["inter"] = Link(1e3, 0.0)
    links.setdefault("intra", links.get("inter"))
    links.setdefault("inter", links.get("intra"))

    # matmul FLOP/s, all ranks at once (they share the machine in training too)
    nmm = 4096 if device == "cuda" else 512
    a_ = torch.randn(nmm, nmm, device=dev, dtype=tdtype)
    b_ = torch.randn(nmm, nmm, device=dev, dtype=tdtype)
    dist.barrier()
    t_mm = timed(lambda: a_ @ b_, max(reps, 3))
    # a transformer block's forward + backward at the model's shape
    args = flavor(model_args) if isinstance(model_args, str) else (model_args or LlamaArgs(
        dim=256, n_layers=1, n_heads=4, ffn_dim=704, vocab_size=1024, max_seq_len=seq_len))
    torch.manual_seed(0)
    block = TransformerBlock(args).to(device=dev, dtype=tdtype)
    x = torch.randn(micro_batch, seq_len, args.dim, device=dev, dtype=tdtype, requires_grad=True)
    cos, sin = (t.to(dev) for t in rope_tables(args.dim // args.n_heads, seq_len, args.rope_theta))

    def block_step() -> None:
        block(x, cos, sin).float().sum().backward()

    dist.barrier()
    t_block = timed(block_step, max(reps, 3))
    spec1 = replace(model_spec(replace(args, n_layers=1)), vocab_size=0)
    f_fwd, f_bwd = _flops_per_token(replace(spec1, trainable_layers=1), seq_len, False)
    block_flops = (f_fwd + f_bwd) * micro_batch * seq_len
    # memory bandwidth: y += x reads 2 and writes 1 buffer
    nbw = (64 if device == "cuda" else 16) * 2**20
    xb, yb = torch.ones(nbw, device=dev), torch.ones(nbw, device=dev)
    dist.barrier()
    t_bw = timed(lambda: yb.add_(xb), max(reps, 3))
    # overlap: a collective on the widest dimension issued async while matmuls run
    d_ov = "inter" if g > 1 else ("intra" if m > 1 else None)
    overlap = 0.0
    if d_ov is not None:
        k, grp = sizes[d_ov], info_dims[d_ov]
        numel = int(sizes_mib[-1] * 2**20 / 4) // k * k
        full, shard = torch.ones(numel, device=dev), torch.ones(numel // k, device=dev)
        comm = lambda: all_gather(full, shard, group=grp)  # noqa: E731
        t_comm = timed(comm, reps)
        n_mm = max(1, int(round(t_comm / max(t_mm, 1e-9))))
        comp = lambda: [a_ @ b_ for _ in range(n_mm)]  # noqa: E731

        def both() -> None:
            work = all_gather(full, shard, group=grp, async_op=True)
            comp()
            work.wait()

        # interleaved rounds and medians: the three figures must come from the same conditions
        samples: dict[str, list[float]] = {"comm": [], "comp": [], "both": []}
        for _ in range(max(reps, 5)):
            for key, fn in (("comm", comm), ("comp", comp), ("both", both)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                sync()
                samples[key].append(time.perf_counter() - t0)
        t_comm, t_comp, t_both = (statistics.median(samples[k]) for k in ("comm", "comp", "both"))
        t_comm, t_comp, t_both = slowest([t_comm, t_comp, t_both])
        overlap = min(1.0, max(0.0, (t_comm + t_comp - t_both) / max(min(t_comm, t_comp), 1e-12)))
    t_mm, t_block, t_bw = slowest([t_mm, t_block, t_bw])
    if device == "cuda":
        mem_gib = torch.cuda.get_device_properties(dev).total_memory / GiB
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * GiB
        local = int(os.environ.get("LOCAL_WORLD_SIZE", m * g))
        mem_gib = total / GiB / max(1, local)
    measured.update(matmul_n=nmm, block_dim=args.dim, block_seq=seq_len, block_micro_batch=micro_batch,
                    block_seconds=round(t_block, 6), overlap_dim=d_ov or "-")
    return Cluster(
        name=name, gpus_per_node=m, memory_gib=round(mem_gib, 3), achieved_tflops=block_flops / t_block / 1e12,
        memory_bandwidth_gbs=3 * nbw * 4 / t_bw / GB, intra=links["intra"], inter=links["inter"],
        overlap=round(overlap, 3), usable_memory_fraction=0.9,
        description=f"measured by tools.calibrate on {m * g} ranks ({g} groups x {m}), {dist.get_backend()} on {device}",
        source="tools.calibrate", measured={**measured, "matmul_tflops": 2 * nmm**3 / t_mm / 1e12},
    )
