"""flowrl: reinforcement learning for flow-matching image and video generators."""

import os as _os

__version__ = "0.1.0"

# The plugin folders rewards/ and samplers/ sit at the top of the repository; pyproject's package-dir maps them into
# this package (flowrl.rewards, flowrl.samplers) when it is installed, and a wheel holds them inside it. A checkout
# that is not installed (the repository on sys.path, as scripts/gpu_check.py puts it on a bare machine) has them
# beside this folder instead: searching the repository root as part of this package's path finds them there. Only
# then: an installed wheel has flowrl/rewards, and an editable install resolves to these same folders either way.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "rewards")) and all(
    _os.path.isfile(_os.path.join(_root, plugin, "__init__.py")) for plugin in ("rewards", "samplers")
):
    __path__.append(_root)
del _here, _root
