"""A torch.compile backend for tests that look at the graphs a model compiles to: AOTAutograd's
forward and backward graphs run as they are (no inductor codegen), each handed to ``on_graph``
once when compiled, and every run counted per phase."""
from __future__ import annotations

from typing import Callable, MutableMapping

import torch.fx
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd


def counting_backend(runs: MutableMapping[str, int], on_graph: Callable[[str, torch.fx.GraphModule], None]):
    """``runs[phase]`` ("forward" / "backward") counts graph runs; ``on_graph(phase, gm)`` sees
    each graph once, before its first run."""
    def compiler(phase: str):
        def compile_graph(gm, example_inputs):
            on_graph(phase, gm)
            boxed = make_boxed_func(gm.forward)

            def run(args):
                runs[phase] = runs.get(phase, 0) + 1
                return boxed(args)
            run._boxed_call = True
            return run
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)
