"""The FSDP2 drop-in, as torch's own ``test_fully_shard_*``: one FSDP2 training script run with
torch's ``fully_shard`` and with ours (no strategy: FSDP2's layout on that mesh; then IIG and GGG),
on 4 gloo ranks, a 2D mesh of the user's own (the HSDP names) and a 1D one. The script is an
FSDP2 user's: each block then the root, torch's AdamW over ``model.parameters()`` with decay and
no-decay groups, a LambdaLR schedule, ``set_requires_gradient_sync`` accumulation, torch's
``clip_grad_norm_``, DCP's ``get_state_dict`` / ``set_state_dict`` resume. Losses, gradient norms
and final parameters must equal FSDP2's."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from workloads import batch, make_model

STEPS, A, LR, MAX_NORM = 4, 2, 1e-2, 0.5


def _fully_shard(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    from paro_fsdp import fully_shard
    return fully_shard


def _build(impl: str, strategy: str | None, mesh_shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard = _fully_shard(impl)
    kw = {"strategy": strategy} if strategy else {}
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(True)
    for layer in model.layers:
        shard(layer, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    return model, opt, sched


def _train(
    model, opt, sched, steps: range, loss_of=None, accum: int = A, max_norm: float = MAX_NORM
) -> list[tuple[float, float]]:
    """The FSDP2 way: the last micro-step syncs, torch's clip over the parameters, the user's
    optimizer and schedule. ``loss_of(model, rank, step, micro)``: default, the tiny Llama's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    loss_of = loss_of or (lambda m, r, s, a: m(batch(r, s, a)).loss)
    out = []
    for step in steps:
        total = torch.zeros(())
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            loss = loss_of(model, rank, step, micro) / accum
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        out.append(((total / world).item(), norm.full_tensor().item()))
    return out


def script(payload: dict[str, Any]) -> dict[str, Any]:
    """The FSDP2 script: train, save with get_state_dict, train on; then a fresh model resumes
    from the saved state (set_state_dict) and must retrace the same steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    impl, strategy, shape = payload["impl"], payload["strategy"], tuple(payload["mesh"])
    model, opt, sched = _build(impl, strategy, shape)
    losses = _train(model, opt, sched, range(0, STEPS // 2))
    msd, osd = get_state_dict(model, opt)
    saved = {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    saved_opt = _full(osd)
    losses += _train(model, opt, sched, range(STEPS // 2, STEPS))
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    grads_kept = all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none) cleared them

    resumed, ropt, rsched = _build(impl, strategy, shape)
    rmsd, rosd = get_state_dict(resumed, ropt)
    set_state_dict(resumed, ropt, model_state_dict=_like(saved, rmsd), optim_state_dict=_like(saved_opt, rosd))
    rsched.load_state_dict(sched.state_dict())
    rsched.last_epoch = STEPS // 2 - 1
    again = _train(resumed, ropt, rsched, range(STEPS // 2, STEPS))
    return {"losses": losses, "params": params, "resumed": again, "grads_cleared": grads_kept,
            "osd_keys": sorted(osd["state"])}


def _full(tree: Any) -> Any:
    if hasattr(tree, "full_tensor"):
        return tree.full_tensor().clone()
    if isinstance(tree, dict):
        return {k: _full(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_full(v) for v in tree]
    return tree.clone() if torch.is_tensor(tree) else tree


def _like(full: Any, local: Any) -> Any:
    """Whole tensors laid out as ``local``'s DTensors (what DCP's loader would hand back)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(local, DTensor):
        return distribute_tensor(full, local.device_mesh, local.placements, src_data_rank=None)
    if isinstance(local, dict):
        return {k: _like(full[k], v) for k, v in local.items()}
    if isinstance(local, list):
        return [_like(f, v) for f, v in zip(full, local)]
    return full


def all_cases(payload: list[dict]) -> list[dict]:
    return [script(p) for p in payload]


CASES = [("torch", None, (2, 2)), ("paro", None, (2, 2)), ("paro", "IIG", (2, 2)), ("paro", "GGG", (2, 2)),
         ("torch", None, (4,)), ("paro", None, (4,))]


@pytest.fixture(scope="module")
def runs() -> dict[tuple, dict]:
    results = run_world(4, all_cases, [{"impl": i, "strategy": s, "mesh": list(m)} for i, s, m in CASES])
    return {case: out for case, out in zip(CASES, results[0])}


@pytest.mark.parametrize("impl,strategy,mesh", [c for c in CASES if c[0] == "paro"],
                         ids=[f"{s or 'default'}-{'x'.join(map(str, m))}" for i, s, m in CASES if i == "paro"])
def test_same_script_same_numbers_as_fsdp2(runs, impl, strategy, mesh):
    ref = runs[("torch", None, mesh)]
    got = runs[(impl, strategy, mesh)]
    for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (norm, ref_norm)
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            got["params"][name], value, rtol=1e-4, atol=1e-5
        )  # Adam amplifies 1e-7 gradient noise on tiny gradients
    assert got["osd_keys"] == ref["osd_keys"]  # optimizer state keyed by FQN, as FSDP2's
    assert got["grads_cleared"]


@pytest.mark.parametrize(
    "impl,strategy,mesh", CASES, ids=[f"{i}-{s or 'default'}-{'x'.join(map(str, m))}" for i, s, m in CASES]
)
def test_get_state_dict_resume_retraces_the_steps(runs, impl, strategy, mesh):
    got = runs[(impl, strategy, mesh)]
    for (loss, norm), (ref_loss, ref_norm) in zip(got["resumed"], got["losses"][STEPS // 2:]):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), (norm, ref_norm)


def optimizer_paths(_: Any = None) -> dict[str, list[float]]:
    """torch's AdamW through each of its implementations: the for-loop (CPU's default), foreach
    (the GPU default; its ops through DTensor move no version counter) and fused."""
    from paro_fsdp import init_paro_mesh, paro_shard

    out = {}
    for name, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        model = paro_shard(make_model(), init_paro_mesh(2), "IIG")
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, **kw)
        losses = []
        for step in range(2):
            loss = model(batch(dist.get_rank(), 0, 0)).loss  # one batch: the second step's loss is lower
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = losses
    return out


def test_every_torch_optimizer_implementation_refreshes_the_working_copies():
    got = run_world(4, optimizer_paths)[0]
    assert got["for-loop"][0] > got["for-loop"][-1]
    for name in ("foreach", "fused"):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(got["for-loop"]), rtol=1e-5, atol=0, msg=name)


def held_bytes(_: Any = None) -> dict[str, int]:
    """Bytes a rank holds after an optimizer step (parameters, gradients, optimizer states and,
    for PaRO, every engine buffer), fp32 full shard on a 1D mesh: torch's FSDP2 against PaRO's
    default (GGG), whose parameter is its P storage."""

    out = {}
    for impl in ("torch", "paro"):
        model, opt, _ = _build(impl, None, (4,))
        for micro in range(A):
            model.set_requires_gradient_sync(micro == A - 1)
            model(batch(dist.get_rank(), 0, micro)).loss.backward()
        opt.step()
        storages: dict[int, int] = {}

        def hold(t) -> None:
            if t is not None and t.numel():
                t = t.to_local() if hasattr(t, "to_local") else t
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        for p in model.parameters():
            hold(p)
            hold(p.grad)
            for v in opt.state[p].values():
                if torch.is_tensor(v) and v.dim():
                    hold(v)
        if impl == "paro":
            for g in model._paro_state.groups:
                for t in (g.p_flat, g.master_flat, g.grad_acc.tensor, *(g.full_bufs or [])):
                    hold(t)
        out[impl] = sum(storages.values())
    return out


def test_fp32_ggg_holds_zero3_bytes():
    got = run_world(4, held_bytes)[0]
    assert got["paro"] <= got["torch"] * 1.02, got  # padding of the flat shards aside


@pytest.mark.parametrize(
    "kwargs,fix",
    [
        ({"shard_placement_fn": lambda p: None}, "strategy="),
        ({"reshard_after_forward": 2}, "pass True, False or None"),
        (
            {"offload_policy": __import__("torch.distributed.fsdp", fromlist=["CPUOffloadPolicy"]).CPUOffloadPolicy()},
            "offload",
        ),
        ({"ignored_params": {torch.nn.Parameter(torch.zeros(1))}}, "requires_grad=False"),
    ],
)
def test_fsdp2_options_paro_cannot_honour_fail_in_one_line(kwargs, fix):
    """Nothing is silently ignored: each refusal is one line naming what to do instead, before
    anything is sharded."""
    from paro_fsdp import fully_shard

    model = torch.nn.Linear(4, 4)
    with pytest.raises((ValueError, NotImplementedError)) as err:
        fully_shard(model, **kwargs)
    assert fix in str(err.value) and "\n" not in str(err.value)
    assert type(model.weight) is torch.nn.Parameter  # untouched


def module_methods(_: Any = None) -> dict[str, Any]:
    """FSDP2's module methods on blocks sharded by ``fully_shard`` (IIG on 2 x 2): what each
    changes in the engine's state and collectives, and that training is unchanged."""
    from torch.distributed.device_mesh import init_device_mesh

    from paro_fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, strategy="IIG")
        return fully_shard(model, mesh=mesh, strategy="IIG")

    def gathers(model) -> int:
        return model.comm_stats().count("all_gather", "intra")

    def state_of(block) -> str:
        return block._paro_block.groups[0].state.name

    rank, out = dist.get_rank(), {}
    x = batch(rank, 0, 0)
    model = build()
    base = model(x).loss.item()
    model.comm_stats().reset()
    model(x).loss.backward()
    out["gathers_default"] = gathers(model)

    model = build()
    model.layers[0].set_reshard_after_forward(False)
    loss = model(x).loss
    out["kept_after_forward"] = state_of(model.layers[0])
    model.comm_stats().reset()
    loss.backward()
    out["gathers_in_backward_kept"] = gathers(model)

    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    model(x).loss.backward()
    out["kept_after_backward"] = [state_of(b) for b in model.layers]
    model.comm_stats().reset()
    out["loss_kept"] = model(x).loss.item()
    out["gathers_forward_after_kept"] = gathers(model)

    model = build()
    model.layers[1].unshard()
    out["unshard"] = state_of(model.layers[1])
    model.layers[1].reshard()
    out["reshard"] = state_of(model.layers[1])

    model = build()
    model.layers[0].set_modules_to_forward_prefetch([])  # no prefetch of layers.1 from layers.0
    seen = []
    model.layers[1].register_forward_pre_hook(lambda *_: seen.append(state_of(model.layers[1])), prepend=True)
    out["loss_no_prefetch"] = model(x).loss.item()
    out["layer1_at_its_forward"] = seen
    out["base"] = base
    return out


def test_fsdp2_module_methods_do_what_they_say():
    got = run_world(4, module_methods)[0]
    # the root stays gathered (from the forward before); each layer gathers in forward and again in backward
    assert got["gathers_default"] == 2 + 2 and got["gathers_in_backward_kept"] == 1  # layers.0 kept: only layers.1
    assert got["kept_after_forward"] == "UNSHARDED"
    assert got["kept_after_backward"] == ["UNSHARDED", "UNSHARDED"]
    assert got["gathers_forward_after_kept"] == 0 and got["loss_kept"] == pytest.approx(got["base"], rel=1e-6)
    assert (got["unshard"], got["reshard"]) == ("UNSHARDED", "SHARDED")
    assert got["layer1_at_its_forward"] == ["SHARDED"]  # nothing prefetched it
    assert got["loss_no_prefetch"] == pytest.approx(got["base"], rel=1e-6)
