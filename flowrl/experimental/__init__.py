"""Options that do not yet learn reliably, kept runnable and tested but not recommended: TAGRPO (tagrpo.py, `trainer:
tagrpo`) collapses on every seed of the toy image-to-video world (docs/recipes/tagrpo.md).

An experimental recipe builds on the recipes of flowrl.trainers, whose registry (TRAINERS) lists it: the trainers
package is imported first, so that importing a module here loads the registry before the recipe that joins it."""

import flowrl.trainers  # noqa: F401
