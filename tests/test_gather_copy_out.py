"""A chunked global parameter gather (P = G) is copied out once, chunk by chunk, straight into
the whole tensors, as FSDP2's ``split_with_sizes_copy``: no buffer of the whole block is
assembled first (that held the chunks, the assembled buffer and the parameters: three
block-sized buffers). On 4 gloo ranks as 2 x 2, exact against one process with the chunks cut
inside tensors and rows, uneven tensors included."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world
from workloads import ODD, TINY, reference

MODELS = {"tiny": TINY, "odd": ODD}


def rank_main(payload: dict) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from paro_fsdp.param_group import ShardState
    from workloads import full_params, train_paro

    class NewStorage(TorchDispatchMode):
        """Bytes of the storages the ops under it create (outputs not aliasing an input)."""

        def __init__(self) -> None:
            super().__init__()
            self.nbytes, self.seen = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (p := t.untyped_storage().data_ptr()) not in known | self.seen:
                    self.seen.add(p)
                    self.nbytes += t.untyped_storage().nbytes()
            return out

    out: dict = {}
    for name, args in MODELS.items():
        model, _, losses = train_paro("GGG", 2, 2, args=args, chunk_bytes=256)  # several chunks per gather
        out[name] = {"losses": losses, "params": full_params(model)}
    model, _, _ = train_paro("GGG", 2, 1, steps=1)
    state = model._paro_state
    group = next(g for g in state.groups if g.name.startswith("layers.0"))
    assert group.state == ShardState.SHARDED
    block = state.info.n * group.p_flat.numel() * group.p_flat.element_size()  # the gathered block's bytes
    state.cc.chunk_bytes = block // 4
    state.cc.stats.reset()
    with NewStorage() as created:
        group.unshard()
    out["unshard"] = {"block": block, "m": state.info.m, "created": created.nbytes,
                      "gathers": state.cc.stats.count("all_gather", "inter")}
    group.reshard()
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, rank_main, {})[0]


@pytest.mark.parametrize("model", list(MODELS))
def test_chunked_gathers_are_exact(results, model):
    ref, got = reference(4, 2, MODELS[model]), results[model]
    for (loss, norm), (ref_loss, ref_norm) in zip(got["losses"], ref["losses"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5, abs=1e-7)
    for name, value in ref["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=0, atol=2e-5, msg=name)


def test_a_chunked_gather_is_copied_out_once(results):
    r = results["unshard"]
    assert r["gathers"] == 4  # four chunks
    # the inter phase's output (1/m of the block) and the intra phase's (the block): nothing else
    assert r["created"] == r["block"] + r["block"] // r["m"], r
