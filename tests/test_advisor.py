"""The strategy advisor (paro_fsdp/cost/, tools/advisor.py, tools/calibrate.py).

What must hold: the cost model's byte counts equal the engine's measured CommStats and
its model-state memory equals memory_report, for every strategy, on the fake 64-rank mesh and on
4 real gloo ranks (one spawn); its activation formula equals what autograd saves; bad input gets
a clear error naming the problem; and the paper's qualitative findings hold with the shipped
cluster presets (or, where they do not, the test pins down what the model says).
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from paro_fsdp import ALL_STRATEGIES, Strategy
from paro_fsdp.cost.cluster import AdvisorError, Cluster, cluster_from_dict, cluster_to_toml, load_cluster, presets
from paro_fsdp.cost.model import activation_bytes, model_spec
from paro_fsdp.cost.predict import choose_strategy, predict, rank_strategies
from paro_fsdp.cost.ledger import formula_bytes, traffic_of
from paro_fsdp.models.llama import Llama, LlamaArgs

from dist_harness import run_world
from tools.advisor import node_gbps_equivalent, with_node_gbps

PRESETS = ("a100_ib", "h800_roce", "h100_ndr")
FAMILY = ("IIG", "NIG", "IGG")
# fake 64-rank mesh: every dim 0 divisible by 64, so the layout pads nothing and counts are exact
ARGS64 = LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_dim=128, max_seq_len=32)
# 4 real ranks (2 groups x 2): every dim 0 divisible by 4
ARGS4 = LlamaArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, ffn_dim=48, max_seq_len=16)
PARTIAL4 = ("ING", "GGG")
A4 = 2


def _assert_same_collectives(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), (what, sorted(got), sorted(expected))
    for key, e in expected.items():
        assert got[key]["count"] == e["count"], (what, key)
        assert got[key]["bytes"] == pytest.approx(e["bytes"], rel=1e-12, abs=1e-9), (what, key)


# ---- exactness: the fake 64-rank mesh ---------------------------------------------------------
def test_bytes_and_state_memory_equal_engine_on_fake_64_ranks():
    from paro_fsdp.train.estimate import estimate, release_fake_world

    a100 = load_cluster("a100_ib")
    try:
        rows = estimate(ARGS64, 64, 8, None, grad_accum=1, micro_batch=1, seq_len=4)
        partial = estimate(ARGS64, 64, 8, ["ING"], grad_accum=1, micro_batch=1, seq_len=4,
                           trainable_fraction=0.3)
    finally:
        release_fake_world()
    assert [r["strategy"] for r in rows] == list(ALL_STRATEGIES)
    for rows_, fraction in ((rows, 1.0), (partial, 0.3)):
        for row in rows_:
            s = row["strategy"]
            p = predict(ARGS64, s, 64, 8, 1, 1, 4, a100, trainable_fraction=fraction)
            spec = model_spec(ARGS64, fraction)
            assert (spec.psi, spec.psi_trainable, spec.root) == (row["psi"], row["psi_trainable"], row["psi_kept"])
            _assert_same_collectives(row["collectives"], p.traffic.as_dict(), f"fake64 {s} f={fraction}")
            for k in ("P", "G", "OS"):
                assert p.memory[k] == row[f"mem_{k}"], (s, fraction, k)
            assert p.memory["states"] == row["mem_total"]
    assert 0 < model_spec(ARGS64, 0.3).psi_trainable < model_spec(ARGS64).psi  # root and a layer frozen


# ---- exactness: 4 real ranks, one spawn --------------------------------------------------------
def _four_rank_case(payload):
    """On each of 4 gloo ranks: every strategy one optimizer step (A micro-steps), plus partial
    training (layer 0 trainable, root and layer 1 frozen), plus a quick calibration."""
    import torch.distributed as dist

    from paro_fsdp import MixedPrecision, init_paro_mesh, paro_shard
    from paro_fsdp.cost.calibrate import calibrate_in_process

    start = time.perf_counter()
    mesh = init_paro_mesh(2)
    out = {"full": {}, "partial": {}}
    tokens = torch.randint(0, ARGS4.vocab_size, (1, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    for kind, names in (("full", ALL_STRATEGIES), ("partial", PARTIAL4)):
        for name in names:
            torch.manual_seed(0)
            model = Llama(ARGS4)
            if kind == "partial":
                for pname, p in model.named_parameters():
                    p.requires_grad_(pname.startswith("layers.0."))
            model = paro_shard(model, mesh, name, mp=MixedPrecision(torch.bfloat16))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            model.comm_stats().reset()
            for a in range(A4):
                model.set_requires_gradient_sync(a == A4 - 1)  # the boundary under the last backward
                (model(tokens).loss / A4).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            model.wait_for_params()  # the step's pushes, otherwise landed by the next forward
            out[kind][name] = {"collectives": model.comm_stats().as_dict(), "memory": model.memory_report(opt)}
            opt.zero_grad()
    out["strategies_s"] = time.perf_counter() - start
    out["cluster"] = calibrate_in_process(mesh, replace(ARGS4, n_layers=1), 1, 8, "fp32", sizes_mib=(0.01, 0.05),
                                          reps=1)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_world(4, "test_advisor:_four_rank_case", None, timeout=300)


def test_bytes_and_state_memory_equal_engine_on_4_real_ranks(four_ranks):
    a100 = load_cluster("a100_ib")
    partial_fraction = model_spec(ARGS4).layer / model_spec(ARGS4).psi  # one layer
    for rank, out in enumerate(four_ranks):
        for kind, fraction in (("full", 1.0), ("partial", partial_fraction)):
            spec = model_spec(ARGS4, fraction)
            if kind == "partial":
                assert spec.trainable_layers == 1 and not spec.root_trainable
            for name, got in out[kind].items():
                p = predict(spec, name, 4, 2, 1, A4, 8, a100)
                _assert_same_collectives(got["collectives"], p.traffic.as_dict(), f"rank {rank} {kind} {name}")
                for k in ("P", "G", "OS"):
                    assert got["memory"][k] == p.memory[k], (rank, kind, name, k)
                assert got["memory"]["total"] == p.memory["states"]
        assert len(out["full"]) == 27


def test_calibration_on_4_ranks_gives_a_usable_cluster(four_ranks):
    clusters = [out["cluster"] for out in four_ranks]
    c = clusters[0]
    assert all(x == c for x in clusters), "every rank must get the same calibrated cluster"
    assert isinstance(c, Cluster) and c.gpus_per_node == 2 and c.measured["inter_size"] == 2
    for value in (c.achieved_tflops, c.memory_bandwidth_gbs, c.intra.bandwidth_gbs, c.inter.bandwidth_gbs):
        assert value > 0 and math.isfinite(value)
    assert 0 <= c.overlap <= 1 and c.intra_overlap is not None and 0 <= c.intra_overlap <= 1
    assert c.measured["model_seconds"] > 0  # the whole (small) model timed for the compute rate
    import tomllib

    again = cluster_from_dict(tomllib.loads(cluster_to_toml(c)), "roundtrip")
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        for link, link2 in ((c.intra, again.intra), (c.inter, again.inter)):
            assert link2.cost(kind) == pytest.approx(link.cost(kind), rel=1e-7)
    assert again.achieved_tflops == pytest.approx(c.achieved_tflops, rel=1e-7)
    assert again.intra_overlap == pytest.approx(c.intra_overlap, abs=1e-9)
    p = predict(ARGS4, "IIG", 4, 2, 1, 2, 8, again)
    assert p.step_time > 0 and p.fits


def test_each_dimension_hides_behind_its_own_overlap():
    """Ranks sharing a host: the intra collective is a copy competing with compute (calibrated
    overlap about 0 on CPU), the inter one waits on the network. With one overlap for both it is
    the old formula, max(0, total - overlap x compute)."""
    from paro_fsdp.cost.predict import exposed_seconds

    c = load_cluster("a100_ib")
    t = {"intra": 0.3, "inter": 0.4, "global": 0.1}
    for compute in (0.2, 0.6, 2.0):
        assert exposed_seconds(t, compute, c) == pytest.approx(max(0.0, 0.8 - c.overlap * compute))
    cpu = replace(c, overlap=0.5, intra_overlap=0.0)
    assert exposed_seconds(t, 2.0, cpu) == pytest.approx(0.3)  # the intra part exposed, the rest hidden
    assert exposed_seconds(t, 0.6, cpu) == pytest.approx(0.3 + 0.5 - 0.3)
    half = replace(c, overlap=0.5, intra_overlap=0.5)  # the compute the slow traffic hid behind is used
    assert exposed_seconds(t, 1.2, half) == pytest.approx(0.3 + 0.5 - 0.5 - 0.1)
    iii = [predict(ARGS4, "III", 4, 2, 1, 2, 8, x).step_time for x in (c, replace(c, intra_overlap=0.0))]
    nnn = [predict(ARGS4, "NNN", 4, 2, 1, 2, 8, x).step_time for x in (c, replace(c, intra_overlap=0.0))]
    assert iii[1] > iii[0] and nnn[1] == nnn[0]  # III's per micro-step collectives are intra, NNN has none


# ---- the model's other parts ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype,act_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("ckpt", [False, True])
def test_activation_formula_equals_saved_tensors(dtype, act_bytes, ckpt):
    """What autograd saves for the Llama (unique storages, parameters and buffers excluded)."""
    from torch.utils.checkpoint import checkpoint

    args = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=80, max_seq_len=32)
    torch.manual_seed(0)
    model = Llama(args).to(dtype)
    if ckpt:
        for layer in model.layers:
            layer.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(layer.forward)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, args.vocab_size, (3, 17)))
    saved = sum(v for k, v in seen.items() if k not in skip)
    assert saved == activation_bytes(model_spec(args), 3, 16, act_bytes, ckpt)["saved"]


def test_step_decomposes_into_micro_steps_and_boundary_and_matches_spec_ledger():
    from paro_fsdp.cost.model import buckets

    spec = model_spec("llama7b")
    for s in ALL_STRATEGIES:
        b = buckets(spec, s)
        total = traffic_of(b, 64, 8, 4)
        one = traffic_of(b, 64, 8, 1, clip=False).as_dict()
        boundary = traffic_of(b, 64, 8, 0, clip=False).as_dict()
        for key, e in total.as_dict().items():
            if key.endswith("/global"):
                continue
            per_micro = one.get(key, {"bytes": 0})["bytes"] - boundary.get(key, {"bytes": 0})["bytes"]
            assert e["bytes"] == pytest.approx(4 * per_micro + boundary.get(key, {"bytes": 0})["bytes"]), (s, key)
        spec_bytes = formula_bytes(s, spec.psi, spec.psi, 64, 8, 4, psi_kept=spec.root)
        p = predict(spec, s, 64, 8, 2, 4, 2048, load_cluster("a100_ib"))
        assert (p.intra_bytes, p.inter_bytes) == pytest.approx((spec_bytes["intra"], spec_bytes["inter"]))


def test_step_time_responds_to_the_cluster_as_it_should():
    c = load_cluster("a100_ib")
    slow, fast = with_node_gbps(c, 100), with_node_gbps(c, 1600)
    for s in ("GGG", "IIG", "NIG", "ING"):
        p_slow, p_fast = (predict("llama7b", s, 64, 8, 2, 4, 2048, x) for x in (slow, fast))
        assert p_slow.step_time >= p_fast.step_time
    # PaRO's point: inter bytes of IIG do not grow with gradient accumulation, ZeRO-3's do
    one, eight = (predict("llama7b", s, 64, 8, 2, a, 2048, c) for s, a in (("IIG", 1), ("IIG", 8)))
    assert one.inter_bytes == eight.inter_bytes
    g1, g8 = (predict("llama7b", "GGG", 64, 8, 2, a, 2048, c) for a in (1, 8))
    assert g8.inter_bytes == pytest.approx(8 * g1.inter_bytes, rel=1e-3)
    # compute: 6 Psi per token + attention for full training; less without weight gradients
    full = predict("llama7b", "GGG", 64, 8, 2, 4, 2048, c)
    frozen = predict("llama7b", "GGG", 64, 8, 2, 4, 2048, c, trainable_fraction=0.0625)
    assert frozen.compute < full.compute * 0.75
    tokens = 2 * 2048 * 4
    spec = model_spec("llama7b")
    assert full.compute == pytest.approx(tokens * (6 * (spec.psi - spec.vocab_size * spec.dim)
                                                   + 12 * 32 * 2048 * 4096) / 170e12, rel=0.01)


# ---- bad input --------------------------------------------------------------------------------
def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


GOOD = (presets() / "a100_ib.toml").read_text()


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.replace("gpus_per_node = 8\n", ""), "missing field 'gpus_per_node'"),
    (lambda t: t.replace("achieved_tflops = 170.0\n", ""), "missing field 'achieved_tflops'"),
    (lambda t: t.replace("latency_us = 5.0\n", ""), "missing field 'inter.latency_us'"),
    (lambda t: t.replace("[intra]\nbandwidth_gbs = 230.0\n", "[intra]\n"), "missing field 'intra.bandwidth_gbs'"),
    (lambda t: t.split("[intra]")[0], "missing section [intra]"),
    (lambda t: t.replace("memory_gib = 80.0", 'memory_gib = "eighty"'), "field 'memory_gib' must be a float"),
    (lambda t: t.replace("overlap = 0.8", "overlap = 1.5"), "'overlap' must be in [0, 1]"),
    (lambda t: t + "\nbandwith_gbs = 3\n", "unknown field 'inter.bandwith_gbs'"),
    (lambda t: "gpus_per_node = [\n", "not valid TOML"),
])
def test_cluster_file_errors_name_the_field(tmp_path, mutate, needle):
    with pytest.raises(AdvisorError) as exc:
        load_cluster(_write(tmp_path, mutate(GOOD)))
    assert needle in str(exc.value)


def test_bad_model_and_sizes_errors():
    c = load_cluster("a100_ib")
    with pytest.raises(AdvisorError, match="unknown model flavor 'llama8b'.*llama7b"):
        predict("llama8b", "IIG", 64, 8, 2, 4, 2048, c)
    with pytest.raises(AdvisorError, match=r"group size 6 does not divide the number of GPUs 64.*\[1, 2, 4, 8"):
        predict("llama7b", "IIG", 64, 6, 2, 4, 2048, c)
    with pytest.raises(AdvisorError, match="trainable fraction must be in"):
        model_spec("llama7b", 0.0)
    with pytest.raises(AdvisorError, match="micro-batch must be a positive integer"):
        predict("llama7b", "IIG", 64, 8, 0, 4, 2048, c)
    with pytest.raises(AdvisorError, match="activation_checkpoint must be one of"):
        predict("llama7b", "IIG", 64, 8, 2, 4, 2048, c, activation_checkpoint="some")
    with pytest.raises(ValueError, match="unknown PaRO strategy"):
        predict("llama7b", "XYZ", 64, 8, 2, 4, 2048, c)
    with pytest.raises(AdvisorError, match="cluster file 'nope.toml' not found.*a100_ib.toml"):
        load_cluster("nope.toml")
    with pytest.raises(AdvisorError, match="no strategy fits in 72.0 GiB"):
        choose_strategy("llama65b", 8, 8, 2, 4, 2048, "bf16", c)


def test_cli_errors_exit_2_with_one_line(capsys):
    from tools.advisor import main

    assert main(["--model", "llama8b", "--no-plot"]) == 2
    assert "unknown model flavor 'llama8b'" in capsys.readouterr().err
    assert main(["--gpus", "60", "--gpus-per-node", "8", "--no-plot"]) == 2
    assert "group size 8 does not divide the number of GPUs 60" in capsys.readouterr().err
    assert main(["--cluster", "missing.toml", "--no-plot"]) == 2
    assert "not found" in capsys.readouterr().err


# ---- the CLI ----------------------------------------------------------------------------------
def test_cli_table_plot_and_sweeps(tmp_path, capsys):
    from tools.advisor import main

    pytest.importorskip("matplotlib")
    png = tmp_path / "a.png"
    assert main(["--model", "llama7b", "--gpus", "64", "--gpus-per-node", "8", "--cluster", "a100_ib.toml",
                 "--micro-batch", "2", "--grad-accum", "4", "--trainable", "0.0625", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if re.match(r"^\s*\d+ [NIG]{3} ", ln)]
    assert len(lines) == 27 and "recommended:" in out and "vs GGG" in out
    assert png.stat().st_size > 10_000
    png = tmp_path / "sweep.png"
    assert main(["--model", "llama65b", "--sweep", "inter-gbps", "--values", "100,400,1600", "--plot", str(png)]) == 0
    assert "thousand tokens/s" in capsys.readouterr().out and png.stat().st_size > 10_000
    assert main(["--model", "llama7b", "--sweep", "gpus", "--values", "16,32,64,128", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert (
        "thousand tokens/s" in out and len([ln for ln in out.splitlines() if re.match(r"^\s+(16|32|64|128) ", ln)]) == 4
    )
    assert main(["--params", "30e9", "--layers", "60", "--hidden", "6656", "--gpus", "128", "--no-plot"]) == 0
    assert "30B" in capsys.readouterr().out


def test_cli_plot_goes_to_out_dir_not_the_working_directory(tmp_path, monkeypatch, capsys):
    """Without --plot the PNG lands in --out-dir (default outputs/advisor), never in the folder the
    command runs from (it used to land in the repository root)."""
    from tools.advisor import main

    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    args = ["--model", "llama7b", "--gpus", "16", "--gpus-per-node", "8", "--micro-batch", "1", "--grad-accum", "1"]
    assert main(args + ["--out-dir", str(tmp_path / "figs")]) == 0
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["advisor_llama7b_16gpus.png"]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs", "outputs"]
    assert (tmp_path / "outputs" / "advisor" / "advisor_llama7b_16gpus.png").stat().st_size > 10_000
    assert "plot: outputs/advisor/advisor_llama7b_16gpus.png" in capsys.readouterr().out


def test_choose_strategy_for_the_trainer():
    strategy, table = choose_strategy(LlamaArgs(dim=64, n_layers=4, n_heads=4, vocab_size=258, ffn_dim=176),
                                      4, 2, 8, 1, 128, "fp32", "a100_ib", reduce_dtype="fp32")
    assert isinstance(strategy, Strategy) and strategy.name in table
    assert table.count("\n") >= 28


# ---- the paper's qualitative findings with the shipped presets -------------------------------------
@pytest.mark.parametrize("cluster", ["a100_ib", "h800_roce"])
@pytest.mark.parametrize("model", ["llama7b", "llama65b"])
def test_full_training_paro_beats_zero3_on_slow_networks(cluster, model):
    c = load_cluster(cluster)
    for n in (32, 64, 128):
        preds = {p.strategy: p for p in rank_strategies(model, n, 8, 2, 4, 2048, c)}
        ggg = preds["GGG"]
        best = min((preds[s] for s in FAMILY if preds[s].fits), key=lambda p: p.step_time)
        assert ggg.fits
        assert ggg.step_time / best.step_time >= 1.2, (cluster, model, n, best.strategy)


@pytest.mark.parametrize("model", ["llama7b", "llama65b"])
def test_small_trainable_fraction_ing_beats_zero3_and_is_near_the_best(model):
    for cluster in ("a100_ib", "h800_roce"):
        c = load_cluster(cluster)
        for n in (32, 64, 128):
            preds = rank_strategies(model, n, 8, 2, 4, 2048, c, trainable_fraction=0.0625)
            by = {p.strategy: p for p in preds}
            ing, ggg, best = by["ING"], by["GGG"], preds[0]
            assert ing.fits and best.fits
            assert ggg.step_time / ing.step_time >= 1.2, (cluster, model, n)
            assert ing.step_time <= 1.03 * best.step_time, (cluster, model, n, best.strategy)
    # PEFT-sized trainable part on LLaMA-65B (one layer, 1.2%): ING is the fastest that fits
    preds = rank_strategies("llama65b", 64, 8, 2, 4, 2048, load_cluster("a100_ib"), trainable_fraction=0.003)
    assert preds[0].strategy == "ING"


@pytest.mark.parametrize("model", ["llama7b", "llama65b"])
def test_advantage_shrinks_as_inter_bandwidth_approaches_intra(model):
    """The advisor's pick over ZeRO-3 (GGG), from 50 Gb/s per node up to the bandwidth where a
    GPU's inter share equals its NVLink bandwidth: shrinks monotonically to ~1 (GGG itself is the
    pick once every collective hides behind compute, PaRO's boundary collectives do not)."""
    c = load_cluster("a100_ib")
    ratios = []
    for gbps in (50, 100, 200, 400, 1600, node_gbps_equivalent(c, c.intra.bandwidth_gbs)):
        preds = rank_strategies(model, 64, 8, 2, 4, 2048, with_node_gbps(c, gbps))
        ggg = next(p for p in preds if p.strategy == "GGG")
        ratios.append(ggg.step_time / preds[0].step_time)
    assert all(a >= b - 1e-9 for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[0] > 1.8 and ratios[-1] < 1.02, ratios
    # the fast-network preset: PaRO's family gains nothing over ZeRO-3
    h100 = load_cluster("h100_ndr")
    preds = {p.strategy: p for p in rank_strategies(model, 64, 8, 2, 4, 2048, h100)}
    assert min(preds[s].step_time for s in FAMILY if preds[s].fits) >= 0.95 * preds["GGG"].step_time


def test_presets_load_and_document_their_sources():
    for name in PRESETS:
        c = load_cluster(name)
        assert c.gpus_per_node == 8 and c.memory_gib == 80 and c.source and c.node_gbps
        assert c.intra.bandwidth_gbs > 10 * c.inter.bandwidth_gbs or name == "h100_ndr"
        assert 100 <= c.node_gbps <= 400 or name == "h100_ndr"
        text = (presets() / f"{name}.toml").read_text()
        assert text.count("#") > 5  # the derivation of every number is written down
