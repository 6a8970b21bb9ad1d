"""The torchtitan-style trainer's parts (``train.py`` at the repository root wires them up):
``config`` (TOML + CLI), ``tokenizer``, ``data`` (offline packed windows), ``lr`` (schedule),
``parallelize`` (model + activation checkpointing + paro_shard), ``hf_model`` (``model.name =
"hf"``: a Hugging Face folder, LoRA, the export), ``metrics`` (log line,
TensorBoard, profiler), ``checkpoint`` (torch.distributed.checkpoint)."""
