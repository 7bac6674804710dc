"""Model adapters: one file per family over diffusers classes."""
