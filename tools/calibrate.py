"""Measure the real mesh and write a cluster file the advisor reads.

    torchrun --nproc-per-node 8 --nnodes 4 ... -m tools.calibrate --out my_cluster.toml
    python -m tools.calibrate --nproc 4 --group-size 2 --out cpu4.toml     # local gloo ranks on CPU
    python -m tools.advisor --cluster my_cluster.toml --model llama7b --gpus 64 ...

Why: the advisor's predictions are only as good as its bandwidths, latencies and FLOP/s, and
datasheet figures are optimistic (and say nothing about a particular fabric). This runs the
collectives PaRO uses on the mesh PaRO uses — all-gather, reduce-scatter and all-reduce over
the ``intra`` and the ``inter`` dimension of the (n/m, m) mesh, every group at once as in
training, at several buffer sizes — and fits time = (ring steps) x latency + ring bytes /
bandwidth per kind and dimension; it also times a matmul, one transformer block's forward +
backward at the model's shape (the achieved FLOP/s the advisor uses), memory bandwidth and how
well a collective overlaps compute. Any backend: NCCL on GPUs, gloo on CPU. Every rank takes
part; rank 0 writes the TOML (``[measured]`` keeps the raw timings).

The file describes *this* mesh: ``gpus_per_node`` = the group size, ``[intra]`` = the intra
dimension's links, ``[inter]`` = the inter dimension's, per GPU while all ranks communicate.
Calibrate with the group size you will train with (normally the GPUs per node) and at least
two groups, so that the inter links are measured (with one group, [inter] copies [intra]).
"""
import sys

from paro_fsdp.cost.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
