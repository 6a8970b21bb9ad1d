"""``strategy="auto"`` under a memory budget (``paro_fsdp/cost/budget.py``): the solver against brute
force, mixed plans between two strategies' footprints, the one-line error when nothing fits, and the
plumbing: the plan's policy is what the engine runs (``paro_shard``, ``fully_shard``, the trainer)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from paro_fsdp import fully_shard, paro_shard
from paro_fsdp.api import _default_blocks
from paro_fsdp.cost.budget import (MIX_GAIN, BudgetError, Footprint, Option, Workload, min_footprint, plan_blocks,
                                   solve, spec_of, units_of)
from paro_fsdp.cost.cluster import load_cluster
from paro_fsdp.models.llama import Llama, flavor
from paro_fsdp.strategy import Strategy, resolve_policy
from paro_fsdp.train.estimate import fake_mesh, release_fake_world

MiB = 2**20
WORK = Workload(micro_batch=2, seq_len=256, grad_accum=2)
CLUSTER = load_cluster("a100_ib")


# ---- the solver on synthetic costs ----------------------------------------------------------------------------


def _brute(items, budget, fp):
    best = None
    for combo in itertools.product(*[range(len(o)) for o in items]):
        plan = [items[k][i] for k, i in enumerate(combo)]
        f = fp.of(plan)
        if f <= budget + 1e-9:
            t = sum(o.t for o in plan)
            if best is None or t < best[0] - 1e-12:
                best = (t, f, combo)
    return best


def _random_items(rng, k, c, dims=2, queues=2, integral=True):
    num = (lambda a, b: rng.randint(a, b)) if integral else (lambda a, b: rng.uniform(a, b))
    return [[Option(num(0, 20), rng.uniform(0, 10), tuple(num(0, 6) for _ in range(dims)),
                    tuple(num(0, 8) for _ in range(queues))) for _ in range(c)] for _ in range(k)]


@pytest.mark.parametrize("seed", range(40))
def test_solver_is_the_brute_force_optimum(seed):
    """Integer weights: the grid is exact; max terms and capped sums enumerated exactly."""
    rng = random.Random(seed)
    k, c = rng.randint(1, 4), rng.randint(1, 4)
    items = _random_items(rng, k, c)
    fp = Footprint(rng.randint(0, 5), (2.0, 1.0), (float(rng.randint(3, 15)), float(rng.randint(3, 15))))
    budget = rng.randint(10, 80)
    want, got = _brute(items, budget, fp), solve(items, budget, fp)
    if want is None:
        assert got is None
        with pytest.raises(AssertionError):
            assert min_footprint(items, fp)[0] <= budget
    else:
        assert got is not None
        idx, foot, time = got
        plan = [items[k][i] for k, i in enumerate(idx)]
        assert fp.of(plan) == pytest.approx(foot) and foot <= budget
        assert time == pytest.approx(want[0])


@pytest.mark.parametrize("seed", range(20))
def test_rounded_grid_never_exceeds_the_budget(seed):
    """Real-valued weights on a coarse grid: the plan fits for certain, and is at least as fast as the
    best plan of the budget shrunk by items x cell (the module docstring's bound)."""
    rng = random.Random(100 + seed)
    k, c, cells = rng.randint(2, 4), rng.randint(2, 4), 64
    items = _random_items(rng, k, c, integral=False)
    fp = Footprint(1.5, (2.0, 1.0), (7.5, 9.25))
    budget = rng.uniform(20, 90)
    got = solve(items, budget, fp, cells=cells)
    if got is not None:
        assert got[1] <= budget + 1e-9
    # the case with the most room bounds the grid's cell: room <= budget
    shrunk = _brute(items, budget - k * budget / cells, fp)
    if shrunk is not None:
        assert got is not None and got[2] <= shrunk[0] + 1e-9


def test_budget_between_two_footprints_mixes():
    """Four identical items, fast-and-big A or slow-and-small B: only B fits alone, two of each fit."""
    a, b = Option(10, 1.0, label="A"), Option(4, 3.0, label="B")
    items = [[a, b]] * 4
    idx, foot, time = solve(items, 28, Footprint())
    assert sorted(idx) == [0, 0, 1, 1] and foot == 28 and time == 8.0
    assert solve(items, 15, Footprint()) is None
    assert min_footprint(items, Footprint()) == (16, [1, 1, 1, 1])


# ---- the debug Llama: plans, the error ------------------------------------------------------------------------


def _llama(frozen: tuple[str, ...] = ()) -> Llama:
    torch.manual_seed(0)
    model = Llama(flavor("debug", max_seq_len=256))
    for name, p in model.named_parameters():
        if any(f in name for f in frozen):
            p.requires_grad_(False)
    return model


def _plan(model, budget, **kw):
    return plan_blocks(units_of(model, _default_blocks(model)), 4, 2, budget, CLUSTER, WORK, spec_of(model, WORK),
                       param_bytes=4, grad_bytes=4, acc_bytes=4, **kw)


def _singles(model):
    return {s: (f, t) for s, f, t in _plan(model, None).single}


def test_mixed_plan_between_ggg_and_iig_beats_every_single_strategy_that_fits():
    model = _llama()
    single = _singles(model)
    budget = (single["GGG"][0] + single["IIG"][0]) / 2
    plan = _plan(model, budget)
    assert plan.footprint <= budget
    assert len({o.label for o in plan.options}) > 1, plan.table()  # a plan per block, not one strategy
    best_fit = min(t for f, t in single.values() if f <= budget)
    assert plan.step_time * MIX_GAIN <= best_fit
    assert "best single strategy that fits" in plan.table()


def test_no_budget_is_the_fastest_single_strategy_that_fits():
    model = _llama()
    plan = _plan(model, None)
    assert len({o.label for o in plan.options}) == 1
    fits = {s: t for s, (f, t) in _singles(model).items() if f <= CLUSTER.usable_bytes}
    assert plan.options[0].label[0].name == min(fits, key=fits.get)


def test_nothing_fits_names_the_smallest_footprint_in_one_line():
    model = _llama()
    smallest = min(f for f, _ in _singles(model).values())
    with pytest.raises(BudgetError) as info:
        _plan(model, smallest * 0.9)
    msg = str(info.value)
    assert "\n" not in msg and "too small" in msg and "GGG on" in msg
    named = float(msg.split("smallest footprint possible is ")[1].split(" MiB")[0])
    assert smallest * 0.9 / MiB < named <= smallest / MiB + 0.005  # a plan per block may undercut every single one


def test_frozen_and_trainable_tensors_are_items_apart():
    model = _llama(frozen=("attention",))
    blocks = units_of(model, _default_blocks(model))
    layer = next(b for b in blocks if b.name == "layers.0")
    assert [u.trainable for u in layer.units] == [True, False]
    assert all("attention" in n for n in layer.units[1].names) and len(layer.units[1].names) >= 4
    plan = _plan(model, (_singles(model)["GGG"][0] + _singles(model)["NNG"][0]) / 2)
    assert plan.strategies().keys() == dict(model.named_parameters()).keys()


# ---- the API: the plan's policy is what the engine runs --------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    yield fake_mesh(4, 2)
    release_fake_world()


def _budget_between(model):
    single = _singles(model)
    return (single["GGG"][0] + single["IIG"][0]) / 2


def test_paro_shard_auto_runs_the_plan(mesh, capsys):
    budget = _budget_between(_llama())
    want = _plan(_llama(), budget).strategies()
    model = paro_shard(_llama(), mesh, "auto", memory_budget=budget, workload=WORK, cluster="a100_ib")
    assert model.paro_strategies() == want
    assert len(set(want.values())) > 1
    out = capsys.readouterr().out
    assert "paro auto: a strategy per block" in out and "predicted peak per rank" in out


def test_paro_shard_auto_frozen_weights(mesh):
    budget = _budget_between(_llama(frozen=("attention",)))
    want = _plan(_llama(frozen=("attention",)), budget).strategies()
    model = paro_shard(_llama(frozen=("attention",)), mesh, "auto", memory_budget=budget, workload=WORK,
                       cluster=CLUSTER)
    assert model.paro_strategies() == want


def test_fully_shard_auto_on_the_root(mesh):
    budget = _budget_between(_llama())
    want = _plan(_llama(), budget).strategies()
    model = fully_shard(_llama(), mesh=mesh, strategy="auto", memory_budget=budget, workload=WORK, cluster="a100_ib")
    assert model.paro_strategies() == want


def test_fully_shard_auto_per_block_is_refused_in_one_line(mesh):
    model = _llama()
    with pytest.raises(ValueError, match="no blocks in this TransformerBlock.*once, on the root") as info:
        fully_shard(model.layers[0], mesh=mesh, strategy="auto", memory_budget=2**30, cluster="a100_ib")
    assert "\n" not in str(info.value)
    fully_shard(model.layers[0], mesh=mesh, strategy="IIG")
    with pytest.raises(ValueError, match="sharded by earlier calls"):
        fully_shard(model, mesh=mesh, strategy="auto", memory_budget=2**30, cluster="a100_ib")


def test_budget_without_auto_is_refused(mesh):
    with pytest.raises(ValueError, match="read only by strategy \"auto\""):
        paro_shard(_llama(), mesh, "IIG", memory_budget=2**30)
    with pytest.raises(ValueError, match="memory_budget=-1"):
        paro_shard(_llama(), mesh, "auto", memory_budget=-1, cluster="a100_ib")


def test_trainer_budgeted_auto_sets_the_policy(mesh):
    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.parallelize import auto_strategy, paro_policy

    cfg, _ = parse_args(["--parallelism.paro_strategy", "auto", "--parallelism.memory_budget_gib", "1",
                         "--parallelism.paro_cluster_file", "a100_ib", "--training.seq_len", "64",
                         "--training.mixed_precision_param", "float32"], world_size=4)
    args = flavor("debug", max_seq_len=64)
    lines: list[str] = []
    cfg.parallelism.paro_strategy = auto_strategy(cfg, args, mesh, 1, torch.device("cpu"), lines.append)  # train.py
    assert Strategy.parse(cfg.parallelism.paro_strategy) and cfg.parallelism.paro_policy
    with torch.device("meta"):
        named = list(Llama(args).named_parameters())
    resolved = resolve_policy(paro_policy(cfg), named)
    assert resolved.keys() == {n for n, _ in named} and "strategy per block" in "\n".join(lines)


def test_trainer_budget_too_small_is_one_config_line(mesh):
    from paro_fsdp.train.config import ConfigError
    from paro_fsdp.train.config_parse import parse_args
    from paro_fsdp.train.parallelize import auto_strategy

    cfg, _ = parse_args(["--parallelism.paro_strategy", "auto", "--parallelism.memory_budget_gib", "0.0001",
                         "--parallelism.paro_cluster_file", "a100_ib", "--training.seq_len", "64"], world_size=4)
    with pytest.raises(ConfigError, match="^parallelism.paro_strategy = \"auto\": memory_budget = .* too small: the "
                                          "smallest footprint possible is") as info:
        auto_strategy(cfg, flavor("debug", max_seq_len=64), mesh, 1, torch.device("cpu"), print)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv, needle", [
    (["--parallelism.memory_budget_gib", "2"], "memory_budget_gib = 2.0 is read only by paro_strategy = \"auto\""),
    (["--parallelism.paro_strategy", "auto", "--parallelism.memory_budget_gib", "-1"],
     "memory_budget_gib = -1.0 is invalid; valid: 0"),
])
def test_config_key_errors_in_one_line(argv, needle):
    from paro_fsdp.train.config import ConfigError
    from paro_fsdp.train.config_parse import parse_args

    with pytest.raises(ConfigError) as info:
        parse_args(argv, world_size=4)
    assert needle in str(info.value) and "\n" not in str(info.value)
    cfg, _ = parse_args(["--parallelism.paro_strategy", "auto", "--parallelism.memory_budget_gib", "40"], world_size=4)
    assert cfg.parallelism.memory_budget_gib == 40.0


# ---- memory measured on real ranks -----------------------------------------------------------------------------


@pytest.mark.slow
def test_measured_peak_beside_the_prediction():
    """4 gloo ranks, GGG and NNN: the profiler's peak inside the step is positive, above the
    persistent states it must hold, and within 2x of the budgeted auto's footprint either way."""
    from tools.bench.memory_peak import predictions
    from tools.local_world import run_local_world

    strategies = ["GGG", "NNN"]
    payload = {"strategies": strategies, "group_size": 2, "flavor": "debug", "micro_batch": 2, "seq_len": 32,
               "accum": 2}
    per_rank = run_local_world(4, "tools.bench.memory_peak:_rank_main", payload)
    pred = predictions(strategies, 4, 2, "debug", 2, 32, 2)
    for i, s in enumerate(strategies):
        for rank in per_rank:
            r = rank[i]
            assert r["strategy"] == s and r["measured"] >= r["report"]["total"] > 0
            assert 0.5 < r["measured"] / pred[s]["footprint"] < 2.0, (s, r["measured"], pred[s])


# ---- the prediction against the engine's measured peak (tools.bench.memory_peak) -------------------------------

NAMED = ("NNN", "NNG", "NGG", "GGG", "III", "NIG", "IIG", "IGG", "ING")


@pytest.mark.parametrize("ckpt", [False, True])
def test_budget_prices_a_uniform_plan_as_predict_does(ckpt):
    """One table: the per-block footprint of a whole-model plan is predict's peak for that strategy."""
    from paro_fsdp.cost.predict import predict

    work = Workload(2, 64, 2, ckpt)
    model = Llama(flavor("debug", max_seq_len=64))
    plan = plan_blocks(units_of(model, _default_blocks(model)), 4, 2, None, CLUSTER, work, spec_of(model, work),
                       param_bytes=4, grad_bytes=4, acc_bytes=4)
    for s, foot, _ in plan.single:
        want = predict(model.args, s, 4, 2, 2, 2, 64, CLUSTER, dtype="fp32", accumulate_dtype="fp32",
                       activation_checkpoint="full" if ckpt else "none").memory["total"]
        assert foot == pytest.approx(want, rel=1e-12), s


def _measured(payload, policies):
    from tools.local_world import run_local_world

    per_rank = run_local_world(4, "tools.bench.memory_peak:_rank_main", dict(payload, strategies=policies))
    # the least rank's: every rank holds the same bytes (shards padded to one size), and the profiler
    # misses the frees gloo's threads make, so a buffer one of them frees late stays in that rank's sum
    # to the end (it only adds: one mixed plan's four ranks read 4.68, 4.84, 4.96 and 5.00 MB)
    return [min(rank[i]["measured"] for rank in per_rank) for i in range(len(policies))]


def _check_named(micro_batch, ckpt):
    from tools.bench.memory_peak import predictions

    payload = {"group_size": 2, "flavor": "debug", "micro_batch": micro_batch, "seq_len": 64, "accum": 2,
               "checkpoint": ckpt}
    pred = predictions(NAMED, 4, 2, "debug", micro_batch, 64, 2, ckpt)
    got = dict(zip(NAMED, _measured(payload, list(NAMED))))
    ratios = {s: round(got[s] / pred[s]["footprint"], 3) for s in NAMED}
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


def test_predicted_peak_within_10_percent_of_measured():
    """4 gloo ranks, the debug Llama in fp32, two micro-steps: per named strategy the engine's peak
    allocated bytes during a step (the profiler's allocation events) within 10% of the prediction
    (it was 25-45% above with the old sum of every term)."""
    _check_named(2, False)


@pytest.mark.slow
def test_predicted_peak_within_10_percent_of_measured_larger_batch():
    _check_named(4, False)


@pytest.mark.slow
def test_predicted_peak_within_10_percent_of_measured_checkpointed():
    """Activation checkpointing on every layer: the activations shrink, the engine's buffers weigh more."""
    _check_named(2, True)


def test_the_boundary_holds_one_gradient_not_two():
    """One rank, III (a boundary collective per group, every group's in flight together), a deep
    thin Llama whose states outweigh its activations: the step's peak above the persistent states
    stays under 3/4 of the G-level gradient. The accumulator and a scaled copy of its reduction
    were held at once: a whole G more (21.3 against 18.8 MiB)."""
    from tools.local_world import run_local_world

    payload = {"strategies": ["III"], "group_size": 1, "flavor": "debug", "micro_batch": 1, "seq_len": 8,
               "accum": 2, "overrides": {"n_layers": 24, "vocab_size": 64}}
    ((r,),) = run_local_world(1, "tools.bench.memory_peak:_rank_main", payload)
    over = r["measured"] - r["report"]["total"]
    assert 0 < over < 0.75 * r["report"]["G"], (over, r["report"])


def test_an_address_handed_out_again_was_freed_first():
    """The profiler records only its own threads' frees; gloo's threads release a collective's
    buffers. Three 4 MiB buffers at one address, never freed in the record, then 1 MiB freed as
    recorded: at most 4 MiB held at once, not 12 (GGG's measured peak moved by 17% between runs)."""
    from tools.bench.memory_peak import running_peak

    events = [(10, 4 * MiB, 0xA0), (20, 4 * MiB, 0xA0), (30, 4 * MiB, 0xA0), (40, MiB, 0xB0), (50, -MiB, 0xB0)]
    assert running_peak(events, 15, 60) == (5 * MiB, 4 * MiB)
    assert running_peak(events + [(5, 2 * MiB, 0xC0)], 0, 60) == (7 * MiB, 0)


def test_plans_measured_peak_stays_within_its_budget():
    """auto's plan at three budgets (between GGG's and IIG's predicted peak, between IIG's and NIG's,
    none: the fastest single strategy that fits), run on 4 gloo ranks: its measured peak within 10% of
    its predicted footprint, and within the budget."""
    model = Llama(flavor("debug", max_seq_len=64))
    work = Workload(2, 64, 2)

    def plan(budget):
        return plan_blocks(units_of(model, _default_blocks(model)), 4, 2, budget, CLUSTER, work,
                           spec_of(model, work), param_bytes=4, grad_bytes=4, acc_bytes=4)

    single = {s: f for s, f, _ in plan(None).single}
    budgets = [(single["GGG"] + single["IIG"]) / 2, (single["IIG"] + single["NIG"]) / 2, None]
    plans = [plan(b) for b in budgets]
    payload = {"group_size": 2, "flavor": "debug", "micro_batch": 2, "seq_len": 64, "accum": 2}
    measured = _measured(payload, [p.policy() for p in plans])
    got = [(b, p.footprint, m) for b, p, m in zip(budgets, plans, measured)]
    assert all(0.9 <= m / f <= 1.1 for _, f, m in got), got
    assert all(m <= (b or CLUSTER.usable_bytes) for b, _, m in got), got


def test_a_budget_every_strategy_fits_is_the_fastest_single_strategy():
    """A mix must be predicted 5% faster than the fastest single strategy that fits (MIX_GAIN):
    where every strategy fits, the per-block plan's small predicted gain is the model's, not the
    engine's (measured 0.87x), so the plan is the single strategy, and says why."""
    model = _llama()
    single = _singles(model)
    for budget in (max(f for f, _ in single.values()) * 1.01, (single["GGG"][0] + single["NNG"][0]) / 2):
        plan = _plan(model, budget)  # the per-block plan: 1.001x and 1.03x faster, predicted
        assert len({o.label for o in plan.options}) == 1, plan.table()
        fits = {s: t for s, (f, t) in single.items() if f <= budget}
        assert plan.options[0].label[0].name == min(fits, key=fits.get)
        assert "under the 1.05x a mix must gain" in plan.header


def test_a_model_of_its_own_shape_stays_within_its_budget():
    """A residual MLP of a user's own shape (its parameters about its activations' size, its loss
    outside it: ``loss_fn``), planned from one micro-batch between IIG's and NIG's predicted peaks,
    then trained on 4 gloo ranks: its peak is where a block's backward has finished (its whole
    gradients reduced, the previous block's reduction in flight, the head's gradient held), which
    the peak model priced at the loss alone (measured 1.10x of predicted, over its budget)."""
    from tools.bench.auto_budget import _plans
    from tools.local_world import run_local_world

    payload = {"models": ["mlp"], "group_size": 2, "micro_batch": 2, "seq_len": 64, "accum": 2,
               "cluster": "a100_ib"}
    budget, plan = _plans("mlp", payload, 4, 2)[1]
    payload["budgets"] = {"mlp": [budget]}
    measured = min(rank[0]["measured"] for rank in run_local_world(4, "tools.bench.auto_budget:_rank_main", payload))
    assert measured <= budget and 0.9 <= measured / plan.footprint <= 1.1, (budget, plan.footprint, measured)
