"""paro-fsdp: PaRO (Partial Redundancy Optimizer) data parallelism on DTensor."""
from .api import ParoModule, paro_shard
from .collectives import CommStats
from .mesh import init_paro_mesh
from .mixed_precision import MixedPrecision
from .optim import ParoOptimizer
from .strategy import ALL_STRATEGIES, Level, Strategy

__all__ = [
    "ALL_STRATEGIES",
    "CommStats",
    "Level",
    "MixedPrecision",
    "ParoModule",
    "ParoOptimizer",
    "Strategy",
    "init_paro_mesh",
    "paro_shard",
]
