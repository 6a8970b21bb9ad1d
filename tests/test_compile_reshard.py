"""Blocks compiled one by one (the trainer's default compile scope, ``passes.compile_model``) keep
``reshard_after_forward``: the gather is recomputed in the block's backward graph and its whole
tensors are not saved for backward, as whole-model compile and the eager engine do.

``nn.Module.compile`` compiled ``_call_impl``, a frame dynamo skips, so the engine's pre-forward
hook and the block's forward were two graphs: the whole tensors were the first graph's outputs
and the second one's inputs, saved for its backward. Graphs: a one-block model on the fake
8-rank world (2 groups x 4), AOTAutograd's graphs run as they are (``passes.aot_backend``'s
min-cut partition, inductor's). Numerics: on 4 gloo ranks against the single-process reference.
"""
from __future__ import annotations

import os
from collections import Counter
from unittest import mock

import pytest
import torch

import passes
from dist_harness import run_world
from graph_runs import counting_backend
from paro_fsdp import init_paro_mesh, paro_shard
from paro_fsdp.models.llama import LlamaArgs
from paro_fsdp.train.config import JobConfig
from paro_fsdp.train.estimate import fake_mesh, release_fake_world
from paro_fsdp.train.parallelize import apply_activation_checkpointing
from workloads import adamw, batch, close, make_model, reference, train_steps

ONE = LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=32)
SIZES = {"intra": 4, "inter": 2}
P_DIMS = {"N": (), "I": ("intra",), "G": ("intra", "inter")}


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(8, 4)
    release_fake_world()


def recording_backend(record: passes.ParoPasses, runs: Counter):
    """``passes.aot_backend(record)`` that also counts how often each phase's graphs run."""
    def on_graph(phase, gm) -> None:
        record(gm.graph)
        gm.recompile()

    return counting_backend(runs, on_graph)


def _ring(stats: dict) -> dict[str, float]:
    return {k: v["bytes"] for k, v in stats.items() if v["bytes"]}


def _step(model) -> tuple[dict, dict, int]:
    """One forward and backward: the eager engine's ring bytes per kind/dim of each, and the
    bytes saved for backward (every tensor autograd packs, graphs' and eager ops' alike)."""
    stats = model.comm_stats()
    stats.reset()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch(0, 0, 0, ONE)).loss
    fwd = _ring(stats.as_dict())
    stats.reset()
    loss.backward()
    return fwd, _ring(stats.as_dict()), sum(saved)


_RUNS: dict = {}


def per_block(mesh, strategy: str, reshard: bool = True, ac: bool = False, torch_compile: bool = False) -> dict:
    """The second step of a fresh one-block model compiled by ``passes.compile_model`` (scope ``blocks``),
    or by torch's own ``block.compile()`` (``torch_compile``): the passes' record (no pass), how
    often each phase's graphs ran, the collectives the eager root ran, the bytes saved for
    backward. Shared by the tests that read it."""
    key = (strategy, reshard, ac, torch_compile)
    if key in _RUNS:
        return _RUNS[key]
    torch._dynamo.reset()
    model = make_model(args=ONE)
    cfg = JobConfig()
    if ac:
        apply_activation_checkpointing(model)
        cfg.activation_checkpoint.mode = "full"
    model = paro_shard(model, mesh, strategy, reshard_after_forward=reshard)
    record, runs = passes.ParoPasses([], meshes=[model.paro_mesh_groups()]), Counter()
    cfg.compile.backend = recording_backend(record, runs)
    # compile_model sets a dynamo option and a cache folder for the process: both undone after
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False), \
            mock.patch.dict(os.environ):
        if torch_compile == "model":
            model.compile(backend=cfg.compile.backend)
        elif torch_compile:
            for block in model.layers:
                block.compile(backend=cfg.compile.backend)
        else:
            passes.compile_model(model, (), push=False, backend=cfg.compile.backend, fullgraph=True)
        _step(model)  # compiles; the root, still eager, prefetched the block it did not know was traced
        runs.clear()
        fwd, bwd, saved = _step(model)
    whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
    _RUNS[key] = {"record": record, "runs": runs, "fwd": fwd, "bwd": bwd, "saved": saved, "whole": whole}
    return _RUNS[key]


def graph_ring(record: passes.ParoPasses, phase: str, what: str = "bytes") -> dict[str, float]:
    """Per kind/dim over ``phase``'s graphs: ring bytes per rank (as comm_stats counts), or counts."""
    out: dict[str, float] = {}
    for r in record.records:
        for e in r.before if r.phase == phase else ():
            key = f"{e.kind}/{e.dim}"
            n = SIZES[e.dim]
            out[key] = out.get(key, 0) + (e.nbytes * (n - 1) / n if what == "bytes" else 1)
    return out


def _sum(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


CASES = [("GGG", True), ("IGG", True), ("NGG", True), ("GGG", False)]


@pytest.mark.parametrize("strategy,reshard", [c if c != ("NGG", True) else
                                              pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
                         ids=[f"{s}-{'reshard' if r else 'keep'}" for s, r in CASES])
def test_per_block_compile_regathers_in_backward_as_eager(mesh, strategy, reshard):
    """With reshard_after_forward (P = I, G) the block's backward graph re-gathers; P = N and
    reshard_after_forward=False keep the whole tensors. Either way the step moves, per phase,
    kind and mesh dimension, the bytes the eager engine moves (graphs plus the eager root)."""
    run = per_block(mesh, strategy, reshard)
    regather = reshard and strategy[0] != "N"
    gathers = {k: v for k, v in graph_ring(run["record"], "backward", "count").items() if k.startswith("all_gather")}
    assert gathers == ({f"all_gather/{d}": 1 for d in P_DIMS[strategy[0]]} if regather else {})
    eager = paro_shard(make_model(args=ONE), mesh, strategy, reshard_after_forward=reshard)
    fwd, bwd, _ = _step(eager)
    assert _sum(graph_ring(run["record"], "forward"), run["fwd"]) == pytest.approx(fwd)
    assert _sum(graph_ring(run["record"], "backward"), run["bwd"]) == pytest.approx(bwd)


@pytest.mark.parametrize("strategy", ["GGG", pytest.param("IGG", marks=pytest.mark.slow)])
def test_torch_block_compile_keeps_the_strategy_memory(mesh, strategy):
    """torch's own ``block.compile()``, FSDP2's and torchtitan's recipe: the backward graph
    re-gathers as ``_compile_block``'s does, and the bytes moved and saved are the same."""
    ours, torchs = per_block(mesh, strategy), per_block(mesh, strategy, torch_compile=True)
    gathers = {k: v for k, v in graph_ring(torchs["record"], "backward", "count").items() if k.startswith("all_gather")}
    assert gathers == {f"all_gather/{d}": 1 for d in P_DIMS[strategy[0]]}
    assert _sum(graph_ring(torchs["record"], "backward"), torchs["bwd"]) == \
        pytest.approx(_sum(graph_ring(ours["record"], "backward"), ours["bwd"]))
    assert torchs["saved"] == ours["saved"]


def test_torch_model_compile_regathers_in_backward(mesh):
    """torch's own ``model.compile()``: the blocks' hooks are inlined in the model's graph, so
    their gathers are recomputed in backward (GGG: intra and inter), as per block."""
    run = per_block(mesh, "GGG", torch_compile="model")
    gathers = {k: v for k, v in graph_ring(run["record"], "backward", "count").items() if k.startswith("all_gather")}
    assert gathers == {"all_gather/intra": 1, "all_gather/inter": 1}
    assert run["saved"] < per_block(mesh, "GGG", reshard=False)["saved"]


def test_per_block_compile_saves_no_whole_parameters(mesh):
    """Resharded after forward, the block saves its P-level shard for backward, not its whole
    tensors: against the run that keeps them, at least the whole bytes less that shard less."""
    kept, resharded = per_block(mesh, "GGG", reshard=False), per_block(mesh, "GGG")
    assert kept["saved"] - resharded["saved"] >= resharded["whole"] * (1 - 1 / 8)


def test_checkpointed_block_compiles_the_checkpoint_into_its_graph(mesh):
    """Full activation checkpointing per block: the checkpoint is inside the block's graph, so
    the forward graph runs once per step and backward gathers once, for the recomputation (an
    eager checkpoint around the compiled block re-ran its forward graph in backward too)."""
    run = per_block(mesh, "GGG", ac=True)
    assert run["runs"]["forward"] == 1 and run["runs"]["backward"] == 1
    assert {k: v for k, v in graph_ring(run["record"], "backward", "count").items() if k.startswith("all_gather")} \
        == {"all_gather/intra": 1, "all_gather/inter": 1}
    assert run["saved"] < per_block(mesh, "GGG")["saved"]


# ---- numerics on 4 real ranks -------------------------------------------------------------------
def train_per_block(case: tuple[str, bool]) -> dict:
    """``(strategy, ac)``: 3 steps of the one-block model compiled by ``passes.compile_model`` per block (on a rank)."""
    strategy, ac = case
    torch._dynamo.reset()  # before paro_shard: the reset drops the callback that makes its sinks
    model = make_model(args=ONE)
    cfg = JobConfig()
    if ac:
        apply_activation_checkpointing(model)
        cfg.activation_checkpoint.mode = "full"
    model = paro_shard(model, init_paro_mesh(2), strategy)
    opt = adamw(model)
    record = passes.ParoPasses([], meshes=[model.paro_mesh_groups()])
    cfg.compile.backend = passes.aot_backend(record)
    passes.compile_model(model, (), push=False, backend=cfg.compile.backend, fullgraph=True)
    losses = train_steps(model, opt, 3)  # its batches (TINY's) fit ONE: the same vocabulary
    return {"losses": losses, "regathered": any(e.kind == "all_gather" for r in record.records
                                                 if r.phase == "backward" for e in r.before)}


@pytest.mark.parametrize("ac", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["GGG", "GGG-ac"])
def test_per_block_compile_matches_reference(ac):
    got = run_world(4, "test_compile_reshard:train_per_block", ("GGG", ac))[0]
    assert got["regathered"]
    close(got["losses"], reference(4, 1, ONE)["losses"])
