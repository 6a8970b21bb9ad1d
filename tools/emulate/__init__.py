"""The cluster emulator: ``python -m tools.emulate``.

  emulator.py  network namespaces per node, tc-shaped veth links, tx byte counters (root)
  launch.py    one torchrun per emulated node, logs, teardown; the command line

The benchmarks in ``tools.bench`` launch their workers through it.
"""
