"""``python -m ferrule.conformance.tp1 WORK FAMILY...``: the TP=1 cases of a kit class's families in one
fresh interpreter (:meth:`ferrule.conformance.kit.FamilyConformance.tp1_results` starts it).

For each family, one after the other: the numeric cases (round trip, mapping coverage, translated
fields, declared features, logits vs HF), the training step (gradients vs HF, every trained tensor synced through
the update groups: :func:`ferrule.conformance.numeric.check_training_step`), the update-group coverage and, for a
family with towers, the media case. Prints one JSON line
``{family: {"numeric": ..., "train": ..., "groups": ..., "media": ...}}``, each
``{"skip": why}``, ``{"error": "Type: message"}`` or the value; a failing case does not stop the others.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any
from ferrule.conformance import numeric as cn
from ferrule.conformance.media import check_media_logits_parity
from ferrule.contract import registry


def _run(case: Callable[[], Any]) -> Any:
    try:
        return case()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the case's one-line result
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: Sequence[str]) -> int:
    warnings.filterwarnings("ignore")  # before megatron / transformers are imported: only the JSON line matters
    # imported after the filter, for that reason (the checks import torch, megatron and transformers)

    def numeric(fam: str, w: str, train: dict) -> dict:
        cn.check_round_trip(fam, w + "/rt")
        cn.check_mapping_covers_provider(fam, w + "/cov")
        cn.check_translation_matches_hf(fam, w + "/fields")
        cn.check_features_reached(fam, w + "/features")
        # the training step on the logits case's two models (check_training_step's checks, one load for both)
        return {"logits_max_abs_diff": float(cn.check_logits_parity(fam, w + "/par", train=train))}

    work, *families = argv
    reg = registry.get_registry()
    out: dict[str, dict] = {}
    for fam in families:
        if fam not in reg.providers or fam not in reg.converters or cn.tiny_hf_config(fam) is None:
            out[fam] = {k: {"skip": "no TINY_HF_CONFIG"} for k in ("numeric", "train", "groups", "media")}
            continue
        w = f"{work}/{fam}"
        train: dict = {}
        out[fam] = {"numeric": _run(lambda: numeric(fam, w, train)),
                    "groups": _run(lambda: {"value": cn.check_update_groups_cover_parameters(fam)})
                    if fam in reg.update_groups else {"skip": "no update groups"},
                    "media": _run(lambda: check_media_logits_parity(fam, w + "/media"))
                    if registry.get_towers(fam) else {"skip": "no towers"}}
        # a numeric case before the logits failed: the training step did not run (its own checkpoint then)
        out[fam]["train"] = train or _run(lambda: cn.check_training_step(fam, w + "/train"))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
