"""A chunked global parameter gather (P = G) is copied out once, chunk by chunk, straight into
the whole tensors, as FSDP2's ``split_with_sizes_copy``: no buffer of the whole block is
assembled first (that held the chunks, the assembled buffer and the parameters: three
block-sized buffers). On 4 gloo ranks as 2 x 2. Exactness of chunked, uneven P = G training is
test_paro_shard_strategies.py's (its CHUNKED cases); the chunk-by-chunk copy of every layout is
test_layout.py's."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world


def rank_main(payload: dict) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from paro_fsdp.param_group import ShardState
    from workloads import train_paro

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
    model, _, _ = train_paro("GGG", 2, 1, steps=1)
    state = model._paro_state
    group = next(g for g in state.groups if g.name.startswith("layers.0"))
    assert group.state == ShardState.SHARDED
    block = state.info.n * group.p_flat.numel() * group.p_flat.element_size()  # the gathered block's bytes
    state.cc.chunk_bytes = block // 4
    state.comm.stats.reset()
    with NewStorage() as created:
        group.unshard()
    out["unshard"] = {"block": block, "m": state.info.m, "created": created.nbytes,
                      "gathers": state.comm.stats.count("all_gather", "inter")}
    group.reshard()
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, rank_main, {})[0]


def test_a_chunked_gather_is_copied_out_once(results):
    r = results["unshard"]
    assert r["gathers"] == 4  # four chunks
    # the inter phase's output (1/m of the block) and the intra phase's (the block): nothing else
    assert r["created"] == r["block"] + r["block"] // r["m"], r
