"""The cost model: what a strategy costs in memory, bytes and time, before and after a run.

  ledger.py     the method's memory and collectives per strategy, exact for this engine
  cluster.py    ``Cluster`` / ``Link`` files (TOML read and write; presets in ``clusters/``),
                which link a mesh dimension's rings use, a collective's time on a link
  model.py      ``ModelSpec`` (Llama shapes), activation memory, FLOPs, the engine's buckets
  predict.py    step time and memory of every strategy, ranking, ``choose_strategy``
  calibrate.py  measuring a real mesh into a ``Cluster`` (every rank calls it)

The facts about one collective are ``paro_fsdp.collectives``, beside the modules that issue them.
"""
