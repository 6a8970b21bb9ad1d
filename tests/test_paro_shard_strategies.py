"""All 27 strategies on real gloo ranks: 4 ranks as 2 groups of 2 (every strategy, A = 1 and 3),
8 ranks as 2 groups of 4 and 4 groups of 2 (the named strategies; the slow set runs the whole
grid). Numerics against a single-process reference, every rank's parameters alike, DTensor
placements at the P level, communication against the spec's ledger (and against torch.profiler's
records of the collectives actually dispatched), memory against its formula, activation
checkpointing, and the global collectives cut into PaRO-CC chunks on even and uneven shards.

Mixed precision, init, state dicts and the other paro_shard options have files of their own
(test_paro_shard_<feature>.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from paro_fsdp import ALL_STRATEGIES, Strategy
from paro_fsdp.cost.ledger import formula_bytes, formula_memory
from workloads import ODD, STEPS, TINY, batch, full_params, make_model, reference, train_paro

compat = pytest.mark.compat  # the 4-rank grid: make test-compat's 27 strategies

CASES = [(s, 2, a) for s in ALL_STRATEGIES for a in (1, 3)]
AC = [(s, 2, 3, "outer") for s in ("IIG", "GGG", "NIG", "ING")] + [(s, 2, 3, "wrapper") for s in ("IIG", "GGG")]
# every global (PaRO-CC) path of the engine: P=G gather (GGG, GNN), G=G reduce-scatter (GGG, NGN),
# G=N -> OS=G reduce-scatter (NNG, ING), G=N -> OS=N all-reduce (NNN, GNN), G -> N all-gather
# (NGN at the boundary, NNG for the params); cut into several chunks, on even and uneven shards
GLOBAL_PATHS = ["GGG", "NNG", "NNN", "NGN", "ING", "GNN"]
CHUNKED = [(s, 2, 3, 512, "tiny") for s in GLOBAL_PATHS] + [(s, 2, 1, 512, "odd") for s in GLOBAL_PATHS] \
    + [(s, 2, 1, None, "odd") for s in GLOBAL_PATHS]

# 8 ranks: the named strategies (every level of P, G and OS, every transition kind) with A = 3 on
# 2x4 (m > g: a wrong rank order cannot hide); the slow set runs the whole grid, 4x2 included
NAMED = ["NNN", "NNG", "NGG", "GGG", "III", "NIG", "IIG", "IGG", "ING"]
CASES_8 = [(s, 4, 3) for s in NAMED]  # 2x4 here; 4x2 and the rest: the slow grid
FULL_GRID_8 = [(s, m, a) for m in (4, 2) for s in ALL_STRATEGIES for a in (1, 3)]
PROFILED = [(s, 4, 2) for s in ("GGG", "IIG", "NIG", "IGG", "ING", "NNG")]  # 2x4: intra 4, inter 2


# ---- what each rank runs ----


def _trained(model, losses) -> dict[str, Any]:
    """Losses, final full parameters, and the ledger per step (bytes) and in all (counts)."""
    model.wait_for_params()  # the last step's push (else issued by the next forward)
    stats = model.comm_stats()
    return {
        "losses": losses,
        "params": full_params(model),
        "comm": {key: stats.bytes(*key.split("/")) / STEPS for key in stats.as_dict()},
        "counts": {key: stats.count(*key.split("/")) for key in stats.as_dict()},
    }


def train_cases(cases: list[tuple]) -> dict[tuple, dict[str, Any]]:
    """(strategy, group_size, accum[, activation checkpointing]) -> losses, final full params,
    comm ledger, memory."""
    out = {}
    for case in cases:
        strategy, group_size, accum, ac = (*case, None)[:4]
        model, opt, losses = train_paro(strategy, group_size, accum, ac=ac)
        out[case] = {
            **_trained(model, losses),
            "memory": model.memory_report(opt),
            "placements": {n: tuple(repr(p) for p in prm.placements) for n, prm in model.named_parameters()},
            "grad_free": [n for n, prm in model.named_parameters() if not prm.requires_grad],
        }
    return out


def chunked_cases(cases: list[tuple]) -> dict[tuple, dict[str, Any]]:
    """(strategy, group_size, accum, chunk_bytes, "tiny" | "odd"): the engine's global
    collectives cut into PaRO-CC chunks, on the tiny model or on one with uneven shards."""
    out = {}
    for case in cases:
        strategy, group_size, accum, chunk_bytes, model_name = case
        model, _, losses = train_paro(strategy, group_size, accum, args={"tiny": TINY, "odd": ODD}[model_name],
                                      chunk_bytes=chunk_bytes)
        out[case] = _trained(model, losses)
    return out


def profile_cases(cases: list[tuple[str, int, int]]) -> dict[tuple, dict[str, Any]]:
    """Count collectives from torch.profiler's records of the ops actually dispatched, beside
    the engine's own ledger, for one optimizer step. The mesh dimension is read from the
    group size, so use a mesh whose two dimensions differ in size."""
    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard

    kinds = {
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }
    out = {}
    for strategy, group_size, accum in cases:
        mesh = init_paro_mesh(group_size)
        g, m = mesh.size(0), mesh.size(1)
        dim_of = {m: "intra", g: "inter", g * m: "global"}
        model = paro_shard(make_model(), mesh, strategy)
        opt = ParoOptimizer(model, torch.optim.AdamW, lr=1e-3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            for a in range(accum):
                (model(batch(dist.get_rank(), 0, a)).loss / accum).backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            model.wait_for_params()  # the step's pushes, else the next forward finishes them
        seen: dict[str, float] = {}
        for e in prof.events():
            name = e.name.removeprefix("_c10d_functional::")
            if e.name.startswith("_c10d_functional::") and name in kinds:
                numel = 1
                for s in e.input_shapes[0]:
                    numel *= s
                # all_reduce records no group size: only the scalar grad-norm one (global) is expected
                k = {"all_gather_into_tensor": e.concrete_inputs[1], "reduce_scatter_tensor": e.concrete_inputs[2]}.get(
                    name, g * m if numel == 1 else 0
                )
                if k == 0:
                    seen["all_reduce/unknown"] = seen.get("all_reduce/unknown", 0.0) + 1
                    continue
                if name == "all_gather_into_tensor":
                    sent = numel * k * (k - 1) / k
                elif name == "reduce_scatter_tensor":
                    sent = numel * (k - 1) / k
                else:
                    sent = 2 * numel * (k - 1) / k
                key = f"{kinds[name]}/{dim_of[k]}"
                seen[key] = seen.get(key, 0.0) + 4 * sent  # fp32
        stats = model.comm_stats()
        out[(strategy, group_size, accum)] = {
            "profiler": seen,
            "engine": {key: stats.bytes(*key.split("/")) for key in stats.as_dict()},
        }
    return out


def grid(payload: dict[str, Any]) -> dict[str, Any]:
    """One world for the module: {"train": [...], "chunked": [...], "profile": [...]}."""
    out: dict[str, Any] = {}
    if "train" in payload:
        out["train"] = train_cases(payload["train"])
    if "chunked" in payload:
        out["chunked"] = chunked_cases(payload["chunked"])
    if "profile" in payload:
        out["profile"] = profile_cases(payload["profile"])
    return out


# ---- the checks ----


@pytest.fixture(scope="module")
def world_results():
    return run_world(4, grid, {"train": CASES + AC, "chunked": CHUNKED})


@pytest.fixture(scope="module")
def results(world_results):
    return [r["train"] for r in world_results]


@pytest.fixture(scope="module")
def results_8():
    return run_world(8, grid, {"train": CASES_8, "profile": PROFILED})[0]


@pytest.fixture(scope="module")
def refs():
    return {a: reference(4, a) for a in (1, 3)}


@pytest.fixture(scope="module")
def refs_8():
    return {a: reference(8, a) for a in (1, 3)}


@pytest.fixture(scope="module")
def odd_ref():
    return reference(4, 1, ODD)


def check_against_reference(got: dict, ref: dict) -> None:
    for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm) + 1e-7, (norm, ref_norm)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-5, msg=name)


def model_sizes() -> tuple[int, int, int, int]:
    """Psi, Psi', the root block's parameters (gathered once per micro-step) and the trainable tensors."""
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_blocks = sum(p.numel() for p in model.layers.parameters())
    return psi, trainable, psi - in_blocks, sum(p.requires_grad for p in model.parameters())


def check_ledger(got: dict, strategy: str, n: int, m: int, accum: int) -> None:
    from paro_fsdp.collectives import ring_bytes

    psi, trainable, kept, tensors = model_sizes()
    want = formula_bytes(strategy, psi, trainable, n, m, accum, psi_kept=kept, param_bytes=4, grad_bytes=4)
    want["global"] += ring_bytes("all_reduce", tensors, n)  # which tensors some rank used: a byte each, a step
    for dim in ("intra", "inter", "global"):
        measured = sum(v for key, v in got["comm"].items() if key.endswith("/" + dim))
        assert measured == pytest.approx(want[dim], rel=1e-12, abs=1e-9), (dim, measured, want[dim])


@compat
@pytest.mark.parametrize("strategy,group,accum", CASES, ids=[f"{s}-A{a}" for s, _, a in CASES])
def test_matches_reference(results, refs, strategy, group, accum):
    got = results[0][(strategy, group, accum)]
    check_against_reference(got, refs[accum])
    # every rank ends with the same parameters
    for other in results[1:]:
        for name, value in got["params"].items():
            torch.testing.assert_close(other[(strategy, group, accum)]["params"][name], value, rtol=0, atol=0)


@compat
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_parameters_are_dtensors_at_their_level(results, strategy):
    """FSDP2's contract: a trainable parameter is the optimizer's, a DTensor at its OS level; a
    frozen one (no optimizer state) is its only copy, at the P level."""
    got = results[0][(strategy, 2, 1)]["placements"]
    frozen = set(results[0][(strategy, 2, 1)]["grad_free"])
    assert frozen
    for name, placement in got.items():
        level = strategy[0] if name in frozen else strategy[2]
        if level == "G":
            assert placement[0].startswith("_StridedShard(dim=0") and placement[1] == "Shard(dim=0)", (name, placement)
        else:
            expected = {"N": ("Replicate()", "Replicate()"), "I": ("Replicate()", "Shard(dim=0)")}[level]
            assert placement == expected, (name, placement)


@compat
@pytest.mark.parametrize("strategy,group,accum", CASES, ids=[f"{s}-A{a}" for s, _, a in CASES])
def test_bytes_per_step_follow_the_ledger(results, strategy, group, accum):
    check_ledger(results[0][(strategy, group, accum)], strategy, 4, group, accum)


@compat
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_inter_bytes_do_not_grow_with_accumulation_when_p_and_g_stay_in_group(results, strategy):
    inter = {a: sum(v for k, v in results[0][(strategy, 2, a)]["comm"].items() if k.endswith("/inter")) for a in (1, 3)}
    s = Strategy.parse(strategy)
    if s.p.value in "NI" and s.g.value in "NI":
        assert inter[3] == inter[1] > 0
    else:
        assert inter[3] > inter[1]


@compat
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_one_collective_per_block_and_phase(results, strategy):
    """2 blocks + root, one strategy: each gather / reduction is one bucketed collective."""
    counts = results[0][(strategy, 2, 1)]["counts"]
    s = Strategy.parse(strategy)
    steps, blocks = 3, 2
    if s.p.value != "N":  # blocks gathered twice per micro-step, the root once
        assert counts["all_gather/intra"] >= steps * (2 * blocks + 1)
    if s.g.value == "G":
        assert counts["reduce_scatter/inter"] == steps * (blocks + 1)


@compat
@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_memory_follows_the_formula(results, strategy):
    psi, trainable, _, _ = model_sizes()
    want = formula_memory(strategy, psi, trainable, 4, 2, param_bytes=4, grad_bytes=4, os_bytes=12)
    got = results[0][(strategy, 2, 1)]["memory"]
    for key in ("P", "G", "OS", "total"):
        assert got[key] == want[key], (key, got[key], want[key])


@compat
@pytest.mark.parametrize("strategy,group,accum,where", AC, ids=[f"{s}-{w}" for s, _, _, w in AC])
def test_activation_checkpointing_is_exact(results, refs, strategy, group, accum, where):
    """Blocks recomputed in backward (the whole module call, engine hooks included) read the
    gathered parameters, free nothing early, and give the reference's numbers."""
    check_against_reference(results[0][(strategy, group, accum, where)], refs[accum])


@compat
@pytest.mark.parametrize(
    "case", CHUNKED, ids=[f"{s}-A{a}-{'c' + str(c) if c else 'unchunked'}-{mod}" for s, _, a, c, mod in CHUNKED]
)
def test_global_collectives_through_paro_cc_chunks_and_uneven_shards(world_results, refs, odd_ref, case):
    """Global collectives run as PaRO-CC chunks: same numbers as the reference, and (even
    shards) the same bytes as the spec's ledger; only the count of collectives grows."""
    strategy, group, accum, chunk_bytes, model_name = case
    got = world_results[0]["chunked"][case]
    check_against_reference(got, refs[accum] if model_name == "tiny" else odd_ref)
    if model_name == "tiny":
        check_ledger(got, strategy, 4, group, accum)
        unchunked = world_results[0]["train"][(strategy, group, accum)]["counts"]
        assert sum(got["counts"].values()) > sum(unchunked.values()), (got["counts"], unchunked)


IDS_8 = [f"{8 // m}x{m}-{s}-A{a}" for s, m, a in CASES_8]


@pytest.mark.slow  # the 8-rank world (2x4): make test-all; 2x2 runs all 27 here
@pytest.mark.parametrize("strategy,group,accum", CASES_8, ids=IDS_8)
def test_matches_reference_on_8_ranks(results_8, refs_8, strategy, group, accum):
    check_against_reference(results_8["train"][(strategy, group, accum)], refs_8[accum])


@pytest.mark.slow  # the 8-rank world (2x4): make test-all; 2x2 runs all 27 here
@pytest.mark.parametrize("strategy,group,accum", CASES_8, ids=IDS_8)
def test_bytes_per_step_follow_the_ledger_on_8_ranks(results_8, strategy, group, accum):
    check_ledger(results_8["train"][(strategy, group, accum)], strategy, 8, group, accum)


@pytest.mark.slow  # the 8-rank world (2x4): make test-all; 2x2 runs all 27 here
@pytest.mark.parametrize("strategy,group,accum", PROFILED, ids=[s for s, _, _ in PROFILED])
def test_profiler_sees_the_counted_collectives(results_8, strategy, group, accum):
    got = results_8["profile"][(strategy, group, accum)]
    assert "all_reduce/unknown" not in got["profiler"]
    assert got["profiler"] == pytest.approx(got["engine"], rel=1e-12)
    assert any(k.endswith("/inter") for k in got["engine"]) and any(k.endswith("/intra") for k in got["engine"])


@pytest.mark.slow
def test_full_grid_on_8_ranks_matches_reference_and_ledger(refs_8):
    rest = [c for c in FULL_GRID_8 if c not in CASES_8]
    got = run_world(8, grid, {"train": rest})[0]["train"]
    for strategy, group, accum in rest:
        check_against_reference(got[(strategy, group, accum)], refs_8[accum])
        check_ledger(got[(strategy, group, accum)], strategy, 8, group, accum)
