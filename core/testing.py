"""ferrule's conformance kit: a pytest plugin that checks every registered family.

Use it from any plugin package's test suite::

    # conftest.py
    pytest_plugins = ["ferrule.testing"]

    # test_conformance.py
    from ferrule.testing import FamilyConformance as TestFamilyConformance  # noqa: F401

Every test of :class:`FamilyConformance` is parametrized over the registered families
(``--ferrule-family NAME`` restricts it, repeatable). The cases:

- discovery (loading plugins and calling every ``register_*`` hook) imports no torch,
  megatron, transformers or CUDA;
- every spec is frozen and survives a pickle round trip unchanged;
- the family is complete for its status (VALIDATED/UNSTABLE: provider, converter, update
  groups and every declared feature; STRUCTURAL: a reason is given);
- every lazy ``"module:attr"`` reference of the family resolves;
- numeric cases for families with a converter (HF -> torch_dist -> HF round trip is
  bit-exact, the mapping table covers the provider's parameters exactly, Megatron logits
  match HF transformers) from :mod:`ferrule.conformance_numeric`.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import pytest

from ferrule import registry
from ferrule.specs import FamilyStatus, resolve_ref

HEAVY_MODULES = ("torch", "megatron", "transformers")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ferrule")
    group.addoption("--ferrule-family", action="append", default=[], metavar="NAME",
                    help="run ferrule conformance cases only for this family (repeatable)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "ferrule_family" in metafunc.fixturenames:
        wanted = metafunc.config.getoption("ferrule_family", default=[]) or []
        names = [f.name for f in registry.list_families()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise pytest.UsageError(f"--ferrule-family {unknown} not registered; registered: {names}")
        metafunc.parametrize("ferrule_family", [n for n in names if not wanted or n in wanted])


def family_specs(family: str) -> list[object]:
    """Every spec registered for ``family`` (family, provider, converter, groups, LoRA, templates, towers)."""
    reg = registry.get_registry()
    out: list[object] = [reg.get_family(family)]
    for table in (reg.providers, reg.converters, reg.update_groups):
        if family in table:
            out.append(table[family])
    out += [s for (f, _), s in reg.lora_appliers.items() if f == family]
    out += reg.chat_templates_for(family)
    out += reg.get_towers(family)
    return out


def discovery_imports(env: dict[str, str] | None = None) -> dict[str, object]:
    """Run plugin discovery in a fresh interpreter; return families seen and heavy modules imported."""
    code = (
        "import json, sys\n"
        "from ferrule import registry\n"
        "reg = registry.get_registry()\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})\n"
        "print(json.dumps({'families': sorted(reg.families), 'heavy': heavy,"
        " 'failures': [f.entry_point for f in reg.failures]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if out.returncode != 0:
        raise AssertionError(f"discovery subprocess failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class FamilyConformance:
    """Conformance cases, parametrized over registered families by the ``ferrule_family`` fixture."""

    def test_discovery_imports_nothing_heavy(self, ferrule_family: str) -> None:
        result = discovery_imports()
        assert ferrule_family in result["families"]
        assert result["heavy"] == [], f"discovery imported heavy modules: {result['heavy'][:10]}"

    def test_specs_frozen_and_picklable(self, ferrule_family: str) -> None:
        for spec in family_specs(ferrule_family):
            assert dataclasses.is_dataclass(spec) and type(spec).__dataclass_params__.frozen, spec
            first = dataclasses.fields(spec)[0].name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(spec, first, getattr(spec, first))
            for f in dataclasses.fields(spec):
                assert not isinstance(getattr(spec, f.name), (list, dict, set)), (spec, f.name)
            assert pickle.loads(pickle.dumps(spec)) == spec

    def test_family_complete_for_status(self, ferrule_family: str) -> None:
        spec = registry.get_family(ferrule_family)
        missing = registry.missing_parts(ferrule_family)
        if spec.status is FamilyStatus.STRUCTURAL:
            assert spec.reason.strip(), "a STRUCTURAL family must say why"
        else:
            assert missing == [], f"{ferrule_family} is {spec.status.name} but lacks {missing}"

    def test_lazy_references_resolve(self, ferrule_family: str) -> None:
        for spec in family_specs(ferrule_family):
            for f in dataclasses.fields(spec):
                value = getattr(spec, f.name)
                if f.name in {"build", "apply", "export", "load", "hf_model_class", "tokenizer"} and isinstance(value, str):
                    assert callable(resolve_ref(value)), f"{type(spec).__name__}.{f.name}={value!r}"
            if hasattr(spec, "read_source"):
                assert spec.read_source().strip(), f"chat template {spec.name} is empty"
