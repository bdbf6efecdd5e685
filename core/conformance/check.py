"""``python -m ferrule.conformance.check CHECK FAMILY [GROUPS_REF]``: run one check of
:mod:`ferrule.conformance.numeric` on a family in this (fresh) interpreter and print one JSON line,
``{"value": result}`` or ``{"skip": "no TINY_HF_CONFIG"}``
(:func:`ferrule.conformance.kit.run_conformance_check` starts it).

``GROUPS_REF`` is a ``"module:attr"`` reference passed as the check's ``groups=`` (tests hand in a
deliberately broken table). A failing check raises: its traceback is the process's stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from ferrule.conformance import numeric as cn
from ferrule.contract.specs import resolve_ref


def main(argv: Sequence[str]) -> int:
    check, family, *refs = argv
    if cn.tiny_hf_config(family) is None:
        print(json.dumps({"skip": "no TINY_HF_CONFIG"}))
        return 0
    kw = {"groups": resolve_ref(refs[0])} if refs else {}
    print(json.dumps({"value": getattr(cn, check)(family, **kw)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
