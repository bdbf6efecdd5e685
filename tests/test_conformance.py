"""Run ferrule's own conformance kit over every registered family (the in-tree qwen2, qwen3,
qwen3_moe, inkling, and the example llama plugin when installed)."""

import os
from pathlib import Path

import pytest

from ferrule.plugins.qwen import qwen3
from ferrule.contract.specs import UpdateGroup
from ferrule.conformance.kit import FamilyConformance, run_conformance_check


class TestFamilyConformance(FamilyConformance):
    families = None


#: Qwen3's update groups with one attention suffix mistyped ("linear_qkv.weigth").
QWEN3_TYPO_GROUPS = tuple(
    UpdateGroup(key=g.key, optional=g.optional,
                suffixes=tuple(s.replace("linear_qkv.weight", "linear_qkv.weigth") for s in g.suffixes))
    for g in qwen3.UPDATE_GROUPS
)


def test_mistyped_update_group_suffix_is_named(monkeypatch):
    """The coverage case fails on a table with a mistyped suffix, and its message names the suffix."""
    tests_dir = str(Path(__file__).resolve().parent)  # the check's interpreter imports this module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")])))
    assert "self_attention.linear_qkv.weigth" in {s for g in QWEN3_TYPO_GROUPS for s in g.suffixes}
    with pytest.raises(AssertionError) as exc:
        run_conformance_check("check_update_groups_cover_parameters", "qwen3", "test_conformance:QWEN3_TYPO_GROUPS")
    message = str(exc.value)
    assert "self_attention.linear_qkv.weigth" in message, message
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in message, message  # the orphaned parameter


def test_media_case_catches_a_wrong_tower(tmp_path, monkeypatch):
    """The kit's media case fails when a tower computes something else than transformers' (here: its norms'
    epsilon); with the right epsilon the same run passes."""
    from ferrule.conformance.media import check_media_logits_parity
    from ferrule.plugins.inkling import towers

    monkeypatch.setattr(towers, "TOWER_NORM_EPS", 0.5)  # transformers' is 1e-6
    with pytest.raises(AssertionError, match="Megatron\\+towers vs HF logits with media"):
        check_media_logits_parity("inkling", str(tmp_path / "0.5"))
    monkeypatch.setattr(towers, "TOWER_NORM_EPS", 1e-6)
    assert check_media_logits_parity("inkling", str(tmp_path / "1e-06"))["logits_max_abs_diff"] <= 1e-5


def test_round_trip_check_writes_its_checkpoint_in_this_process(tmp_path, monkeypatch):
    """The kit's round trip saves torch_dist as ``ferrule convert`` does (``save_sharded``): megatron's own
    writer starts a ``multiprocessing`` manager process, which fails from a plain script without a
    ``__main__`` guard (spawn re-imports the script) and costs an interpreter start per run."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from ferrule.conformance import numeric as cn

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    cn.check_round_trip("qwen2", tmp_path)
    assert filesystem_async._results_queue is None, "megatron's writer started its manager process"
