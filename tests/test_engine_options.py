"""Engine options a foreign trainer needs (issue 12), on 4 gloo ranks (2 groups of 2):
a gradient divide factor (torchtitan sums gradients over ranks), blocks given as the values of an
``nn.ModuleDict`` (torchtitan's ``model.layers``), and model-only loads that refresh the fp32
masters (without it the next optimizer step pushed the old masters back over the load)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import run_world
from workloads import LR, MAX_NORM, STEPS, batch, make_model, reference

WORLD = 4
DIVIDE = ["IIG", "GGG", "NNN"]
LOAD = ["IIG", "GGG", "NGI"]
FLAT = ["GGG", "NNN", "NNG"]  # global AG and RS each micro-step; the boundary's global AR; global RS and push AG


class LayerDict(nn.ModuleDict):
    """torchtitan keeps its blocks in a ModuleDict; iterating yields the blocks, so the test
    Llama's forward runs unchanged."""

    def __iter__(self):
        return iter(self.values())


def dict_model() -> nn.Module:
    model = make_model()
    model.layers = LayerDict({str(i): layer for i, layer in enumerate(model.layers)})
    return model


def rename_w2(model: nn.Module) -> nn.Module:
    """Hooks on each feed-forward module that save ``w2.weight`` as ``w2_alias`` and load it
    back, as torchtitan's fused ``wqkv`` is saved as ``wq`` / ``wk`` / ``wv`` and merged on
    load: the loaded parameter's name is never a key of the dict handed to load_state_dict."""

    def save(module, sd, prefix, local_metadata):
        sd[prefix + "w2_alias"] = sd.pop(prefix + "w2.weight")

    def load(module, sd, prefix, *args):
        if prefix + "w2_alias" in sd:
            sd[prefix + "w2.weight"] = sd.pop(prefix + "w2_alias")

    for layer in model.layers:
        layer.feed_forward.register_state_dict_post_hook(save)
        layer.feed_forward.register_load_state_dict_pre_hook(load)
    return model


def _alias(name: str) -> str:
    return name.replace("w2.weight", "w2_alias")


def _train(model, opt, steps: int, *, loss_scale: float = 1.0, first_step: int = 0) -> list[tuple[float, float]]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for step in range(first_step, first_step + steps):
        loss = model(batch(rank, step, 0)).loss
        (loss * loss_scale).backward()
        norm = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(((total / world).item(), norm.item()))
    return out


def rank_main(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    from paro_fsdp import ParoOptimizer, init_paro_mesh, paro_shard
    from workloads import full_params

    mesh = init_paro_mesh(2)
    world = dist.get_world_size()
    out: dict[str, Any] = {"divide": {}, "load": {}}

    def shard(strategy, model=None, **kw):
        model = paro_shard(model if model is not None else make_model(), mesh, strategy, **kw)
        return model, ParoOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)

    # the loss divided by the world size and summed over ranks is the default mean
    for s in DIVIDE:
        model, opt = shard(s)
        model.set_gradient_divide_factor(1.0)
        out["divide"][s] = {"summed_mean": _train(model, opt, STEPS, loss_scale=1.0 / world),
                            "params": full_params(model)}
    model, opt = shard("IIG")
    model.set_gradient_divide_factor(1.0)
    out["divide"]["sum"] = _train(model, opt, 1)
    model, opt = shard("IIG")
    model.set_gradient_divide_factor(2.0 * world)
    out["divide"]["half_mean"] = _train(model, opt, 1)
    try:
        model.set_gradient_divide_factor(0.0)
    except ValueError as e:
        out["divide"]["error"] = str(e)

    # every global collective below flat_below_bytes runs flat: the same training, counted as
    # the ledger counts it under the same rule
    from paro_fsdp.cost.ledger import buckets_of, traffic_of

    out["flat"] = {}
    for s in FLAT:
        model, opt = shard(s, flat_below_bytes=1 << 30)
        stats = model.comm_stats()
        stats.reset()
        losses = _train(model, opt, STEPS)
        ledger = traffic_of(buckets_of(model), world, 2, 1, param_bytes=4, grad_bytes=4, flat_below_bytes=1 << 30)
        out["flat"][s] = {"losses": losses, "params": full_params(model), "comm": stats.as_dict(),
                          "ledger": {k: {"count": v["count"] * STEPS, "bytes": v["bytes"] * STEPS}
                                     for k, v in ledger.as_dict().items()}}

    # blocks from a ModuleDict: found by default, and given explicitly as the container
    model, opt = shard("IIG", dict_model())
    out["dict_default"] = {"blocks": [b.name for b in model._paro_state.blocks], "losses": _train(model, opt, STEPS)}
    m = dict_model()
    model, opt = shard("GGG", m, blocks=m.layers)
    out["dict_explicit"] = {"blocks": [b.name for b in model._paro_state.blocks], "losses": _train(model, opt, STEPS)}
    try:
        paro_shard(make_model(), mesh, "IIG", blocks=[m.layers["0"], "layers.1"])
    except TypeError as e:
        out["blocks_error"] = str(e)

    # model-only loads: trained weights into a freshly initialised model with a fresh optimizer
    for s in LOAD:
        trained, topt = shard(s)
        _train(trained, topt, 2)
        weights = full_params(trained)
        runs = {}
        for how in ("dtensor", "plain", "dcp", "renamed", "renamed_plain"):
            model, opt = shard(s, make_model(seed=1))
            if how == "renamed":  # a parent's load pre-hook names the parameter
                rename_w2(model)
                sd = rename_w2(trained).state_dict()
                assert not any(k.endswith("w2.weight") for k in sd)
                model.load_state_dict(sd)
            elif how == "renamed_plain":  # (trained keeps the hooks: weights were read before)
                rename_w2(model)
                model.load_state_dict({_alias(k): v.clone() for k, v in weights.items()})
            elif how == "dtensor":  # model.state_dict() of another sharded model
                model.load_state_dict(trained.state_dict())
            elif how == "plain":  # an unsharded checkpoint: whole plain tensors
                model.load_state_dict({k: v.clone() for k, v in weights.items()})
            else:  # DCP into the model's own state dict, then load_state_dict (torchtitan's path)
                import torch.distributed.checkpoint as dcp

                dcp.save(trained.state_dict(), checkpoint_id=f"{folder}/{s}")
                sd = model.state_dict()
                dcp.load(sd, checkpoint_id=f"{folder}/{s}")
                model.load_state_dict(sd)
            runs[how] = {"losses": _train(model, opt, 2, first_step=2), "params": full_params(model)}
        out["load"][s] = {"weights": weights, "runs": runs}

    # strict=False, one tensor: only that tensor's master changes
    model, opt = shard("IIG")
    before = {n: m.detach().clone() for n, m in zip(opt.fqn_of.values(), opt.fqn_of.keys())}
    other = make_model(seed=1)
    name = "layers.1.feed_forward.w2.weight"
    model.load_state_dict({name: dict(other.named_parameters())[name].detach()}, strict=False)
    out["partial"] = {n: not torch.equal(m.detach(), before[n]) for m, n in opt.fqn_of.items()}
    try:
        model.load_state_dict(model.state_dict(), assign=True)
    except ValueError as e:
        out["assign_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    return run_world(WORLD, "test_engine_options:rank_main", str(tmp_path_factory.mktemp("dcp")))[0]


def reference_from(weights: dict[str, torch.Tensor], steps: int, first_step: int) -> dict[str, Any]:
    """Single process, fresh AdamW from ``weights``: what a model-only load must continue as."""
    model = make_model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    losses = []
    for step in range(first_step, first_step + steps):
        x = torch.cat([batch(r, step, 0) for r in range(WORLD)])
        loss = model(x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append((loss.item(), norm.item()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def close(got_losses, ref_losses, scale: float = 1.0) -> None:
    assert len(got_losses) == len(ref_losses)
    for (loss, norm), (ref_loss, ref_norm) in zip(got_losses, ref_losses):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - scale * ref_norm) <= 1e-5 * abs(scale * ref_norm) + 1e-7, (norm, scale * ref_norm)


@pytest.mark.parametrize("strategy", FLAT)
def test_flat_global_collectives_train_the_same_and_match_the_ledger(got, strategy):
    """paro_shard(flat_below_bytes=...) above every message: each global collective is one flat
    collective over all ranks (dim "global"), training matches the single-process reference, and
    the engine's counts equal the ledger's under the same rule."""
    r, ref = got["flat"][strategy], reference(WORLD, 1)
    close(r["losses"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(r["params"][name], value, rtol=0, atol=2e-5, msg=name)
    assert set(r["comm"]) == set(r["ledger"]) and not any(k.endswith("/inter") for k in r["comm"]), r["comm"]
    for key, want in r["ledger"].items():
        assert r["comm"][key]["count"] == want["count"], key
        assert r["comm"][key]["bytes"] == pytest.approx(want["bytes"], rel=0.02), key  # padded buffers


@pytest.mark.parametrize("strategy", DIVIDE)
def test_divide_factor_one_sums_gradients(got, strategy):
    """Loss / n with the sum over ranks = the default mean: same losses, norms and weights."""
    ref = reference(WORLD, 1)
    close(got["divide"][strategy]["summed_mean"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["divide"][strategy]["params"][name], value, rtol=0, atol=2e-5, msg=name)


def test_divide_factor_scales_the_gradient(got):
    ref = reference(WORLD, 1)["losses"][:1]
    close(got["divide"]["sum"], ref, scale=WORLD)
    close(got["divide"]["half_mean"], ref, scale=0.5)
    assert "must be > 0" in got["divide"]["error"]


def test_module_dict_values_are_blocks(got):
    ref = reference(WORLD, 1)["losses"]
    for key in ("dict_default", "dict_explicit"):
        assert got[key]["blocks"] == ["<root>", "layers.0", "layers.1"], got[key]["blocks"]
        close(got[key]["losses"], ref)
    assert "blocks= takes modules" in got["blocks_error"]


@pytest.mark.parametrize("strategy", LOAD)
@pytest.mark.parametrize("how", ["dtensor", "plain", "dcp", "renamed", "renamed_plain"])
def test_model_only_load_refreshes_masters(got, strategy, how):
    """Weights loaded without optimizer state train on from the loaded values, as a plain
    model given the same weights and a fresh AdamW does (before the fix the first step pushed
    the old masters back: the loss jumped back up)."""
    entry = got["load"][strategy]
    ref = reference_from(entry["weights"], 2, first_step=2)
    run = entry["runs"][how]
    close(run["losses"], ref["losses"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=0, atol=2e-5, msg=name)


def test_partial_load_touches_only_loaded_masters(got):
    changed = [n for n, c in got["partial"].items() if c]
    assert changed == ["layers.1.feed_forward.w2.weight"], changed
    assert "assign=True" in got["assign_error"]
