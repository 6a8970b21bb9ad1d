"""The benchmarks: ``python -m tools.bench`` (the headline, on the emulated cluster of
``tools.emulate``) and ``python -m tools.bench.<module>`` for the others.

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
  compile_time.py     the first (compiling) step, cold and warm, against FSDP2
  advisor_check.py    the advisor's predicted step times against measured ones

Nothing of the package ``paro_fsdp`` imports these.
"""
import os

# one thread per rank, set before torch loads (every module here imports it): 2 cores shared by 4 ranks
os.environ.setdefault("OMP_NUM_THREADS", "1")
