"""Spec dataclasses: frozen, keyword-only, picklable, validated."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from ferrule.contract.specs import (
    ChatTemplateSpec,
    ConverterSpec,
    FamilyStatus,
    LoRAApplierSpec,
    ModelFamilySpec,
    ProviderSpec,
    SpecError,
    TowerSpec,
    UpdateGroup,
    UpdateGroupTable,
    resolve_ref,
)

VALID = [
    ModelFamilySpec(name="fam", model_types=("fam_lm",), status=FamilyStatus.VALIDATED),
    ProviderSpec(family="fam", build="os.path:join"),
    ConverterSpec(family="fam", mapping="os.path:sep", config_translation="os.path:sep"),
    UpdateGroup(key="attention", suffixes=("self_attention.linear_qkv.weight",), optional=True),
    UpdateGroupTable(family="fam", groups=(UpdateGroup(key="a", suffixes=("x.weight",)),)),
    LoRAApplierSpec(kind="attention", family="*", apply="os.path:join", export="os.path:join", load="os.path:join"),
    ChatTemplateSpec(name="fam_chat", family="fam", template="ferrule.plugins.qwen:templates/x.jinja",
                     stop_tokens=("<|end|>",)),
    TowerSpec(family="fam", modality="vision", build="os.path:join", placeholder_token_id=7),
]


@pytest.mark.parametrize("spec", VALID, ids=lambda s: type(s).__name__)
def test_frozen_picklable_keyword_only(spec):
    assert pickle.loads(pickle.dumps(spec)) == spec
    name = dataclasses.fields(spec)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(spec, name, getattr(spec, name))
    with pytest.raises(TypeError):
        type(spec)(*[getattr(spec, f.name) for f in dataclasses.fields(spec)])


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: ModelFamilySpec(name="f", model_types=("f",), status=FamilyStatus.UNSTABLE), "without a reason"),
        (lambda: ModelFamilySpec(name="f", model_types=("f",), status=FamilyStatus.STRUCTURAL, reason="  "),
         "without a reason"),
        (lambda: ModelFamilySpec(name="f", model_types=["f"], status=FamilyStatus.VALIDATED), "must be a tuple"),
        (lambda: ModelFamilySpec(name="f", model_types=(), status=FamilyStatus.VALIDATED), "must not be empty"),
        (lambda: ModelFamilySpec(name="Bad-Name", model_types=("f",), status=FamilyStatus.VALIDATED), "not a valid name"),
        (lambda: ModelFamilySpec(name="f", model_types=("f",), status="validated"), "FamilyStatus member"),
        (lambda: ModelFamilySpec(name="f", model_types=("f",), status=FamilyStatus.VALIDATED, features=("gpu",)),
         "unknown entries"),
        (lambda: ModelFamilySpec(name="f", model_types=("f", "f"), status=FamilyStatus.VALIDATED), "duplicate"),
        (lambda: ProviderSpec(family="f", build="os.path.join"), "lazy reference"),
        (lambda: UpdateGroup(key="g", suffixes=("a.weight", "a.weight")), "duplicate entries"),
        (lambda: UpdateGroup(key="g", suffixes=("a.weight", "")), "empty suffix"),
        (lambda: UpdateGroup(key="g", suffixes=()), "must not be empty"),
        (lambda: UpdateGroupTable(family="f", groups=(UpdateGroup(key="a", suffixes=("x",)),
                                                      UpdateGroup(key="b", suffixes=("x",)))), "claimed by groups"),
        (lambda: UpdateGroupTable(family="f", groups=(UpdateGroup(key="a", suffixes=("x",)),
                                                      UpdateGroup(key="a", suffixes=("y",)))), "repeats group keys"),
        (lambda: LoRAApplierSpec(kind="conv", family="*", apply="a:b", export="a:b", load="a:b"), "kind"),
        (lambda: ChatTemplateSpec(name="t", family="f", template="pkg/t.jinja", stop_tokens=("x",)), "package:"),
        (lambda: ChatTemplateSpec(name="t", family="f", template="pkg:t.jinja", stop_tokens=()), "must not be empty"),
        (lambda: TowerSpec(family="f", modality="smell", build="a:b", placeholder_token_id=1), "modality"),
        (lambda: TowerSpec(family="f", modality="audio", build="a:b", placeholder_token_id=-1), "token id"),
        (lambda: ConverterSpec(family="f", mapping=None, config_translation="a:b"), "required"),
    ],
)
def test_validation_errors(build, match):
    with pytest.raises(SpecError, match=match):
        build()


def test_resolve_ref():
    import os.path

    assert resolve_ref("os.path:join") is os.path.join
    with pytest.raises(AttributeError, match="no attribute path 'nope'"):
        resolve_ref("os.path:nope")
    with pytest.raises(ImportError):
        resolve_ref("no_such_mod_abc:x")


def test_family_chooses_attn_implementation():
    spec = ModelFamilySpec(name="g2", model_types=("gemma2",), status=FamilyStatus.VALIDATED,
                           hf_model_class="transformers:Gemma2ForCausalLM", attn_implementation="eager")
    assert spec.attn_implementation == "eager"
    assert ModelFamilySpec(name="q", model_types=("q",), status=FamilyStatus.VALIDATED).attn_implementation == "sdpa"
    with pytest.raises(SpecError, match=r"attn_implementation='flash_attention_2'.*\['sdpa', 'eager'\]"):
        ModelFamilySpec(name="g2", model_types=("gemma2",), status=FamilyStatus.VALIDATED,
                        attn_implementation="flash_attention_2")


def test_variants_declare_the_three_per_variant_specs():
    """One ``Variants`` declaration answers the provider, converter and update-group hooks with the
    specs a plugin wrote out by hand before (Inkling's, with its own builder)."""
    from ferrule.contract.specs import ConverterSpec, ProviderSpec, SpecError, UpdateGroupTable
    from ferrule.contract.variants import Variants

    v = Variants({"a_text": "pkg.a_text", "a": "pkg.a"}, build="build_provider")
    assert list(v) == ["a_text", "a"]
    assert v.providers() == [ProviderSpec(family="a_text", build="pkg.a_text:build_provider"),
                             ProviderSpec(family="a", build="pkg.a:build_provider")]
    assert v.converters()[1] == ConverterSpec(family="a", mapping="pkg.a:MAPPING", config_translation="pkg.a:CONFIG_TRANSLATION")
    assert v.update_groups()[0] == UpdateGroupTable(family="a_text", groups="pkg.a_text:UPDATE_GROUPS")
    assert Variants({"b": "pkg.b"}).providers() == [ProviderSpec(family="b")]  # the default build
    with pytest.raises(SpecError, match="'pkg.b:MAPPING'"):
        Variants({"b": "pkg.b:MAPPING"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.build = None
