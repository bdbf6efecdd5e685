"""``python -m ferrule.conformance.discovery``: load the plugins and print, as one JSON line, the
families seen, the heavy modules (torch, megatron, transformers) discovery imported and the entry
points that failed (:func:`ferrule.conformance.kit.discovery_imports` runs it in a fresh interpreter).

Imports nothing but the registry: what it reports is what discovery itself imported.
"""

from __future__ import annotations

import json
import sys

from ferrule.contract import registry
#: the top-level packages whose import would make discovery slow (a plugin must import none of them)
HEAVY_MODULES = ("torch", "megatron", "transformers")


def main() -> int:
    reg = registry.get_registry()
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY_MODULES)
    print(json.dumps({"families": sorted(reg.families), "heavy": heavy,
                      "failures": [f.entry_point for f in reg.failures]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
