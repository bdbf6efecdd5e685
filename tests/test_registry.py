"""Plugin loading, isolation, strict mode, allow-list, duplicate claims and the facade."""

from __future__ import annotations

from importlib import metadata

import pytest

import plugin_samples as ps
from ferrule.contract import registry
from ferrule.contract.registry import (
    DuplicateClaimError,
    IncompleteFamilyError,
    PluginLoadError,
    Registry,
    UnknownModelError,
)


def _fake_entry_points(monkeypatch, eps: dict[str, str]) -> None:
    fake = [metadata.EntryPoint(name=n, value=v, group="ferrule") for n, v in eps.items()]
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: fake if group == "ferrule" else [])
    monkeypatch.delenv("FERRULE_PLUGINS", raising=False)
    monkeypatch.delenv("FERRULE_STRICT_PLUGINS", raising=False)


def _registry_with(*objs) -> Registry:
    pm, _, _ = registry.get_plugin_manager(load_entrypoints=False)
    infos, failures = [], []
    for name, dist, obj in objs:
        info, failure = registry.register_object(pm, obj, name=name, distribution=dist, version="1.0")
        infos += [info] if info else []
        failures += [failure] if failure else []
    return Registry.build(pm, infos, failures)


def test_broken_plugin_is_isolated(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good", "broken": "no_such_module_xyz:plugin"})
    reg = registry.get_registry()
    assert list(reg.families) == ["demo"]
    assert [p.name for p in reg.plugins] == ["good"]
    (failure,) = reg.failures
    assert failure.entry_point == "broken" and failure.stage == "import"
    assert "ModuleNotFoundError" in failure.error and "no_such_module_xyz" in failure.traceback


def test_strict_mode_raises_on_broken_plugin(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good", "broken": "no_such_module_xyz:plugin"})
    monkeypatch.setenv("FERRULE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="broken.*import"):
        registry.get_registry()


def test_allow_list_skips_unlisted(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good", "broken": "no_such_module_xyz:plugin"})
    monkeypatch.setenv("FERRULE_PLUGINS", "good")
    reg = registry.get_registry()
    assert [p.name for p in reg.plugins] == ["good"] and reg.failures == []


def test_misspelled_hookimpl_fails_that_plugin_only(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good", "typo": "plugin_samples:misspelled"})
    reg = registry.get_registry()
    assert list(reg.families) == ["demo"]
    (failure,) = reg.failures
    assert failure.entry_point == "typo" and failure.stage == "validate"
    assert "register_model_familys" in failure.error
    monkeypatch.setenv("FERRULE_STRICT_PLUGINS", "1")
    registry.reset_registry()
    with pytest.raises(PluginLoadError, match="register_model_familys"):
        registry.get_registry()


def test_duplicate_model_type_names_both_distributions():
    with pytest.raises(DuplicateClaimError) as exc:
        _registry_with(("good", "dist-alpha", ps.GoodPlugin()), ("clash", "dist-beta", ps.ClashingPlugin()))
    msg = str(exc.value)
    assert "demo_lm" in msg and "dist-alpha" in msg and "dist-beta" in msg


def test_duplicate_family_names_both_distributions():
    with pytest.raises(DuplicateClaimError, match="family 'demo'.*dist-alpha.*dist-gamma"):
        _registry_with(("good", "dist-alpha", ps.GoodPlugin()), ("same", "dist-gamma", ps.SameFamilyPlugin()))


def test_duplicate_entry_point_name_across_distributions(monkeypatch):
    class _Dist:
        def __init__(self, name):
            self.name, self.version = name, "1"

    eps = []
    for dist in ("pkg-a", "pkg-b"):
        ep = metadata.EntryPoint(name="same", value="plugin_samples:good", group="ferrule")
        ep = ep._for(_Dist(dist)) if hasattr(ep, "_for") else ep
        eps.append(ep)
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: eps)
    monkeypatch.delenv("FERRULE_PLUGINS", raising=False)
    with pytest.raises(DuplicateClaimError, match="pkg-a.*pkg-b"):
        registry.get_registry()


def test_raising_hook_is_recorded_then_strict_raises(monkeypatch):
    monkeypatch.delenv("FERRULE_STRICT_PLUGINS", raising=False)
    reg = _registry_with(("good", "d1", ps.GoodPlugin()), ("bad", "d2", ps.RaisingHookPlugin()))
    assert list(reg.families) == ["demo"]
    (failure,) = reg.failures
    assert failure.stage == "register_model_families" and "boom" in failure.error
    monkeypatch.setenv("FERRULE_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="boom"):
        _registry_with(("bad", "d2", ps.RaisingHookPlugin()))


def test_hook_returning_wrong_type_is_a_failure(monkeypatch):
    monkeypatch.delenv("FERRULE_STRICT_PLUGINS", raising=False)
    reg = _registry_with(("wrong", "d3", ps.WrongTypePlugin()))
    (failure,) = reg.failures
    assert "expected ProviderSpec" in failure.error


def test_unknown_model_type_lists_families_and_failures(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good", "broken": "no_such_module_xyz:plugin"})
    with pytest.raises(UnknownModelError) as exc:
        registry.family_for_hf_config({"model_type": "gpt_neox"})
    msg = str(exc.value)
    assert "'gpt_neox'" in msg and "demo (model_types: demo_lm)" in msg
    assert "broken" in msg and "ModuleNotFoundError" in msg
    with pytest.raises(UnknownModelError, match="no family or model_type named 'nope'"):
        registry.get_family("nope")


def test_family_lookup_by_name_model_type_text_config_and_resolver():
    reg = _registry_with(("good", "d1", ps.GoodPlugin()), ("res", "d2", ps.ResolverPlugin()))
    assert reg.get_family("demo").name == "demo"
    assert reg.get_family("demo_lm").name == "demo"
    assert reg.family_for_hf_config({"model_type": "demo_lm"}).name == "demo"
    assert reg.family_for_hf_config({"model_type": "wrapper", "text_config": {"model_type": "demo_lm"}}).name == "demo"
    assert reg.family_for_hf_config({"model_type": "x", "architectures": ["LegacyResolvedModel"]}).name == "resolved"
    with pytest.raises(UnknownModelError):
        reg.family_for_hf_config({"model_type": "x", "architectures": ["Other"]})


def test_completeness_checks():
    reg = _registry_with(("half", "d1", ps.IncompleteValidatedPlugin()), ("full", "d2", ps.CompletePlugin()))
    assert reg.missing_parts("half") == ["converter", "update_groups"]
    assert reg.missing_parts("full") == []
    with pytest.raises(IncompleteFamilyError, match="half \\(VALIDATED\\) lacks converter, update_groups"):
        reg.check_complete()
    with pytest.raises(IncompleteFamilyError, match="no converter registered"):
        reg.get_converter("half")
    assert reg.get_provider("full_lm").build == "os.path:join"
    assert reg.get_update_groups("full").groups[0].key == "all"


def test_in_tree_plugins_register_all_families():
    names = [f.name for f in registry.list_families()]
    assert {"qwen2", "qwen3", "qwen3_moe", "inkling"} <= set(names)
    assert registry.get_family("inkling_mm_model").name == "inkling"
    assert registry.family_for_hf_config({"model_type": "qwen3_moe"}).name == "qwen3_moe"
    reg = registry.get_registry()
    assert reg.failures == []
    assert {p.distribution for p in reg.plugins if p.name in ("qwen", "inkling")} == {"ferrule"}


def test_lora_appliers_chat_templates_and_towers():
    reg = _registry_with(("feat", "d1", ps.FeaturesPlugin()))
    kinds = [(s.kind, s.family, s.apply) for s in reg.iter_lora_appliers("mm")]
    # the family's own attention applier wins over the "*" one; lm_head falls back to "*"
    assert kinds == [("attention", "mm", "os.path:split"), ("lm_head", "*", "os.path:join")]
    assert reg.get_chat_template("mm_chat").stop_tokens == ("<end>",)
    assert [t.name for t in reg.chat_templates_for("mm_lm")] == ["mm_chat"]
    with pytest.raises(UnknownModelError, match="registered: \\['mm_chat'\\]"):
        reg.get_chat_template("nope")
    assert [(t.modality, t.placeholder_token_id) for t in reg.get_towers("mm")] == [("audio", 6), ("vision", 5)]
    assert reg.missing_parts("mm") == ["provider", "converter", "update_groups"]
    with pytest.raises(DuplicateClaimError, match="tower 'mm/vision'.*d1.*d2"):
        _registry_with(("feat", "d1", ps.FeaturesPlugin()), ("tower2", "d2", ps.SecondTowerPlugin()))


def test_declared_features_must_be_registered():
    reg = _registry_with(("good", "d1", ps.GoodPlugin()))
    spec = ps.ModelFamilySpec(name="needs", model_types=("needs_lm",), status=ps.FamilyStatus.STRUCTURAL,
                              reason="x", features=("lora", "chat_template", "towers"))
    reg.families["needs"] = spec
    assert reg.missing_parts("needs") == ["provider", "converter", "update_groups", "lora", "chat_template", "towers"]


def test_allow_list_entry_that_matches_nothing_is_reported(monkeypatch):
    _fake_entry_points(monkeypatch, {"good": "plugin_samples:good"})
    monkeypatch.setenv("FERRULE_PLUGINS", "good,godo")
    reg = registry.get_registry()
    assert list(reg.families) == ["demo"]
    (failure,) = reg.failures
    assert failure.stage == "allow-list" and "'godo'" in failure.error and "good" in failure.error
    monkeypatch.setenv("FERRULE_STRICT_PLUGINS", "1")
    registry.reset_registry()
    with pytest.raises(PluginLoadError, match="'godo'.*installed: good"):
        registry.get_registry()


def test_lazy_update_groups_and_default_provider_build(monkeypatch):
    """UpdateGroupTable.groups may be a "module:attr" reference (resolved when handed out), and a
    ProviderSpec without build calls megatron's GPT builder with the family's config-translation rows."""
    import ferrule.megatron.gpt_builder as gpt_builder

    reg = _registry_with(("lazy", "dist-lazy", ps.LazyFamilyPlugin()))
    assert reg.update_groups["lazy"].groups == "plugin_samples:LAZY_GROUPS"
    table = reg.get_update_groups("lazy")
    assert table.groups is ps.LAZY_GROUPS and reg.update_groups["lazy"] is table
    calls = []
    monkeypatch.setattr(gpt_builder, "build_from_hf_config",
                        lambda hf_config, layout, translation, **options: calls.append(
                            (hf_config, layout, translation, options)) or ["model"])
    build = reg.provider_build("lazy")
    assert build({"model_type": "lazy_lm"}, "LAYOUT", params_dtype="fp32") == ["model"]
    assert calls == [({"model_type": "lazy_lm"}, "LAYOUT", ps.LAZY_GROUPS, {"params_dtype": "fp32"})]
    assert reg.missing_parts("lazy") == []


def test_command_names_are_claimed_once():
    with pytest.raises(DuplicateClaimError, match="CLI command 'hello'.*d1.*d2"):
        _registry_with(("a", "d1", ps.CommandPlugin()), ("b", "d2", ps.CommandPlugin()))
