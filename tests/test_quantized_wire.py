"""Quantized inter-group collectives (``MixedPrecision.inter_dtype``, quantize.py): the wire format,
the plan's marks, the ledger's count, and training on 4 real gloo ranks (2 groups of 2) through
every inter path of the engine, against the exact single-process reference and the ledger."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_harness import run_world
from paro_fsdp import ALL_STRATEGIES, MixedPrecision, init_paro_mesh, paro_shard
from paro_fsdp.collectives import HIER, QBLOCK, QUANTIZED, USED, CommStats, Dim, Kind, wire_bytes
from paro_fsdp.cost.ledger import Bucket, traffic_of
from paro_fsdp.plan import plan_of
from paro_fsdp.quantize import pack, unpack
from workloads import batch, full_params, make_model, reference, train_paro

pytestmark = pytest.mark.compat  # torch 2.11's functional all-to-all and gloo's alltoall too (make test-compat)

# every inter path: P=G gather (GGG, GNN), G=G reduce-scatter (GGG, IGG), inter reduce-scatter at the
# boundary (IIG), inter all-reduce (NII, NIN), global all-reduce (NNN), global / inter all-gather of
# gradients at the boundary (NGN, NGI) and of the push (NNG, IIG)
STRATEGIES = ["GGG", "IGG", "IIG", "NII", "NNN", "NNG", "NGN", "NGI", "GNN", "NIN"]


# ---- the wire format --------------------------------------------------------------------------------

@pytest.mark.parametrize("wire,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_a_round_trip_is_within_half_a_step_of_each_block(wire, levels, numel):
    torch.manual_seed(0)
    rows = torch.randn(3, numel) * torch.tensor([[1.0], [1e-3], [0.0]])  # a row of zeros stays zeros
    buf = pack(rows, wire)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * wire_bytes(wire, numel)
    back = unpack(buf.view(-1), 3, numel, wire, torch.float32)
    for r in range(3):
        for a in range(0, numel, QBLOCK):
            block = rows[r, a:a + QBLOCK]
            step = block.abs().max() / levels
            assert (back[r, a:a + QBLOCK] - block).abs().max() <= step / 2 * (1 + 1e-6) + 1e-12
    assert back[2].eq(0).all()
    assert unpack(pack(rows.bfloat16(), wire).view(-1), 3, numel, wire, torch.bfloat16).dtype == torch.bfloat16


def test_int8_is_at_least_3_5x_fewer_bytes_than_fp32():
    assert 4 * 4096 / wire_bytes("int8", 4096) >= 3.5 and 4 * 4096 / wire_bytes("int4", 4096) >= 7


# ---- the plan and the ledger ------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_the_plan_marks_every_move_that_crosses_groups(strategy):
    exact, q8, q4 = plan_of(strategy), plan_of(strategy, "int8"), plan_of(strategy, "int4")
    for phase in ("gather", "reduce", "boundary", "push"):
        for m, m8, m4 in zip(exact.phase(phase), q8.phase(phase), q4.phase(phase)):
            crosses = m.dim != Dim.INTRA
            assert m.wire is None and (m8.kind, m8.dim) == (m.kind, m.dim)
            assert m8.wire == ("int8" if crosses else None)
            assert m4.wire == (("int8" if phase in ("gather", "push") else "int4") if crosses else None)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_the_ledger_counts_the_quantized_collectives(strategy):
    """Each quantized inter phase is counted as the collectives it runs, on int8 bytes."""
    plan = plan_of(strategy, "int8")
    stats = traffic_of([Bucket(plan.strategy, 4096, 4096, gathers=1)], n=4, m=2, inter_dtype="int8")
    exact = traffic_of([Bucket(plan.strategy, 4096, 4096, gathers=1)], n=4, m=2, param_bytes=4, grad_bytes=4)
    want = CommStats()
    for m in plan.gather + plan.reduce + plan.boundary + plan.push:
        for kind, dim in (HIER[m.kind] if m.dim == Dim.GLOBAL else [(m.kind, m.dim)]):
            for k in (QUANTIZED[kind] if dim == Dim.INTER else (kind,)):
                want.record(k, dim, 0)
    assert {k: v["count"] for k, v in stats.as_dict().items()} == {k: v["count"] for k, v in want.as_dict().items()}
    if exact.bytes(dim=Dim.INTER):
        assert exact.bytes(dim=Dim.INTER) / stats.bytes(dim=Dim.INTER) == pytest.approx(4 * QBLOCK / (QBLOCK + 4))
    assert stats.bytes(dim=Dim.INTRA) == pytest.approx(exact.bytes(dim=Dim.INTRA) / 2)  # param_bytes=2 (default)


def test_bad_wire_names_the_choices():
    with pytest.raises(ValueError, match=r"inter_dtype must be one of \['int4', 'int8'\]"):
        MixedPrecision(inter_dtype="fp8")
    with pytest.raises(ValueError, match="inter_dtype must be one of"):
        plan_of("GGG", "int2")


# ---- training on 4 gloo ranks ----------------------------------------------------------------------

def _aligned_model() -> nn.Module:
    """Blocks whose every piece on the wire is a whole number of scale blocks (4096-element
    tensors: 1024 a rank at G), so the engine's bytes equal the ledger's to the byte."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh()) for _ in range(3)))


def rank_main(payload: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    probe = batch(0, 99, 0)  # one input, alike on every rank
    for strategy in payload["strategies"]:
        for wire in ("int8", "int4"):
            model, _, losses = train_paro(strategy, 2, 3, mp=MixedPrecision(inter_dtype=wire))
            with torch.no_grad():
                logits = model(probe).logits
            out[(strategy, wire)] = {"losses": losses, "params": full_params(model), "logits": logits}
    for how in (None, {"scope": "blocks", "backend": "aot", "passes": []}):  # the compiled path: the same wire
        _, _, losses = train_paro("GGG", 2, 2, mp=MixedPrecision(inter_dtype="int8"), compile=how)
        out[("compiled" if how else "eager", "GGG")] = losses
    mesh = init_paro_mesh(2)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    for strategy in payload["strategies"]:
        for wire in (None, "int8"):
            model = _aligned_model()
            model = paro_shard(model, mesh, strategy, mp=MixedPrecision(inter_dtype=wire), blocks=list(model))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model.comm_stats().reset()
            for a in range(2):
                model.set_requires_gradient_sync(a == 1)
                model(x).square().mean().backward()
            opt.step()
            model.wait_for_params()  # the push lands
            out[(strategy, "bytes", wire)] = model.comm_stats().as_dict()
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(4, rank_main, {"strategies": STRATEGIES})


@pytest.fixture(scope="module")
def ref():
    return reference(4, 3)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("wire,rtol,drift", [("int8", 5e-4, 0.25), ("int4", 1e-3, 0.6)])
def test_training_through_a_quantized_wire_stays_close_to_exact(world, ref, strategy, wire, rtol, drift):
    """Every rank computes with the same values (each replica of a tensor dequantized alike), the
    losses stay within ``rtol`` of the exact run's (measured: int8 <= 7e-5, int4 <= 2e-4), and the
    parameters' distance from the exact run's is a fraction of how far training moved them (int8
    <= 0.11, int4 <= 0.43: AdamW's normalised steps magnify a small gradient's error)."""
    results = [r[(strategy, wire)] for r in world]
    for r in results[1:]:
        assert torch.equal(r["logits"], results[0]["logits"]), "ranks compute with different weights"
    for (loss, _), (ref_loss, _) in zip(results[0]["losses"], ref["losses"]):
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (loss, ref_loss)
    init = dict(make_model().named_parameters())
    off = sum((results[0]["params"][n] - ref["params"][n]).abs().sum().item() for n in ref["params"])
    moved = sum((ref["params"][n] - init[n].detach()).abs().sum().item() for n in ref["params"])
    assert off < drift * moved, off / moved


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_engine_sends_what_the_ledger_counts(world, strategy):
    """Counted from what ran: the same collectives as the ledger with the wire, to the byte, and
    every inter phase 3.94x fewer bytes than in fp32; inside a group nothing changes."""
    got = world[0][(strategy, "bytes", "int8")]
    exact = world[0][(strategy, "bytes", None)]
    plan = plan_of(strategy)
    buckets = [Bucket(plan.strategy, 4096, 4096, gathers=0 if plan.params_whole else 2, tensors=1) for _ in range(3)]
    want = traffic_of(buckets, 4, 2, grad_accum=2, param_bytes=4, grad_bytes=4, inter_dtype="int8").as_dict()
    assert got == want
    inter = sum(v["bytes"] for k, v in got.items() if k.endswith("/inter"))
    inter_exact = sum(v["bytes"] for k, v in exact.items() if k.endswith("/inter"))
    assert inter_exact / inter == pytest.approx(4 * QBLOCK / (QBLOCK + 4))
    assert {k: v for k, v in got.items() if not k.endswith("/inter")} == \
        {k: v for k, v in exact.items() if not k.endswith("/inter")}
    assert any(k.startswith(Kind.ALL_TO_ALL) for k in got) == any(
        m.kind != Kind.ALL_GATHER for p in ("reduce", "boundary") for m in plan.phase(p) if m.dim != Dim.INTRA)


def test_fully_shard_and_paro_shard_take_the_wire():
    """``fully_shard(inter_dtype=)`` (torch's MixedPrecisionPolicy has no field for it) and
    ``MixedPrecision(inter_dtype=)`` reach each group's plan; a bad name is refused in one line."""
    from paro_fsdp import fully_shard
    from paro_fsdp.train.estimate import fake_mesh, release_fake_world

    mesh = fake_mesh(4, 2)
    try:
        blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        fully_shard(blocks[0], mesh=mesh, strategy="IIG", inter_dtype="int4")
        fully_shard(blocks, mesh=mesh, strategy="GGG", inter_dtype="int8")
        wires = {g.strategy.name: {m.wire for ph in ("reduce", "boundary") for m in g.plan.phase(ph)}
                 for g in blocks._paro_state.groups}
        assert wires == {"IIG": {None, "int4"}, "GGG": {"int8"}}
        model = paro_shard(nn.Linear(8, 8), mesh, "NII", mp=MixedPrecision(inter_dtype="int8"))
        assert [m.wire for m in model._paro_state.groups[0].plan.boundary] == ["int8"]
        with pytest.raises(ValueError, match="inter_dtype must be one of"):
            fully_shard(nn.Linear(8, 8), mesh=mesh, inter_dtype="int16")
    finally:
        release_fake_world()


def test_the_advisor_prices_the_wire():
    """The cost model counts the quantized bytes: bf16 inter traffic 1.97x fewer, every other
    dimension alike, and the step no slower."""
    from paro_fsdp.cost.cluster import load_cluster
    from paro_fsdp.cost.predict import predict

    c = load_cluster("a100_ib")
    for s in ("GGG", "IIG", "NII"):
        exact, q = (predict("llama7b", s, 64, 8, 1, 4, 2048, c, inter_dtype=w) for w in (None, "int8"))
        assert exact.inter_bytes / q.inter_bytes == pytest.approx(2 * QBLOCK / (QBLOCK + 4), rel=1e-3)
        assert exact.intra_bytes == q.intra_bytes and q.step_time < exact.step_time
    with pytest.raises(ValueError, match="inter_dtype must be one of"):
        predict("llama7b", "GGG", 64, 8, 1, 4, 2048, c, inter_dtype="fp8")


def _expand(moves) -> list[tuple[str, str]]:
    """The collectives a phase runs: a global move as PaRO-CC's phases, a quantized inter one as
    ``QUANTIZED``'s collectives."""
    out = []
    for m in moves:
        for kind, dim in (HIER[m.kind] if m.dim == Dim.GLOBAL else [(m.kind, m.dim)]):
            out += [(k, dim) for k in QUANTIZED[kind]] if m.wire and dim == Dim.INTER else [(kind, dim)]
    return out


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_the_engine_runs_the_quantized_plan(strategy, monkeypatch):
    """All 27 strategies on one rank of a fake 2 x 2 world: two micro-steps, the step, the next
    forward issue exactly the quantized plan's collectives, in order."""
    from paro_fsdp.comm import MeshComm
    from paro_fsdp.train.estimate import fake_mesh, release_fake_world

    log: list[tuple[str, str]] = []
    count = MeshComm._count
    monkeypatch.setattr(MeshComm, "_count", lambda self, kind, dim, numel, t: (log.append((kind, dim)),
                                                                               count(self, kind, dim, numel, t)))
    mesh = fake_mesh(4, 2)
    try:
        model = paro_shard(nn.Linear(8, 8), mesh, strategy, mp=MixedPrecision(inter_dtype="int8"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8)
        log.clear()
        for sync in (False, True):
            model.set_requires_gradient_sync(sync)
            model(x).sum().backward()
        opt.step()
        model(x)
    finally:
        release_fake_world()
    plan = plan_of(strategy, "int8")
    g, r, b, p = (_expand(plan.phase(name)) for name in ("gather", "reduce", "boundary", "push"))
    assert log == g + r + g + r + b + [USED] + p + g, plan  # + which tensors were used


def test_a_compiled_model_sends_the_same_wire(world):
    """The traced path runs the eager path's moves (traced.py), the quantized ones included."""
    eager, compiled = world[0][("eager", "GGG")], world[0][("compiled", "GGG")]
    for (a, _), (b, _) in zip(eager, compiled):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
