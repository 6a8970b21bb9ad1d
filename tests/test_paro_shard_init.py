"""Building a sharded model, on 4 real gloo ranks (2 groups of 2): a model made on the meta
device is materialised shard by shard inside ``paro_shard`` (equal to the model initialised
whole, then sharded); blocks given as the values of an ``nn.ModuleDict`` (torchtitan's
``model.layers``), found by default or passed as ``blocks=``; and bad input (group size,
strategy letters, policy patterns, a step without backward) refused with errors that name the fix."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_harness import run_world
from workloads import STEPS, TINY, batch, close, full_params, make_model, reference, sharded, train_steps

WORLD = 4
META = ["IIG", "GGG", "NNN"]


class LayerDict(nn.ModuleDict):
    """torchtitan keeps its blocks in a ModuleDict; iterating yields the blocks, so the test
    Llama's forward runs unchanged."""

    def __iter__(self):
        return iter(self.values())


def dict_model() -> nn.Module:
    model = make_model()
    model.layers = LayerDict({str(i): layer for i, layer in enumerate(model.layers)})
    return model


# ---- what each rank runs ----


def meta_init_case(strategy: str) -> dict[str, Any]:
    """A model built on the meta device and materialised shard by shard inside paro_shard equals
    the same model initialised whole, then sharded."""
    from functools import partial

    from paro_fsdp import init_paro_mesh, paro_shard
    from paro_fsdp.models.llama import Llama

    mesh = init_paro_mesh(2)
    whole = Llama(TINY)
    whole.init_weights(seed=7)
    whole = paro_shard(whole, mesh, strategy)
    with torch.device("meta"):
        lazy = Llama(TINY)
    lazy = paro_shard(lazy, mesh, strategy, param_init_fn=partial(lazy.init_param, seed=7))
    lazy.init_buffers(torch.device("cpu"))
    x = torch.randint(0, TINY.vocab_size, (2, 9))
    return {"params": (full_params(whole), full_params(lazy)), "loss": (whole(x).loss.item(), lazy(x).loss.item())}


def module_dict_cases(_: Any = None) -> dict[str, Any]:
    """Blocks from a ModuleDict: found by default, and given explicitly as the container."""
    from paro_fsdp import init_paro_mesh, paro_shard

    mesh = init_paro_mesh(2)
    out: dict[str, Any] = {}
    model, opt = sharded(mesh, "IIG", dict_model())
    out["dict_default"] = {
        "blocks": [b.name for b in model._paro_state.blocks],
        "losses": train_steps(model, opt, STEPS),
    }
    m = dict_model()
    model, opt = sharded(mesh, "GGG", m, blocks=m.layers)
    out["dict_explicit"] = {
        "blocks": [b.name for b in model._paro_state.blocks],
        "losses": train_steps(model, opt, STEPS),
    }
    try:
        paro_shard(make_model(), mesh, "IIG", blocks=[m.layers["0"], "layers.1"])
    except TypeError as e:
        out["blocks_error"] = str(e)
    return out


def error_cases(_: Any = None) -> dict[str, str]:
    """Each bad input must raise; return the messages."""
    from paro_fsdp import init_paro_mesh, paro_shard

    msgs = {}
    try:
        init_paro_mesh(3)
    except ValueError as e:
        msgs["group_size"] = str(e)
    mesh = init_paro_mesh(2)
    try:
        paro_shard(make_model(), mesh, "IXG")
    except ValueError as e:
        msgs["letters"] = str(e)
    try:
        paro_shard(make_model(), mesh, {"layers.*.attention.wq.weigth": "GGG", "default": "IIG"})
    except ValueError as e:
        msgs["pattern"] = str(e)
    model = paro_shard(make_model(), mesh, "IIG")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.set_requires_gradient_sync(False)
    model(batch(dist.get_rank(), 0, 0)).loss.backward()
    try:
        opt.step()  # the gradients are still at the G level: stepping would skip them
    except RuntimeError as e:
        msgs["unsynced"] = str(e)
    dist.barrier()
    return msgs


def rank_main(_: Any = None) -> dict[str, Any]:
    return {"meta": {s: meta_init_case(s) for s in META}, "errors": error_cases(), "dict": module_dict_cases()}


# ---- the checks ----


@pytest.fixture(scope="module")
def world_results():
    return run_world(WORLD, rank_main)


@pytest.mark.compat
@pytest.mark.parametrize("strategy", META)
def test_meta_device_model_is_materialised_shard_by_shard(world_results, strategy):
    got = world_results[0]["meta"][strategy]
    whole, lazy = got["params"]
    for name in whole:
        torch.testing.assert_close(lazy[name], whole[name], rtol=0, atol=0, msg=name)
    assert got["loss"][0] == got["loss"][1]


def test_module_dict_values_are_blocks(world_results):
    got = world_results[0]["dict"]
    ref = reference(WORLD, 1)["losses"]
    for key in ("dict_default", "dict_explicit"):
        assert got[key]["blocks"] == ["<root>", "layers.0", "layers.1"], got[key]["blocks"]
        close(got[key]["losses"], ref)
    assert "blocks= takes modules" in got["blocks_error"]


@pytest.mark.compat
def test_bad_input_errors_name_the_fix(world_results):
    msgs = world_results[0]["errors"]
    assert "not divisible by group_size 3" in msgs["group_size"] and "divisors of 4" in msgs["group_size"]
    assert "three letters from N, I, G" in msgs["letters"]
    assert "match no parameter" in msgs["pattern"] and "weigth" in msgs["pattern"]
    assert "set_requires_gradient_sync(True)" in msgs["unsynced"] and "\n" not in msgs["unsynced"]
