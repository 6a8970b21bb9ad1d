"""The cost model: what a strategy costs in memory, bytes and time, before a run (the ledger, the
time model over a cluster file) and after one (calibration); its modules: docs/ARCHITECTURE.md."""
