"""The cost model: what a strategy costs in memory, bytes and time, before and after a run.

  collectives.py  ring bytes, ring steps and time on a link of one collective; the counter type
                  of every ledger (the engine's ``CommStats``, the spec's ``ledger.Traffic``)
  cluster.py      ``Cluster`` / ``Link`` files (TOML read and write; presets in ``clusters/``)
                  and which link a mesh dimension's rings use
  model.py        ``ModelSpec`` (Llama shapes), activation memory, FLOPs, the engine's buckets
  predict.py      step time and memory of every strategy, ranking, ``choose_strategy``
  calibrate.py    measuring a real mesh into a ``Cluster`` (every rank calls it)
  estimate.py     the engine itself on a fake world (FakeTensorMode) beside the ledger
  report.py       sweeps, plots and the command line of ``python -m tools.advisor``
  local_ranks.py  running a function on N local gloo ranks (calibration, checks, tests)

This ``__init__`` imports nothing, so the engine can use ``collectives`` without loading the
rest (which reads TOML and the model zoo).
"""
