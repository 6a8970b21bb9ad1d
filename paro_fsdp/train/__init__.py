"""The torchtitan-style trainer's parts, which ``train.py`` at the repository root wires up: ``config`` (the
schema) and ``config_parse`` (TOML + CLI, and every error as one line), ``tokenizer``, ``data``, ``parallelize``
(process group, model, strategy, activation checkpointing, paro_shard, compile), ``hf_model`` (a Hugging Face
folder, LoRA, the export), ``optimizer``, ``lr``, ``checkpoint`` (DCP), ``metrics`` (log line, TensorBoard,
profiler), ``timeline``, ``faults`` (signals, the stop vote, failures, the exit status), ``torchrun`` (its store, grace
and command line, a config error told once) and ``estimate``."""
