"""``python -m tools.gpu_check``: one command that checks the CUDA + NCCL path on one GPU (the
trainer against CPU gloo, every engine buffer on the device, memory against ``memory_report``,
tokens/s and MFU against FSDP2, four ranks over the engine's streams with stand-in collectives, the
CUDA sanitizer and the sync debug mode). ``cli.py`` says what each part checks.

  cli.py         the command line: parse, plan, run the parts, print the table, write the JSON
  plan.py        the parts, their timeouts and shapes, the trainer commands of part (a), --dry-run
  runner.py      the parent: each part in its own subprocess and process group, with its timeout
  checks.py      the arithmetic that decides PASS / FAIL (no torch)
  report.py      the table, the JSON file, the per-part result lines, reading metrics.jsonl
  trainer.py     part (a): train.py on NCCL against gloo CPU, bf16, compiled, resumed
  placement.py   part (b): every buffer of all 27 strategies on the device (fake 2 x 4 world)
  memory.py      part (b)'s memory cases, and the Llama shapes and seeded init (b) and (c) share
  throughput.py  part (c): tokens/s and MFU, PaRO vs FSDP2, eager and compiled
  rows.py        parts (d), (e): a pytest plugin, each stream test (tests/test_gpu_streams.py,
                 tests/test_gpu_sanitizer.py) a row as it finishes

Nothing of the engine imports this package.
"""
