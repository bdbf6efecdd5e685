"""ferrule: a plugin-architecture model-support framework for LLM reinforcement learning.

Public surface kept import-light (no torch, no megatron): the pluggy markers, the spec
dataclasses and the version. Heavy pieces live in submodules (``ferrule.megatron``,
``ferrule.rollout``, ``ferrule.converters``) and are imported on demand.
"""

from importlib.metadata import PackageNotFoundError, version as _version

import pluggy

from ferrule import compat, lazy_jit

PROJECT_NAME = "ferrule"
#: Entry-point group that in-tree and third-party plugin packages register under.
ENTRY_POINT_GROUP = "ferrule"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

try:
    __version__ = _version("ferrule")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"

__all__ = ["hookimpl", "hookspec", "PROJECT_NAME", "ENTRY_POINT_GROUP", "__version__"]

compat.install()  # old import paths of the previous release, with a warning (ferrule.compat: one table)
lazy_jit.install()  # before any megatron import: its torch.compile decorations compile at first call on CPU
