"""Graph passes for torch.compile over the engine's collectives (the compile issue; not implemented yet)."""
