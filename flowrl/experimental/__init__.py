"""Options that do not yet learn reliably, kept runnable and tested but not recommended: TAGRPO (tagrpo.py) collapses
on every seed of the toy image-to-video world (docs/recipes/tagrpo.md)."""
