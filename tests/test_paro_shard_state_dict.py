"""State dicts on 4 real gloo ranks (2 groups of 2): model and optimizer saved with DCP's
state-dict helpers under one strategy load under another, and model-only loads (another sharded
model's state dict, whole plain tensors, DCP into the model's own state dict, names changed by
load hooks as torchtitan's fused ``wqkv``) reach the parameters (the fp32 masters) and the
working copies follow: the next steps train on from the loaded values. ``strict=False`` touches
only the loaded tensors."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import run_world
from workloads import LR, MAX_NORM, batch, close, full_params, make_model, sharded, train_paro, train_steps

WORLD = 4
LOAD = ["IIG", "GGG", "NGI"]
HOW = ["dtensor", "plain", "dcp", "dcp_in_place", "renamed", "renamed_plain"]


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


# ---- what each rank runs ----


def dcp_case(src: str, dst: str, folder: str) -> dict[str, Any]:
    """Train under one strategy, save model and optimizer with DCP's state-dict helpers
    (``get_state_dict``, as for FSDP2), load them into a fresh model under another strategy
    (``set_state_dict``); return both sides' whole tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from paro_fsdp import init_paro_mesh, paro_shard
    from workloads import adamw

    model, opt, _ = train_paro(src, 2, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    fresh = paro_shard(make_model(seed=1), init_paro_mesh(2), dst)
    opt2 = adamw(fresh)
    msd2, osd2 = get_state_dict(fresh, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=folder)
    set_state_dict(fresh, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _, loaded = get_state_dict(fresh, opt2)
    return {
        "params": (full_params(model), full_params(fresh)),
        "exp_avg_sq": ({k: v["exp_avg_sq"].full_tensor() for k, v in osd["state"].items()},
                       {k: v["exp_avg_sq"].full_tensor() for k, v in loaded["state"].items()}),
        "step": (osd["state"]["output.weight"]["step"], loaded["state"]["output.weight"]["step"]),
    }


def model_only_loads(folder: str) -> dict[str, Any]:
    """Trained weights into a freshly initialised model with a fresh optimizer, each way."""
    import torch.distributed.checkpoint as dcp

    from paro_fsdp import init_paro_mesh

    mesh = init_paro_mesh(2)
    out: dict[str, Any] = {}
    for s in LOAD:
        trained, topt = sharded(mesh, s)
        train_steps(trained, topt, 2)
        weights = full_params(trained)
        runs = {}
        for how in HOW:
            model, opt = sharded(mesh, s, make_model(seed=1))
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
            elif how == "dcp_in_place":  # DCP writes into the state dict's tensors, nothing called after
                dcp.save(trained.state_dict(), checkpoint_id=f"{folder}/{s}-in-place")
                dcp.load(model.state_dict(), checkpoint_id=f"{folder}/{s}-in-place")
            else:  # DCP into the model's own state dict, then load_state_dict (torchtitan's path)
                dcp.save(trained.state_dict(), checkpoint_id=f"{folder}/{s}")
                sd = model.state_dict()
                dcp.load(sd, checkpoint_id=f"{folder}/{s}")
                model.load_state_dict(sd)
            runs[how] = {"losses": train_steps(model, opt, 2, first_step=2), "params": full_params(model)}
        out[s] = {"weights": weights, "runs": runs}
    return out


def partial_load(_: Any = None) -> dict[str, Any]:
    """strict=False, one tensor: which masters changed; and the refusal of ``assign=True``."""
    from paro_fsdp import init_paro_mesh

    model, opt = sharded(init_paro_mesh(2), "IIG")
    before = full_params(model)
    other = make_model(seed=1)
    name = "layers.1.feed_forward.w2.weight"
    model.load_state_dict({name: dict(other.named_parameters())[name].detach()}, strict=False)
    out: dict[str, Any] = {"changed": {n: not torch.equal(v, before[n]) for n, v in full_params(model).items()}}
    try:
        model.load_state_dict(model.state_dict(), assign=True)
    except ValueError as e:
        out["assign_error"] = str(e)
    return out


def rank_main(folder: str) -> dict[str, Any]:
    return {"dcp": dcp_case("IIG", "NGI", f"{folder}/across"), "load": model_only_loads(folder),
            "partial": partial_load()}


# ---- the checks ----


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    return run_world(WORLD, rank_main, str(tmp_path_factory.mktemp("dcp")))[0]


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


@pytest.mark.compat
def test_optimizer_state_round_trips_through_dcp_across_strategies(got):
    """Saved under IIG, loaded under NGI: the parameters (the fp32 masters), Adam states and step agree."""
    got = got["dcp"]
    for key in ("params", "exp_avg_sq"):
        before, after = got[key]
        assert before.keys() == after.keys() and before
        for name in before:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=f"{key} {name}")
    assert float(got["step"][0]) == float(got["step"][1]) == 3.0


@pytest.mark.parametrize("strategy", LOAD)
@pytest.mark.parametrize("how", HOW)
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
    changed = [n for n, c in got["partial"]["changed"].items() if c]
    assert changed == ["layers.1.feed_forward.w2.weight"], changed
    assert "assign=True" in got["partial"]["assign_error"]
