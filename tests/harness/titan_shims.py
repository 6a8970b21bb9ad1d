"""Test-only shims that let torchtitan 0.3's real Trainer run on CPU gloo ranks (never in the
package): the CPU device instead of a forced cuda, triton's import stubbed, the
``torch.distributed.set_timeout`` torch 2.13 lacks, an exact (float64) gradient norm (both
sides), SDPA attention (flex has no CPU backward),
and a generated tokenizer and data set (the wheel ships none).

``install()`` must run before anything imports torchtitan."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def install() -> None:
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # torchtitan falls back to "cuda"
    name = "torchtitan.distributed.minimal_async_ep.kernels"  # imports triton
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__file__ = "<stub>"

        def missing(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return lambda *a, **k: None

        stub.__getattr__ = missing
        sys.modules[name] = stub
    # the gradient norm (torchtitan's clip_grad_norm_ calls get_total_norm, over the
    # reference's parameters and over PaRO's DTensor ones alike): torch's CPU float32 norm kernels
    # accumulate in float32, off by ~1.5e-4 relative on the debug model's 0.5M-element output
    # layer, more than the 1e-5 the tests compare to; in float64 each side's norm is the exact
    # norm of its gradients, whatever the shards
    if not getattr(torch.nn.utils.get_total_norm, "_paro_wide", False):
        narrow = torch.nn.utils.get_total_norm

        def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
            tensors = [tensors] if torch.is_tensor(tensors) else list(tensors)
            wide = [t.to(torch.float64) if t.dtype == torch.float32 else t for t in tensors]
            return narrow(wide, norm_type, error_if_nonfinite, foreach).to(torch.float32)

        get_total_norm._paro_wide = True
        torch.nn.utils.get_total_norm = get_total_norm
    cpu = torch.cpu  # what torchtitan's memory monitor asks of its device module
    for attr, fn in {"get_device_name": lambda *a: "cpu", "memory_stats": lambda *a: {},
                     "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=2**34),
                     "reset_peak_memory_stats": lambda *a: None, "empty_cache": lambda: None}.items():
        if not hasattr(cpu, attr):
            setattr(cpu, attr, fn)


install()

import torchtitan.distributed.utils as _titan_dist  # noqa: E402

# shortens the process-group timeouts after step 1 with a barrier on a CUDA device id and the
# set_timeout torch 2.13 lacks: nothing to shorten on a CPU test world
_titan_dist.set_pg_timeouts = lambda **_: None

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402

VOCAB = 256


class SynthTokenizer(BaseTokenizer):
    """Bytes: enough for a trainer that never decodes."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()
        self.eos_id = 0

    def encode(self, text: str, *_: Any, **__: Any) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], *_: Any, **__: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return VOCAB


class SynthLoader(BaseDataLoader):
    """Deterministic token windows per (data-parallel rank, batch index). ``emulate_world``
    = w > 0: one process draws the w ranks' batches side by side (the single-process reference
    of a w-rank run). Its position is saved in checkpoints, so a resume continues the data."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        emulate_world: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 **_: Any) -> None:
        self.cfg, self.rank, self.seq_len = config, dp_rank, seq_len
        self.ranks = list(range(config.emulate_world)) if config.emulate_world else [dp_rank]
        assert local_batch_size % len(self.ranks) == 0
        self.per_rank = local_batch_size // len(self.ranks)
        self.i = 0

    def _window(self, rank: int, i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1_000 * i + rank)
        return torch.randint(1, VOCAB, (self.per_rank, self.seq_len + 1), generator=gen)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            x = torch.cat([self._window(r, self.i) for r in self.ranks])
            self.i += 1
            yield {"input": x[:, :-1]}, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = int(state["i"])


def sdpa_model_spec(flavor: str = "debugmodel"):
    """Llama 3 with SDPA (causal) attention: flex attention has no CPU backward, and the
    registry no longer offers SDPA for language models (our data carries no positions)."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(flavor)
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(attr, int):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec
