"""Eager CPU micro-steps reuse the block-sized buffers of their collectives (comm.BufferPool):
within a micro-step, a parameter gather's output (P = I) or a gradient reduction's input (G = I,
G = G) of a size already allocated in it is not allocated again (one buffer per size, not one
per block and collective), and the pool is empty after every backward (nothing held between
micro-steps or steps). On 4 gloo ranks as 2 x 2; exactness with the pool is
test_paro_shard_strategies.py's."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world

STRATEGIES = ("III", "IIG", "IGG", "GGG")


def rank_main(payload: dict) -> dict:
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from workloads import batch, train_paro

    class NewStorage(TorchDispatchMode):
        """Sizes (bytes) of the storages the ops under it create (outputs not aliasing an input)."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                    self.sizes.append(t.untyped_storage().nbytes())
            return out

    out: dict = {}
    rank = dist.get_rank()
    for strategy in STRATEGIES:
        model, opt, _ = train_paro(strategy, 2, 2, steps=1)
        state = model._paro_state
        # the flat buffers the pool serves: the gathered block (P = I) and the reduction's input
        pooled = set()
        for g in state.groups:
            if g.strategy.p.name == "I":
                pooled.add(state.info.m * g.p_layout.sum_i * 4)
            if g.trainable and g.strategy.g.name == "I":
                pooled.add(state.info.m * g.t_layout.sum_i * 4)
            if g.trainable and g.strategy.g.name == "G":
                pooled.add(g.t_layout.numel_nested() * 4)
        created = []
        model.set_requires_gradient_sync(False)
        for a in range(2):
            with NewStorage() as mode:
                model(batch(rank, 1, a)).loss.backward()
            created.append([s for s in mode.sizes if s in pooled])
        model.set_requires_gradient_sync(True)
        model(batch(rank, 1, 2)).loss.backward()
        pool = getattr(state.comm, "pool", None)
        out[strategy] = {"created": created, "left": sum(map(len, pool.free.values())) if pool else 0}
        opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return run_world(4, rank_main, {})[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_micro_step_allocates_each_collective_buffer_size_once(results, strategy):
    for sizes in results[strategy]["created"]:
        assert sizes, "a micro-step allocates the buffers the pool then serves"
        assert len(sizes) == len(set(sizes)), sorted(sizes)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_pool_is_empty_after_a_backward(results, strategy):
    assert results[strategy]["left"] == 0
