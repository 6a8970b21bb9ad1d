"""PaRO strategies: three levels (P, G, OS), each N, I or G, and per-tensor policies.

A strategy is written like the paper: ``"IIG"`` means parameters and gradients are sharded
inside the group and the optimizer state is sharded over all ranks.
"""
from __future__ import annotations

import enum
import fnmatch
import itertools
from dataclasses import dataclass
from typing import Callable, Mapping, Union

import torch


class Level(str, enum.Enum):
    """How finely one model state is partitioned."""

    N = "N"  # not partitioned: every rank holds the whole tensor
    I = "I"  # partitioned inside the group (m ranks), replicated across groups  # noqa: E741
    G = "G"  # partitioned over all n ranks, nested inside the intra shard

    def divisor(self, n: int, m: int) -> int:
        """d(level) of the method's memory formula."""
        return {Level.N: 1, Level.I: m, Level.G: n}[self]


_KNOWN_NAMES = {"NNN": "DDP", "NNG": "ZeRO-1", "NGG": "ZeRO-2", "GGG": "ZeRO-3 / FSDP full shard",
                "III": "MiCS / FSDP hybrid shard"}


@dataclass(frozen=True)
class Strategy:
    """Levels of parameters (p), gradients (g) and optimizer state (os)."""

    p: Level
    g: Level
    os: Level

    @classmethod
    def parse(cls, value: "StrategyLike") -> "Strategy":
        if isinstance(value, Strategy):
            return value
        if not isinstance(value, str):
            raise TypeError(f"a strategy is a 3-letter string like 'IIG' or a Strategy, got {value!r}")
        text = value.strip().upper()
        if len(text) != 3 or any(c not in "NIG" for c in text):
            raise ValueError(f"unknown PaRO strategy {value!r}: use three letters from N, I, G (P, G, OS levels), "
                             f"e.g. 'IIG', 'NIG', 'GGG'; all 27 are valid")
        return cls(Level(text[0]), Level(text[1]), Level(text[2]))

    @property
    def name(self) -> str:
        return self.p.value + self.g.value + self.os.value

    @property
    def known_as(self) -> str:
        return _KNOWN_NAMES.get(self.name, "PaRO")

    def __str__(self) -> str:
        return self.name


StrategyLike = Union[str, Strategy]
PolicyLike = Union[StrategyLike, Mapping[str, StrategyLike], Callable[[str, torch.nn.Parameter], StrategyLike]]

ALL_STRATEGIES: tuple[str, ...] = tuple("".join(s) for s in itertools.product("NIG", repeat=3))


def resolve_policy(policy: PolicyLike, named_params: list[tuple[str, torch.nn.Parameter]]) -> dict[str, Strategy]:
    """Every parameter name's strategy. A dict: the first fnmatch pattern that matches wins,
    ``"default"`` the rest; a pattern matching nothing is an error (almost always a typo)."""
    if isinstance(policy, (str, Strategy)):
        strategy = Strategy.parse(policy)
        return {name: strategy for name, _ in named_params}
    if isinstance(policy, Mapping):
        patterns = {k: Strategy.parse(v) for k, v in policy.items() if k != "default"}
        default = Strategy.parse(policy["default"]) if "default" in policy else None
        used, out = set(), {}
        for name, _ in named_params:
            for pattern, strategy in patterns.items():
                if fnmatch.fnmatchcase(name, pattern):
                    out[name] = strategy
                    used.add(pattern)
                    break
            else:
                if default is None:
                    raise ValueError(f"parameter {name!r} matches no pattern of the policy {list(policy)}; "
                                     "add a 'default' entry or a pattern that covers it")
                out[name] = default
        unused = [p for p in patterns if p not in used]
        if unused:
            sample = ", ".join(n for n, _ in named_params[:4])
            raise ValueError(f"policy pattern(s) {unused} match no parameter; patterns are fnmatch over "
                             f"parameter names such as {sample}, ...")
        return out
    if callable(policy):
        return {name: Strategy.parse(policy(name, p)) for name, p in named_params}
    raise TypeError(f"policy must be a strategy string, a Strategy, a dict or a callable, got {type(policy)}")
