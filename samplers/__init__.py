"""Rollout samplers; each module registers itself in flowrl.registry.SAMPLERS."""
