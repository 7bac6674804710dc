"""The Shapes world: the embedded default model, its judges and the benchmark bed."""
