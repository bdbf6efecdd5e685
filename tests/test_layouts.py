"""Expert tensor parallelism and a family's declared layouts: settable and refused the same way everywhere.

``ferrule check``, ``ferrule convert``, the train config's ``parallel`` section and the conformance kit take
``etp`` (and ``ep``); a layout the family does not support (``ModelFamilySpec.layouts``) or that megatron-core
cannot build (MoE biases at expert TP > 1: ``TransformerConfig.__post_init__``'s assertion, megatron-core
0.16.1) is one line, exit code 2, from every command, before any process starts.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from ferrule.contract.specs import LayoutSupport, ModelFamilySpec, SpecError

#: the tiny Qwen3-MoE checkpoint's own head / expert counts split at TP 2 and EP 2 (TINY_HF_CONFIG)
ETP_ONLY_1 = LayoutSupport(etp=(1,), reason="MoE biases")


def _qwen3_moe_with(monkeypatch, layouts: LayoutSupport) -> None:
    """Declare ``layouts`` on the in-tree qwen3_moe family of every registry built during the test (the
    in-process CLI builds its own)."""
    from ferrule.contract import registry
    build = registry.Registry.build.__func__

    def patched(cls, *args, **kwargs):
        reg = build(cls, *args, **kwargs)
        reg.families["qwen3_moe"] = dataclasses.replace(reg.families["qwen3_moe"], layouts=layouts)
        return reg

    monkeypatch.setattr(registry.Registry, "build", classmethod(patched))
    registry.reset_registry()


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """The kit's tiny random Qwen3-MoE checkpoint (read only), made once for this module."""
    from ferrule.conformance import numeric as cn

    return cn.tiny_hf_dir("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe") / "hf")


def test_layout_support_refuses_in_one_line_naming_degree_values_and_flag():
    from ferrule.megatron.parallel import ParallelLayout

    assert ETP_ONLY_1.refusal("fam", ParallelLayout(tp=2, etp=1)) is None
    line = ETP_ONLY_1.refusal("fam", ParallelLayout(tp=2))  # etp unset: megatron's default, = tp
    assert line == ("family 'fam' supports etp in [1] (MoE biases), not etp=2; set --etp / parallel.etp to one "
                    "of [1].")
    assert LayoutSupport(tp=(1, 2)).refusal("fam", ParallelLayout(tp=4)).startswith("family 'fam' supports tp in [1, 2]")
    with pytest.raises(SpecError, match=r"LayoutSupport.etp=\(0,\)"):
        LayoutSupport(etp=(0,))
    with pytest.raises(SpecError, match="use a LayoutSupport"):
        ModelFamilySpec(name="fam", model_types=("fam",), status="validated", layouts={"etp": 1})  # type: ignore[arg-type]


def test_moe_biases_need_expert_tp_1():
    """megatron-core asserts "Bias in Moe is only supported when ETP==1" inside the build; ferrule says it first."""
    from ferrule.megatron.gpt_config import check_layout_fits
    from ferrule.megatron.parallel import ParallelLayout, ParallelLayoutError

    kw = {"num_attention_heads": 4, "num_query_groups": 2, "num_layers": 2, "num_moe_experts": 4,
          "add_bias_linear": True}
    with pytest.raises(ParallelLayoutError, match=r"expert tensor-parallel size 2 \(the default: etp = tp\): "
                                                  r"megatron-core builds MoE layers with biases .* set --etp 1"):
        check_layout_fits(kw, ParallelLayout(tp=2))
    check_layout_fits(kw, ParallelLayout(tp=2, etp=1))
    check_layout_fits(dict(kw, add_bias_linear=False), ParallelLayout(tp=2))


def test_train_config_parallel_etp_reaches_the_layout_and_the_family_check(qwen3_moe_dir, monkeypatch):
    from ferrule.rl.config import ConfigError, config_from_dict
    from ferrule.rl.distributed import check_layout, layout_of

    import json

    hf = json.loads((qwen3_moe_dir / "config.json").read_text())
    _qwen3_moe_with(monkeypatch, ETP_ONLY_1)

    def cfg(**parallel):
        return config_from_dict({"model": {"hf_dir": "unused"}, "parallel": parallel}, validate=False)

    assert layout_of(cfg(tp=2, etp=1)).etp == 1 and layout_of(cfg(tp=2)).etp is None
    with pytest.raises(ConfigError, match=r"parallel: family 'qwen3_moe' supports etp in \[1\] \(MoE biases\), "
                                          r"not etp=2"):
        check_layout(cfg(tp=2), hf, 2)
    check_layout(cfg(tp=2, etp=1), hf, 2)


def test_check_and_convert_refuse_an_unsupported_layout_alike(qwen3_moe_dir, tmp_path, monkeypatch):
    """The same refusal: one line, exit code 2, from ``ferrule check`` and ``ferrule convert`` (it was 3 from
    check, a crash row, and 2 from convert); nothing written."""
    from inproc import run_ferrule

    src = qwen3_moe_dir
    _qwen3_moe_with(monkeypatch, ETP_ONLY_1)
    want = "family 'qwen3_moe' supports etp in [1] (MoE biases), not etp=2; set --etp / parallel.etp to one of [1]."
    import os

    env = dict(os.environ, COLUMNS="250")
    check = run_ferrule(["check", src, "--tp", "2"], env=env)
    convert = run_ferrule(["convert", "hf-to-torch-dist", src, tmp_path / "td", "--tp", "2"], env=env)
    for proc in (check, convert):
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        # ferrule's own lines only: a tinker SDK client of an earlier test in this worker may still print its
        # heartbeat warnings to this process's stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Tinker" not in ln and "heartbeat" not in ln]
        assert lines == [f"error: {want}"], proc.stderr
    assert not (tmp_path / "td").exists()
    bad = run_ferrule(["check", src, "--etp", "0"])
    assert bad.returncode == 2 and "--etp 0: expected a whole number >= 1" in bad.stderr


def _qwen2_typo():
    from ferrule.config_translation import ConfigTranslation, Constant
    from ferrule.plugins.qwen.qwen2 import CONFIG_TRANSLATION

    return ConfigTranslation("qwen2-typo", CONFIG_TRANSLATION.entries + (Constant("zero_centred_norms", True,
                                                                                    target="option"),))


def test_check_refuses_an_unknown_model_option_at_the_config_step(tmp_path, monkeypatch):
    """A translation producing an option the default build does not know: the config row said "ok" and the build
    failed later (exit 1 at tp=1, a crash, exit 3, at tp=2); now the config step refuses it, exit 2, at any tp."""
    import json
    import os

    from ferrule.conformance import numeric as cn
    from ferrule.contract import registry
    from inproc import run_ferrule

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(cn.tiny_hf_config("qwen2"))))
    build = registry.Registry.build.__func__

    def patched(cls, *args, **kwargs):
        reg = build(cls, *args, **kwargs)
        reg.converters["qwen2"] = dataclasses.replace(reg.converters["qwen2"],
                                                      config_translation="test_layouts:QWEN2_TYPO")
        return reg

    monkeypatch.setattr(registry.Registry, "build", classmethod(patched))
    monkeypatch.setattr(sys.modules[__name__], "QWEN2_TYPO", _qwen2_typo(), raising=False)
    registry.reset_registry()
    for tp in ("1", "2"):
        proc = run_ferrule(["check", tmp_path / "hf", "--tp", tp], env=dict(os.environ, COLUMNS="250"))
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "['zero_centred_norms'] that the builder does not know" in proc.stderr, proc.stderr
        assert "did you mean 'zero_centered_norms'" in proc.stderr


def test_plugins_shows_a_family_that_cannot_build_as_broken_and_an_old_option_as_deprecated(monkeypatch):
    """``ferrule plugins`` listed a package whose translation produces an option the builder refuses as
    healthy (round 3's Gemma-3 and 13 variants); now its cheap build check (no torch) shows it broken, and
    a deprecated option (still built, with a warning) is named with its replacement."""
    import os

    from ferrule.conformance import numeric as cn
    from ferrule.contract import registry
    from ferrule.config_translation import ConfigTranslation, Constant
    from ferrule.plugins.qwen.qwen2 import CONFIG_TRANSLATION
    from inproc import run_ferrule

    module = sys.modules[__name__]
    monkeypatch.setattr(module, "TINY_HF_CONFIG", cn.tiny_hf_config("qwen2"), raising=False)
    monkeypatch.setattr(module, "QWEN2_TYPO", _qwen2_typo(), raising=False)
    monkeypatch.setattr(module, "QWEN2_OLD", ConfigTranslation("qwen2-old", CONFIG_TRANSLATION.entries + (
        Constant("local_rotary_base", 10000.0, target="option"),)), raising=False)
    build = registry.Registry.build.__func__

    def patched(cls, *args, **kwargs):
        reg = build(cls, *args, **kwargs)
        for family, ref in (("qwen2", "test_layouts:QWEN2_TYPO"), ("qwen3", "test_layouts:QWEN2_OLD")):
            reg.converters[family] = dataclasses.replace(reg.converters[family], config_translation=ref)
        return reg

    monkeypatch.setattr(registry.Registry, "build", classmethod(patched))
    registry.reset_registry()
    proc = run_ferrule(["plugins"], env=dict(os.environ, COLUMNS="400"))
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("│ qwen")}
    assert "broken" in rows["qwen2"] and "['zero_centred_norms']" in rows["qwen2"], rows["qwen2"]
    assert "validated" in rows["qwen3"] and "'local_rotary_base' is deprecated: use the layer_rope" in rows["qwen3"]
    assert "broken" not in rows["qwen3_moe"] and "validated" in rows["qwen3_moe"]
