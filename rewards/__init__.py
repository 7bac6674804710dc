"""Reward scorers; each module registers itself in flowrl.registry.REWARDS."""
