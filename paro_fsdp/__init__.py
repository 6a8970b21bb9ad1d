"""paro-fsdp: PaRO (Partial Redundancy Optimizer) data parallelism on DTensor, with FSDP2's contract."""
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, OffloadPolicy, UnshardHandle,
                                    register_fsdp_forward_method)

from .api import paro_shard
from .collectives import CommStats
from .fully_shard import fully_shard
from .mesh import init_paro_mesh
from .mixed_precision import MixedPrecision
from .module import ParoModule
from .optim import ParoOptimizer
from .strategy import ALL_STRATEGIES, Level, Strategy

# torch's FSDP2 names beside ours, so `from torch.distributed.fsdp import ...` becomes
# `from paro_fsdp import ...` with the same names (docs/fsdp2.md)
__all__ = [
    "ALL_STRATEGIES",
    "CommStats",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "Level",
    "MixedPrecision",
    "ParoModule",
    "ParoOptimizer",
    "Strategy",
    "fully_shard",
    "init_paro_mesh",
    "paro_shard",
]
