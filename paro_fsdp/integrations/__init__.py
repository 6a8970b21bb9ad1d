"""Plug-ins that run the PaRO engine inside other trainers (each an optional extra)."""
