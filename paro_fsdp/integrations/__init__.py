"""Plug-ins that run the PaRO engine inside other trainers (``torchtitan``) and with other
libraries' models (``hf``: Hugging Face transformers and peft); each an optional extra."""
