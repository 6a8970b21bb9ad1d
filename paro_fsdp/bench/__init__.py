"""The benchmarks and the cluster emulator behind ``python -m tools.bench``, ``tools.emulate``,
``tools.bench_collectives``, ``tools.bench_vs_fsdp2``, ``tools.bench_compile`` and
``tools.advisor_check`` (each tool is a thin command line over one ``main`` here).

  emulator.py         network namespaces per node, tc-shaped veth links, tx byte counters
  launch.py           one torchrun per emulated node, logs, teardown; the emulate command line
  headline.py         the headline benchmark's command line and driver (on the emulator)
  headline_worker.py  its per-rank side: every strategy and baseline, interleaved rounds
  headline_report.py  its table, verdicts and PNG
  compiled_emulated.py         its --compiled mode: compiled variants, each pass alone, compile counts
  compiled_emulated_report.py  their table, targets and link timeline PNGs
  collectives.py      PaRO-CC vs the flat gloo collective on the emulator
  workload.py         the bench Llama, data, optimizer settings and reductions the benches share
  vs_fsdp2.py         PaRO GGG / III vs FSDP2 ZeRO-3 / HSDP on 4 spawned gloo ranks
  engine_profile.py   its --profile: the engine's functions timed, op tables side by side
  compiled.py         eager vs compiled vs compiled + passes, and FSDP2 + torch.compile
  advisor_check.py    the advisor's predicted step times against measured ones

Nothing of the engine imports this package.
"""
