"""accelerate's FSDP2 on CPU ranks (gloo), for the tests: the shim, written once.

Why it is needed: accelerate ties FSDP to an accelerator device. On CPU ranks its state takes the
MULTI_CPU branch (``AcceleratorState.__init__``), which never reads the FSDP plugin, so
``prepare`` would silently run multi-CPU DDP. After the ``Accelerator`` is built,
``fsdp_on_cpu`` puts FSDP back where accelerate reads it: the distributed type (the
``AcceleratorState``'s and ``PartialState``'s shared one: ``is_fsdp2``, ``prepare``,
``accumulate``, ``clip_grad_norm_``, ``save_state``, ``get_state_dict`` branch on it) and the
plugin; a ``ParallelismConfig`` (refused on MULTI_CPU) and its device mesh are attached after it,
as ``Accelerator.__init__`` attaches them. Barriers under FSDP pass
``device_ids``, which gloo accepts on CPU.

The HF ``Trainer`` builds its ``Accelerator`` itself, in ``create_accelerator_and_postprocess``:
``cpu_trainer(cls)`` is a subclass of a Trainer class (``Trainer``, TRL's ``SFTTrainer``) that
builds it with ``cpu=True`` (which ``use_cpu`` does not pass), runs the shim and sets the flag the
Trainer reads from the state (``is_fsdp_enabled``).

Each test builds several Accelerators in one process: ``fresh_accelerator`` clears accelerate's
process-wide shared states first (the process group stays), as accelerate's own tests do.
"""
from __future__ import annotations

from typing import Any


def reset_accelerate() -> None:
    """Forget accelerate's process-wide states (not the process group) before a new Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def fsdp_on_cpu(accelerator: Any, plugin: Any, parallelism_config: Any = None) -> Any:
    """Turn the multi-CPU state ``Accelerator(cpu=True, fsdp_plugin=plugin)`` fell back to into
    FSDP, then attach ``parallelism_config`` and its mesh as ``Accelerator.__init__`` would."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if plugin is None:
        return accelerator
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP  # AcceleratorState and PartialState share one dict
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if state.mixed_precision != "no":  # what the FSDP branch would have done
        plugin.set_mixed_precision(state.mixed_precision)
    if parallelism_config is not None:
        state.parallelism_config = parallelism_config
        state.device_mesh = parallelism_config.get_device_mesh(accelerator.device.type)
        parallelism_config._validate_accelerator(accelerator)
    assert accelerator.is_fsdp2 == (plugin.fsdp_version == 2)
    return accelerator


def fresh_accelerator(**kwargs: Any) -> Any:
    """``Accelerator(cpu=True, **kwargs)`` on a clean accelerate state, its FSDP plugin kept (without
    ``cpu=True`` a CPU machine is "no distributed": one process, unsharded batches). A
    ``parallelism_config`` is attached afterwards: accelerate refuses one on MULTI_CPU."""
    from accelerate import Accelerator

    reset_accelerate()
    pc = kwargs.pop("parallelism_config", None)
    return fsdp_on_cpu(Accelerator(cpu=True, **kwargs), kwargs.get("fsdp_plugin"), pc)


def cpu_trainer(cls: type) -> type:
    """A subclass of the Trainer class ``cls`` whose Accelerator keeps its FSDP plugin on CPU."""

    class CPUTrainer(cls):  # type: ignore[misc, valid-type]
        def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
            args = super()._build_accelerator_args(**kwargs)
            self._cpu_fsdp_plugin = args.get("fsdp_plugin")  # the plugin the parent built, kept
            reset_accelerate()
            return {**args, "cpu": True}  # else one process in accelerate's eyes: no sharded batches

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            fsdp_on_cpu(self.accelerator, self._cpu_fsdp_plugin)
            self.is_fsdp_enabled = self._cpu_fsdp_plugin is not None

    CPUTrainer.__name__ = CPUTrainer.__qualname__ = f"CPU{cls.__name__}"
    return CPUTrainer
