"""torch.compile of paro_shard models, and the graph passes in passes/.

Graphs: in this process on a fake 8-rank world (2 groups x 4), compiled with
``passes.aot_backend`` (AOTAutograd's forward and backward graphs, the passes run on them, no
inductor codegen), so each case costs seconds. The fake group moves no data: these tests look at
the graphs only. One case goes through inductor itself, to show the passes run there.
Numerics: on 4 real gloo ranks (2 x 2), compiled training matches the single-process reference
as the eager engine does (losses, grad norms, final parameters; gradient accumulation, frozen
weights), with and without the passes, per block and whole model, with inductor for GGG.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import passes
from dist_harness import run_world
from paro_fsdp import ALL_STRATEGIES, paro_shard
from paro_fsdp.models.llama import LlamaArgs
from passes.graph import collectives
from tools.estimate import fake_mesh, release_fake_world
from workloads import ODD, TINY, batch, make_model, reference

# one strategy per (P level, G level) pair
PAIRS = ["NNN", "NII", "NGG", "III", "IGG", "GGG"]
THREE = LlamaArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, max_seq_len=32)
TWO_GROUPS = {"layers.*.attention.*": "IIG", "default": "IIN"}  # two groups per block, same dims


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(8, 4)
    release_fake_world()


def compile_step(mesh, policy, names=(), args=TINY, **options):
    """One forward and backward of a freshly sharded model compiled with the passes ``names``."""
    torch._dynamo.reset()
    counters.clear()
    model = paro_shard(make_model(args=args), mesh, policy)
    record = passes.ParoPasses(names, passes.PassOptions(**options))
    compiled = torch.compile(model, backend=passes.aot_backend(record))
    compiled(batch(0, 0, 0, args)).loss.backward()
    return record, model


def per_graph(record, phase, when="after"):
    """[{kind/dim: count}] for every graph of ``phase``."""
    return [passes.summary(getattr(r, when)) for r in record.records if r.phase == phase]


def totals(record, phase, when="after", what="count"):
    out: dict[str, float] = {}
    for r in record.records:
        if r.phase == phase:
            for e in getattr(r, when):
                key = f"{e.kind}/{e.dim}"
                out[key] = out.get(key, 0) + (1 if what == "count" else e.nbytes)
    return out


LEVEL_DIM = {"N": None, "I": "intra", "G": "global"}


@pytest.mark.parametrize("strategy", PAIRS)
def test_one_collective_per_block_and_phase_in_the_graph(mesh, strategy):
    record, model = compile_step(mesh, strategy)
    assert dict(counters["graph_break"]) == {}
    blocks = len(model._paro_state.blocks)
    p_dim, g_dim = LEVEL_DIM[strategy[0]], LEVEL_DIM[strategy[1]]
    expect_fwd = {f"all_gather/{p_dim}": blocks} if p_dim else {}
    expect_bwd = {f"reduce_scatter/{g_dim}": blocks} if g_dim else {}
    assert totals(record, "forward") == expect_fwd
    assert totals(record, "backward") == expect_bwd
    # every layer's collectives are in one graph (no break inside a block)
    layer_graphs = [r for r in record.records if any(e.block.endswith("layers.0") for e in r.before)]
    assert all(any(e.block.endswith("layers.1") for e in r.before) for r in layer_graphs)


@pytest.mark.parametrize("strategy", PAIRS)
def test_graph_bytes_per_dimension_equal_the_eager_engine(mesh, strategy):
    """After the hierarchical pass the graph moves, per mesh dimension, what the eager engine
    (PaRO-CC for global collectives) counts for one forward's gathers and one backward's
    reductions."""
    record, _ = compile_step(mesh, strategy, ["hierarchical"])
    graph = {**totals(record, "forward", what="bytes"), **totals(record, "backward", what="bytes")}
    ring = {}
    eager = paro_shard(make_model(), mesh, strategy)
    stats = eager.comm_stats()
    loss = eager(batch(0, 0, 0)).loss
    fwd = {k: v["bytes"] for k, v in stats.as_dict().items() if k.startswith("all_gather")}
    stats.reset()
    loss.backward()
    bwd = {k: v["bytes"] for k, v in stats.as_dict().items() if k.startswith("reduce_scatter")}
    sizes = {"intra": 4, "inter": 2}
    for key, nbytes in graph.items():  # graph events hold buffer bytes; the ledger ring bytes
        kind, dim = key.split("/")
        ring[key] = nbytes * (sizes[dim] - 1) / sizes[dim]
    assert ring == pytest.approx({**fwd, **bwd})


def test_hierarchical_pass_splits_global_collectives_into_chunks(mesh):
    record, _ = compile_step(mesh, "GGG", ["hierarchical"])
    before = {**totals(record, "forward", "before"), **totals(record, "backward", "before")}
    after = {**totals(record, "forward"), **totals(record, "backward")}
    assert before == {"all_gather/global": 3, "reduce_scatter/global": 3}
    assert after == {"all_gather/inter": 3, "all_gather/intra": 3, "reduce_scatter/inter": 3, "reduce_scatter/intra": 3}
    chunked, _ = compile_step(mesh, "GGG", ["hierarchical"], chunk_bytes=4096, max_chunks=4)
    counts = {**totals(chunked, "forward"), **totals(chunked, "backward")}
    assert all(counts[k] > after[k] for k in after)  # several chunks per collective
    assert {**totals(chunked, "forward", what="bytes"), **totals(chunked, "backward", what="bytes")} == \
        {**totals(record, "forward", what="bytes"), **totals(record, "backward", what="bytes")}


def test_bucketing_pass_merges_groups_of_a_block(mesh):
    record, model = compile_step(mesh, TWO_GROUPS, ["bucketing"])
    layers = len(model.layers)
    assert all(len(b.groups) == 2 for b in model._paro_state.blocks[1:])
    assert totals(record, "forward", "before") == {"all_gather/intra": 1 + 2 * layers}
    assert totals(record, "forward") == {"all_gather/intra": 1 + layers}
    assert totals(record, "backward", "before") == {"reduce_scatter/intra": 1 + 2 * layers}
    assert totals(record, "backward") == {"reduce_scatter/intra": 1 + layers}
    for r in record.records:  # one collective per block and kind
        keys = [(e.kind, e.block) for e in r.after]
        assert len(keys) == len(set(keys))


def _first(events, block, **match):
    return next(e for e in events if e.block.endswith(block) and all(getattr(e, k) == v for k, v in match.items()))


def test_reorder_pass_prefetches_and_overlaps(mesh):
    record, _ = compile_step(mesh, "GGG", list(passes.ORDER), args=THREE)
    fwd = next(r.after for r in record.records if r.phase == "forward" and any("layers.2" in e.block for e in r.after))
    for b in (1, 2):  # block b's gather is issued before block b-1's compute starts
        prev_first_wait = min(e.wait for e in fwd if e.block.endswith(f"layers.{b - 1}"))
        assert min(e.issue for e in fwd if e.block.endswith(f"layers.{b}")) < prev_first_wait
        assert _first(fwd, f"layers.{b}", dim="intra").overlap > 0  # its transfer runs under compute
    bwd = next(r.after for r in record.records if r.phase == "backward" and any("layers.2" in e.block for e in r.after))
    for b in (2, 1):  # a block's inter reduction follows its intra one and overlaps later blocks' backward
        intra, inter = _first(bwd, f"layers.{b}", dim="intra"), _first(bwd, f"layers.{b}", dim="inter")
        assert intra.wait < inter.issue <= intra.wait + 2
        assert inter.overlap > 0
    # before the passes nothing overlapped
    assert all(e.overlap == 0 for r in record.records for e in r.before)


@pytest.mark.parametrize("bound", [0, "one block"])
def test_reorder_respects_the_prefetch_memory_bound(mesh, bound):
    free, _ = compile_step(mesh, "III", ["reorder"], args=THREE)
    fwd = next(r for r in free.records if r.phase == "forward" and len(r.after) > 1)
    one = max(e.nbytes for e in fwd.after)
    limit = 0 if bound == 0 else one
    record, _ = compile_step(mesh, "III", ["reorder"], args=THREE, max_prefetch_bytes=limit)
    for r in record.records:
        if r.phase != "forward":
            continue
        gathers = [e for e in r.after if e.kind == "all_gather"]
        points = sorted({e.issue for e in gathers})
        peak = max(sum(e.nbytes for e in gathers if e.issue <= p < e.wait) for p in points)
        assert peak <= max(limit, one)
        if limit == 0:
            assert all(e.overlap == 0 for e in gathers)
    assert any(e.overlap > 0 for e in fwd.after)  # unbounded, the same graph does prefetch


def test_pass_registry_errors_uuid_and_dump(mesh, tmp_path):
    with pytest.raises(ValueError, match="unknown graph pass.*valid"):
        passes.ParoPasses(["bucketing", "reoder"])
    uuids = {passes.ParoPasses(n).uuid() for n in ([], ["bucketing"], ["bucketing", "reorder"])}
    uuids.add(passes.ParoPasses(["reorder"], passes.PassOptions(max_prefetch_bytes=1)).uuid())
    assert len(uuids) == 4
    assert passes.ParoPasses(["reorder", "bucketing"]).names == ["bucketing", "reorder"]  # fixed order
    installed = passes.install(["reorder"])
    try:
        assert torch._inductor.config.post_grad_custom_post_pass is installed
    finally:
        passes.uninstall()
    record, _ = compile_step(mesh, "IGG", list(passes.ORDER), dump_dir=str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {f.rsplit(".", 1)[1] for f in files} == {"txt", "json", "png"}
    assert len(files) == 3 * len(record.records)
    text = (tmp_path / files[-1].replace(".png", ".txt")).read_text()
    assert "before passes" in text and "after" in text


def test_passes_run_inside_inductor(mesh, monkeypatch):
    """The real thing once: inductor calls the installed passes on its post-grad graphs (caches
    off, since a cache hit would skip them)."""
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    torch._dynamo.reset()
    record = passes.install(list(passes.ORDER))
    try:
        model = paro_shard(make_model(), mesh, "GGG")
        torch.compile(model)(batch(0, 0, 0)).loss.backward()
    finally:
        passes.uninstall()
    assert {r.phase for r in record.records} == {"forward", "backward"}
    after = {k for r in record.records for k in passes.summary(r.after)}
    assert after == {"all_gather/inter", "all_gather/intra", "reduce_scatter/inter", "reduce_scatter/intra"}


# ---- numerics on 4 real ranks -------------------------------------------------------------------
ALL = list(passes.ORDER)
NUMERIC_CASES = (
    [(s, 2, {"passes": ALL}, "tiny") for s in PAIRS]
    + [("GGG", 2, {"passes": []}, "tiny"), ("GGG", 1, {"passes": ALL, "scope": "blocks"}, "tiny"),
       ("IIG", 2, {"passes": ALL, "ac": True}, "tiny"), ("TWO_GROUPS", 2, {"passes": ALL}, "tiny"),
       ("GGG", 1, {"passes": ALL, "options": {"chunk_bytes": 512, "max_chunks": 4}}, "odd"),
       ("GGG", 2, {"passes": ALL, "backend": "inductor"}, "tiny")]
)
NIGHTLY = [(s, 2, {"passes": ALL, "backend": "inductor"}, "tiny") for s in ALL_STRATEGIES]


def _case_id(case) -> str:
    s, a, how, model = case
    return f"{s}-A{a}-{how.get('backend', 'aot')}-{how.get('scope', 'model')}-{'+'.join(how['passes']) or 'nopasses'}" \
        f"{'-ac' if how.get('ac') else ''}{'-chunked' if 'options' in how else ''}-{model}"


def compiled_suite(cases: list) -> dict:
    from workloads import full_params, train_paro

    out = {}
    for case in cases:
        strategy, accum, how, model_name = case
        how = dict(how)
        ac = "outer" if how.pop("ac", False) else None
        policy = TWO_GROUPS if strategy == "TWO_GROUPS" else strategy
        counters.clear()
        model, _, losses = train_paro(policy, 2, accum, ac=ac, args=ODD if model_name == "odd" else TINY, compile=how)
        out[_case_id(case)] = {"losses": losses, "params": full_params(model),
                               "breaks": dict(counters["graph_break"]),
                               "graphs": len(model.paro_passes_record.records)}
    return out


def _check(got: dict, ref: dict, strategy: str) -> None:
    assert got["breaks"] == {}
    assert (got["graphs"] > 0) == (strategy[:2] != "NN")  # the passes saw every graph with collectives
    for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm) + 1e-7, (norm, ref_norm)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.fixture(scope="module")
def refs():
    return {(a, m): reference(4, a, ODD if m == "odd" else TINY) for a in (1, 2) for m in ("tiny", "odd")}


@pytest.fixture(scope="module")
def numerics():
    return run_world(4, "test_compile:compiled_suite", NUMERIC_CASES)[0]


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=_case_id)
def test_compiled_training_matches_reference(numerics, refs, case):
    _check(numerics[_case_id(case)], refs[(case[1], case[3])], case[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", NIGHTLY, ids=_case_id)
def test_all_strategies_compiled_with_inductor(refs, case, nightly=[]):
    if not nightly:
        nightly.append(run_world(4, "test_compile:compiled_suite", NIGHTLY, timeout=7200)[0])
    _check(nightly[0][_case_id(case)], refs[(case[1], case[3])], case[0])
