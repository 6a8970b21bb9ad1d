"""tools/estimate.py on a fake 64-rank 8x8 mesh: the engine's counted collectives and held bytes
equal the spec's ledger (paro_fsdp/cost/ledger.py) exactly, and the layer extrapolation is exact.

One process, torch's fake process group and FakeTensorMode: no real communication, no ranks to
spawn. The model's dims are multiples of 64 so the layout adds no padding and equality is exact.
"""
from __future__ import annotations

import time

import pytest

from paro_fsdp import Strategy
from paro_fsdp.collectives import ring_bytes
from paro_fsdp.cost.ledger import Bucket, formula_bytes, formula_memory, traffic_of
from paro_fsdp.models.llama import LlamaArgs
from paro_fsdp.train.estimate import estimate, release_fake_world

N, M = 64, 8
ARGS = LlamaArgs(dim=64, n_layers=4, n_heads=4, vocab_size=128, ffn_dim=128, max_seq_len=32)
STRATEGIES = ["NNN", "NIG", "IIG", "IGG", "ING", "III", "GGG"]
ROOT = 2 * 128 * 64 + 64  # embeddings, output, final norm: gathered once per micro-step
LAYER = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
NUMERIC = ["mem_P", "mem_G", "mem_OS", "mem_total", "intra_bytes", "inter_bytes", "global_bytes"]


@pytest.fixture(scope="module", autouse=True)
def fake_world():
    yield
    release_fake_world()


def _buckets(strategy: str, trainable_layers: int) -> list[Bucket]:
    """The engine's buckets for one strategy: the root, then one per layer."""
    s = Strategy.parse(strategy)
    once, twice = (0, 0) if s.p.value == "N" else (1, 2)
    root_t = ROOT if trainable_layers == ARGS.n_layers else 0
    return [Bucket(s, ROOT, root_t, once, 3)] + [  # 3 and 9 tensors: the end of backward asks about each
        Bucket(s, LAYER, LAYER if i < trainable_layers else 0, twice, 9) for i in range(ARGS.n_layers)
    ]


def _check_against_ledger(
    row: dict, strategy: str, accum: int, trainable_layers: int, flat_below_bytes: int = 0
) -> None:
    psi = ROOT + ARGS.n_layers * LAYER
    psi_t = psi if trainable_layers == ARGS.n_layers else trainable_layers * LAYER
    assert (row["psi"], row["psi_trainable"], row["psi_kept"]) == (psi, psi_t, ROOT)
    # G is the accumulator: fp32 by default (MixedPrecision.accumulate_dtype), whatever the reduce dtype
    mem = formula_memory(strategy, psi, psi_t, N, M, param_bytes=2, grad_bytes=4, os_bytes=12)
    for k in ("P", "G", "OS", "total"):
        assert row[f"mem_{k}"] == mem[k], (strategy, k)
    fb = formula_bytes(strategy, psi, psi_t, N, M, accum, psi_kept=ROOT, param_bytes=2, grad_bytes=2)
    tensors = 9 * trainable_layers + (3 if trainable_layers == ARGS.n_layers else 0)
    fb["global"] += ring_bytes("all_reduce", tensors, N)  # which tensors some rank used, a byte each
    for dim in ("intra", "inter", "global") if not flat_below_bytes else ():  # the spec's: all hierarchical
        assert row[f"{dim}_bytes"] == pytest.approx(fb[dim], rel=1e-12, abs=1e-9), (strategy, dim)
    # counts too, bucket by bucket: every collective the engine issued, of each kind and dim
    expected = traffic_of(
        _buckets(strategy, trainable_layers), N, M, accum, flat_below_bytes=flat_below_bytes
    ).as_dict()
    got = row["collectives"]
    assert set(got) == set(expected), strategy
    for key, e in expected.items():
        assert got[key]["count"] == pytest.approx(e["count"]), (strategy, key)
        assert got[key]["bytes"] == pytest.approx(e["bytes"], rel=1e-12), (strategy, key)


def test_measured_equals_ledger_full_depth():
    rows = estimate(ARGS, N, M, STRATEGIES, grad_accum=2, full=True)
    assert [r["strategy"] for r in rows] == STRATEGIES
    for row in rows:
        assert row["layers_run"] == "4"
        _check_against_ledger(row, row["strategy"], 2, ARGS.n_layers)


def test_flat_below_the_threshold_in_engine_and_ledger_alike():
    """With a threshold between the root's and a layer's message (bf16: 32 KiB, 80 KiB) the
    root's global collectives run flat and the layers' hierarchically; the engine issues and the
    ledger counts by the same rule, collective by collective."""
    flat = 50_000
    assert 2 * ROOT < flat < 2 * LAYER
    rows = estimate(ARGS, N, M, ["GGG", "NNN", "IGG", "NNG", "GNN"], grad_accum=2, full=True, flat_below_bytes=flat)
    for row in rows:
        _check_against_ledger(row, row["strategy"], 2, ARGS.n_layers, flat_below_bytes=flat)
    ggg = next(r["collectives"] for r in rows if r["strategy"] == "GGG")
    assert ggg["all_gather/global"]["count"] == 2  # the root's gather, once per micro-step
    assert ggg["all_gather/inter"]["count"] == 2 * 2 * ARGS.n_layers  # the layers': twice per micro-step
    plain = estimate(ARGS, N, M, ["GGG"], grad_accum=2, full=True)[0]["collectives"]
    assert "all_gather/global" not in plain and plain["all_gather/inter"]["count"] == 2 * (2 * ARGS.n_layers + 1)


@pytest.mark.slow  # make test-all: the full-depth case (measured = ledger) stays in make test
def test_layer_extrapolation_is_exact_and_partial_training():
    # all trainable: 1- and 2-layer runs extended to 4 layers == running 4 layers
    full = estimate(ARGS, N, M, ["IIG", "GGG"], grad_accum=2, full=True)
    fast = estimate(ARGS, N, M, ["IIG", "GGG"], grad_accum=2)
    for a, b in zip(full, fast):
        assert b["layers_run"] == "1,2 -> 4"
        assert {k: a[k] for k in NUMERIC} == pytest.approx({k: b[k] for k in NUMERIC})
        flat = lambda r: {f"{kd}:{w}": v for kd, e in r["collectives"].items() for w, v in e.items()}  # noqa: E731
        assert flat(a) == pytest.approx(flat(b))
    # half the parameters trainable: layers 0-1 train, root and layers 2-3 are frozen
    frac = 2 * LAYER / (ROOT + 4 * LAYER)
    full = estimate(ARGS, N, M, ["ING"], grad_accum=2, trainable_fraction=frac, full=True)[0]
    fast = estimate(ARGS, N, M, ["ING"], grad_accum=2, trainable_fraction=frac)[0]
    assert fast["layers_run"] == "1,2,2(1 frozen) -> 4"
    for row in (full, fast):
        _check_against_ledger(row, "ING", 2, trainable_layers=2)


def test_inter_traffic_vs_grad_accum():
    """The point of PaRO: with P, G at most I, inter-group bytes are paid once per optimizer
    step, whatever the number of micro-steps; ZeRO-3 pays them every micro-step."""
    one = {r["strategy"]: r for r in estimate(ARGS, N, M, ["IIG", "GGG"], grad_accum=1)}
    three = {r["strategy"]: r for r in estimate(ARGS, N, M, ["IIG", "GGG"], grad_accum=3)}
    assert three["IIG"]["inter_bytes"] == one["IIG"]["inter_bytes"] > 0
    assert three["IIG"]["intra_bytes"] > one["IIG"]["intra_bytes"]
    assert three["GGG"]["inter_bytes"] > 2.5 * one["GGG"]["inter_bytes"]


# every dim 0 uneven on 1024 ranks: 32 (wk, wv), 64, 172 (w1, w3; Llama-7B's 11008 / 64), 1000 (vocab)
UNEVEN = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_dim=172, max_seq_len=32)


@pytest.mark.slow  # make test-all
def test_a_1024_rank_world_costs_about_what_a_64_rank_one_does():
    """``--world 1024`` once had not finished after 14 minutes. The layout's work for sizes the
    world size does not divide was per rank (DTensor's offsets asked rank by rank, one copy per
    rank and tensor in every NESTED move); it is per tensor now, so 16 times the ranks costs about
    the same CPU time (it used to grow with the world size: 1024 ranks were 10x and more)."""
    # NESTED -> whole (GGG gathers), whole -> NESTED (GGG, NGN reduce), FULL -> NESTED (ING's
    # boundary), NESTED -> FULL (NGN's boundary), I <-> [g, sum_g] (IIG's boundary and push)
    strategies = ["GGG", "IIG", "NGN", "ING"]
    estimate(UNEVEN, N, M, ["NNN"], grad_accum=1)  # warm up: imports, the first fake model
    cpu, rows = {}, {}
    for world in (N, 1024):
        start = time.process_time()
        rows[world] = {r["strategy"]: r for r in estimate(UNEVEN, world, M, strategies, grad_accum=1)}
        cpu[world] = time.process_time() - start
    print("CPU seconds per world size:", cpu)
    assert cpu[1024] < 2 * cpu[N] + 2, cpu
    for name, row in rows[1024].items():
        assert "error" not in row, row
        for k in ("mem_P", "mem_G", "mem_OS", "intra_bytes", "inter_bytes"):  # padding only adds
            assert row[k] >= row[f"formula_{k}"] * (1 - 1e-12), (name, k)
    # intra shards do not depend on the number of groups: P = I and G = I cost the same on 64 ranks
    for name, keys in {"IIG": ("mem_P", "mem_G", "intra_bytes"), "ING": ("mem_P",)}.items():
        for k in keys:
            assert rows[1024][name][k] == rows[N][name][k], (name, k)


def test_ledger_matches_spec_prose():
    """Spot checks of paro_fsdp.ledger against the examples written out in PARO_SPEC.md."""
    psi, psi_t, n, m, A = 6_400, 3_200, 64, 8, 4
    g = n // m

    def ag(S, k):  # ring all-gather / reduce-scatter bytes (2-byte elements)
        return 2 * S * (k - 1) / k

    # IIG: per micro-step 2 intra AG(psi) + 1 intra RS(psi'); per step inter RS + inter AG of psi'/m
    b = formula_bytes("IIG", psi, psi_t, n, m, A, clip=False)
    assert b["intra"] == pytest.approx(A * (2 * ag(psi, m) + ag(psi_t, m)))
    assert b["inter"] == pytest.approx(2 * ag(psi_t / m, g))
    # GGG: global AG twice and global RS every micro-step, nothing at the boundary
    b = formula_bytes("GGG", psi, psi_t, n, m, A, clip=False)
    assert b["intra"] == pytest.approx(A * (2 * ag(psi, m) + ag(psi_t, m)))
    assert b["inter"] == pytest.approx(A * (2 * ag(psi / m, g) + ag(psi_t / m, g)))
    # NNN (DDP): one global all-reduce of the gradients per step
    b = formula_bytes("NNN", psi, psi_t, n, m, A, clip=False)
    assert b["intra"] == pytest.approx(2 * ag(psi_t, m)) and b["inter"] == pytest.approx(2 * ag(psi_t / m, g))
    # kept parameters are gathered once instead of twice
    kept = formula_bytes("IIG", psi, psi_t, n, m, A, psi_kept=1_000, clip=False)
    plain = formula_bytes("IIG", psi, psi_t, n, m, A, clip=False)
    assert kept["intra"] == pytest.approx(plain["intra"] - A * ag(1_000, m))
    assert kept["inter"] == plain["inter"]
    # memory: M = 2 psi / d(P) + 2 psi' / d(G) + 12 psi' / d(OS)
    mem = formula_memory("ING", psi, psi_t, n, m)
    assert (mem["P"], mem["G"], mem["OS"]) == (2 * psi / m, 2 * psi_t, 12 * psi_t / n)
    assert mem["total"] == mem["P"] + mem["G"] + mem["OS"]
