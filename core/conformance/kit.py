"""ferrule's conformance kit: a pytest plugin that checks every registered family.

Use it from any plugin package's test suite::

    # conftest.py
    pytest_plugins = ["ferrule.conformance.kit"]

    # test_conformance.py
    from ferrule.conformance.kit import FamilyConformance

    class TestMyFamily(FamilyConformance):
        families = ("myfamily",)      # None: every registered family

The conftest line is optional: it adds ``--ferrule-family NAME`` (repeatable) to restrict the
families from the command line. The cases:

- discovery (loading plugins and calling every ``register_*`` hook) imports no torch,
  megatron, transformers or CUDA;
- every spec is frozen and survives a pickle round trip unchanged;
- the family is complete for its status (VALIDATED/UNSTABLE: provider, converter, update
  groups and every declared feature; STRUCTURAL: a reason is given);
- every lazy ``"module:attr"`` reference of the family resolves;
- the update groups fit the tiny model: every parameter in exactly one update unit, every unit
  naming existing parameters, every non-optional suffix used (a typo is named);
- numeric cases for families with a converter (HF -> torch_dist -> HF round trip is
  bit-exact, the mapping table covers the provider's parameters exactly, rotary frequencies and
  every translated field equal what HF's model uses, Megatron logits match HF transformers)
  from :mod:`ferrule.conformance.numeric`, and again at TP=2 (round trip through the TP split
  and logits) in one ``torchrun`` launch for all families (:mod:`ferrule.conformance.tp`);
- a training step at TP=1 and at TP=2 (the same launches): every parameter's gradient of one
  backward pass matches HF's (fp32, :data:`ferrule.conformance.grads.GRAD_RTOL` relative, every HF
  tensor), and a weight sync through the family's update groups delivers every checkpoint tensor
  (every trained tensor) to a rollout engine exactly once, bit for bit (:mod:`ferrule.conformance.grads`);
- a family with towers: logits of a prompt with media for every tower match HF's at TP=1 and
  TP=2, and each modality changes them (:mod:`ferrule.conformance.media`; the family's
  ``tiny_media``).

A failing case reports one readable assertion (the worker's exception message, without
``[rankN]:`` prefixes or megatron's warnings).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import subprocess
import sys

import pytest

from ferrule import envs
from ferrule.contract import registry
from ferrule.contract.hook_parts import HOOK_PARTS, part_for_spec
from ferrule.conformance.discovery import HEAVY_MODULES  # noqa: F401  (the kit's public name)
from ferrule.conformance.grads import GRAD_RTOL
from ferrule.contract.specs import FamilyStatus, resolve_ref
from ferrule.conformance import numeric as cn



def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ferrule")
    group.addoption("--ferrule-family", action="append", default=[], metavar="NAME",
                    help="run ferrule conformance cases only for this family (repeatable)")


def family_specs(family: str) -> list[object]:
    """Every spec registered for ``family``, one hook part after another (:data:`ferrule.contract.hook_parts.HOOK_PARTS`)."""
    reg = registry.get_registry()
    name = reg.get_family(family).name
    return [spec for part in HOOK_PARTS if part.family is not None
            for spec in getattr(reg, part.attr).values() if part.family(spec) == name]


def discovery_imports(env: dict[str, str] | None = None) -> dict[str, object]:
    """Run plugin discovery in a fresh interpreter (:mod:`ferrule.conformance.discovery`); return the families
    seen, the heavy modules imported and the failed entry points."""
    out = subprocess.run([sys.executable, "-m", "ferrule.conformance.discovery"], capture_output=True, text=True,
                         timeout=120, env=env)
    if out.returncode != 0:
        raise AssertionError(f"discovery subprocess failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class FamilyConformance:
    """Conformance cases, parametrized over registered families (the ``ferrule_family`` argument).

    Subclass it in a test module (pytest collects ``Test*`` classes). Set ``families`` on the
    subclass to restrict it to your own families; ``--ferrule-family NAME`` (available when
    ``ferrule.conformance.kit`` is a loaded pytest plugin) restricts it further.
    """

    #: families to check; None means every registered family
    families: tuple[str, ...] | None = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "ferrule_family" not in metafunc.fixturenames:
            return
        names = [f.name for f in registry.list_families()]
        wanted = list(self.families or ())
        try:
            wanted += metafunc.config.getoption("ferrule_family") or []
        except ValueError:  # the option is only there when ferrule.conformance.kit is a loaded plugin
            pass
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise pytest.UsageError(f"families {unknown} are not registered; registered: {names}. "
                                    f"Is the plugin package installed (see `ferrule plugins`)?")
        metafunc.parametrize("ferrule_family", [n for n in names if not wanted or n in wanted])

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
            part = part_for_spec(spec)
            for name in part.callables + part.data:
                value = getattr(spec, name)
                if isinstance(value, str):
                    target = resolve_ref(value)
                    assert target is not None, f"{type(spec).__name__}.{name}={value!r} resolves to None"
                    if name in part.callables:
                        assert callable(target), f"{type(spec).__name__}.{name}={value!r} is not callable"
        if ferrule_family in registry.get_registry().providers:
            assert callable(registry.provider_build(ferrule_family)), f"{ferrule_family}: provider build"
            if hasattr(spec, "read_source"):
                assert spec.read_source().strip(), f"chat template {spec.name} is empty"

    @classmethod
    def _class_families(cls, config: pytest.Config) -> list[str]:
        """The registered families this class checks (``families``, ``--ferrule-family``), as collected."""
        names = [f.name for f in registry.list_families()]
        wanted = list(cls.families or ())
        try:
            wanted += config.getoption("ferrule_family") or []
        except ValueError:
            pass
        return [n for n in names if not wanted or n in wanted]

    @pytest.fixture(scope="class")
    @classmethod
    def tp1_results(cls, request, tmp_path_factory) -> dict[str, dict]:
        """One fresh interpreter (:mod:`ferrule.conformance.tp1`) runs the TP=1 numeric cases, the update-group
        coverage and (for a family with towers) the media case of every family of this class, one family
        after the other; ``{family: {"numeric": {...}, "groups": {...}, "media": {...}}}``, each
        ``{"skip": why}``, ``{"error": text}`` or the value.

        A fresh interpreter because megatron's parallel state and the CPU-compat patches are
        process-global and must not leak into the test session; one for all families because each
        costs its imports (megatron, transformers) again, the larger part of a family's time.
        """
        families = cls._class_families(request.config)
        work = tmp_path_factory.mktemp("kit_tp1")
        out = subprocess.run([sys.executable, "-m", "ferrule.conformance.tp1", str(work), *families],
                             capture_output=True, text=True,
                             timeout=600 + 300 * len(families), env=envs.child_env(PYTHONWARNINGS="ignore"))
        return _last_json(out, "the TP=1 conformance run")

    def test_numeric_conformance(self, ferrule_family: str, tp1_results) -> None:
        """Round trip bit-exact, mapping covers the provider, rotary tables / translated fields /
        declared features as HF uses them, Megatron logits == HF logits (TP=1).

        Computed by :meth:`tp1_results` (a fresh interpreter shared by the class's families).
        """
        _skip_without_numeric_parts(ferrule_family)
        result = _tp1_case(tp1_results, ferrule_family, "numeric", "TP=1")
        assert result["logits_max_abs_diff"] <= 1e-5

    def test_training_step(self, ferrule_family: str, tp1_results) -> None:
        """One backward pass (TP=1, fp32): every parameter's gradient, exported to HF names, == HF's within
        :data:`ferrule.conformance.grads.GRAD_RTOL` relative, and a weight sync through the update groups delivers
        every checkpoint tensor to a rollout engine exactly once, bit for bit
        (:func:`ferrule.conformance.numeric.check_training_step`).

        Computed by :meth:`tp1_results` (the same fresh interpreter as the other TP=1 cases).
        """
        _skip_without_numeric_parts(ferrule_family)
        _skip_without_update_groups(ferrule_family)
        result = _tp1_case(tp1_results, ferrule_family, "train", "training step, TP=1")
        assert result["grad_max_rel"] <= GRAD_RTOL and result["synced_tensors"] > 0

    def test_media_logits_parity(self, ferrule_family: str, tp1_results) -> None:
        """A family with towers: logits of a prompt with media for every tower == HF's (fp32, TP=1), and each
        modality's media change HF's logits (:func:`ferrule.conformance.media.check_media_logits_parity`).

        Computed by :meth:`tp1_results` (the same fresh interpreter as the other TP=1 cases).
        """
        _skip_without_numeric_parts(ferrule_family)
        if not registry.get_towers(ferrule_family):
            pytest.skip(f"{ferrule_family} declares no towers")
        result = _tp1_case(tp1_results, ferrule_family, "media", "media, TP=1")
        assert result["logits_max_abs_diff"] <= 1e-5

    def test_update_groups_cover_parameters(self, ferrule_family: str, tp1_results) -> None:
        """Every parameter of the tiny model lands in exactly one update unit, and every update unit
        names only existing parameters (:func:`ferrule.conformance.numeric.check_update_groups_cover_parameters`).

        Computed by :meth:`tp1_results` (megatron's parallel state is process-global).
        """
        reg = registry.get_registry()
        if ferrule_family not in reg.update_groups or ferrule_family not in reg.providers:
            spec = reg.get_family(ferrule_family)
            pytest.skip(f"{ferrule_family} registers no provider/update groups yet ({spec.status.name}: {spec.reason})")
        result = tp1_results[ferrule_family]["groups"]
        if "skip" in result:
            pytest.skip(f"{ferrule_family}: {result['skip']} in its provider module (see docs/plugins.md)")
        assert "error" not in result, f"check_update_groups_cover_parameters failed for {ferrule_family}: {result.get('error')}"
        assert result["value"] > 0

    @pytest.fixture(scope="class")
    @classmethod
    def tp2_results(cls, request, tmp_path_factory) -> dict[str, dict]:
        """One ``torchrun`` launch (2 gloo ranks) running :mod:`ferrule.conformance.tp` for every
        family of this class that has a provider, a converter and a ``TINY_HF_CONFIG``.

        A test suite that keeps 2 gloo ranks running may define a fixture ``ferrule_kit_tp2_launch``:
        a callable ``(argv, *, env, timeout) -> subprocess.CompletedProcess`` that runs ``argv`` (what
        follows ``torchrun --nproc-per-node 2``) in its ranks; the kit uses it instead of a launch of its
        own (ferrule's own suite lends its session pool: ``conftest.py``)."""
        reg = registry.get_registry()
        names = [f.name for f in registry.list_families()]
        wanted = list(cls.families or ())
        try:
            wanted += request.config.getoption("ferrule_family") or []
        except ValueError:
            pass
        families = [n for n in names if (not wanted or n in wanted) and n in reg.converters and n in reg.providers
                    and cn.tiny_hf_config(n) is not None]
        if not families:
            return {}
        work = tmp_path_factory.mktemp("kit_tp2")
        out_file = work / "results.json"
        argv = ["-m", "ferrule.conformance.tp", "--work", str(work), "--out", str(out_file), *families]
        env = envs.child_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        try:  # a suite that keeps 2 gloo ranks running may lend them (docs/plugins.md, "The conformance kit")
            launch = request.getfixturevalue("ferrule_kit_tp2_launch")
        except pytest.FixtureLookupError:
            launch = None
        if launch is not None:
            proc = launch(argv, env=env, timeout=900)
        else:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                   *argv], capture_output=True, text=True, timeout=900, env=env)
        if not out_file.is_file():
            pytest.fail("the TP=2 conformance launch wrote no results:\n" + readable_failure(proc.stderr),
                        pytrace=False)
        return json.loads(out_file.read_text())

    def test_numeric_conformance_tp2(self, ferrule_family: str, tp2_results) -> None:
        """The same HF model at TP=2: weights round-trip bit-exact and logits match HF (a wrong TP split fails)."""
        _skip_without_numeric_parts(ferrule_family)
        result = tp2_results.get(ferrule_family)
        if result is None:
            pytest.skip(f"{ferrule_family}: no TINY_HF_CONFIG in its provider module (see docs/plugins.md)")
        if not result["ok"]:
            pytest.fail(f"{ferrule_family} (TP=2): {result['error']}", pytrace=False)
        assert result["logits_max_abs_diff"] <= 1e-5

    def test_training_step_tp2(self, ferrule_family: str, tp2_results) -> None:
        """The training step at the TP=2 layout (:func:`ferrule.conformance.tp.check_family_tp`): gradients after
        megatron's TP gradient finalization, gathered, == HF's; the weight sync at TP=2 delivers every tensor."""
        _skip_without_numeric_parts(ferrule_family)
        _skip_without_update_groups(ferrule_family)
        result = tp2_results.get(ferrule_family)
        if result is None:
            pytest.skip(f"{ferrule_family}: no TINY_HF_CONFIG in its provider module (see docs/plugins.md)")
        train = result.get("train") or {"error": "the TP=2 launch reported no training step"}
        if "error" in train:
            pytest.fail(f"{ferrule_family} (training step, TP=2): {train['error']}", pytrace=False)
        assert train["grad_max_rel"] <= GRAD_RTOL and train["synced_tensors"] > 0



def run_conformance_check(check: str, family: str, *args: str) -> dict[str, object]:
    """Run ``ferrule.conformance.numeric.<check>(family)`` in a fresh interpreter (:mod:`ferrule.conformance.check`);
    ``{"value": result}``.

    ``args`` are ``"module:attr"`` references passed as the check's ``groups=`` (tests use it to
    hand in a deliberately broken table). Returns ``{"skip": reason}`` when the family declares
    no ``TINY_HF_CONFIG``.

    Raises:
        AssertionError: the check failed; the message carries the check's own message.
    """
    out = subprocess.run([sys.executable, "-m", "ferrule.conformance.check", check, family, *args],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise AssertionError(f"{check} failed for {family}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tp1_case(tp1_results: dict, family: str, case: str, label: str) -> dict:
    """``tp1_results[family][case]`` (:meth:`FamilyConformance.tp1_results`); skips the test where the
    family's provider module skipped the case, fails it (``label`` naming the case) where the case raised."""
    result = tp1_results[family][case]
    if "skip" in result:
        pytest.skip(f"{family}: {result['skip']} in its provider module (see docs/plugins.md)")
    if "error" in result:
        pytest.fail(f"{family} ({label}): {result['error']}", pytrace=False)
    return result


def _skip_without_numeric_parts(family: str) -> None:
    reg = registry.get_registry()
    if family not in reg.converters or family not in reg.providers:
        spec = reg.get_family(family)
        pytest.skip(f"{family} registers no converter/provider yet ({spec.status.name}: {spec.reason})")


def _skip_without_update_groups(family: str) -> None:
    """The training step syncs through the family's update groups: a family without them (STRUCTURAL) is skipped."""
    reg = registry.get_registry()
    if family not in reg.update_groups:
        spec = reg.get_family(family)
        pytest.skip(f"{family} registers no update groups yet ({spec.status.name}: {spec.reason})")


_RANK_PREFIX = re.compile(r"^(\[(?:rank|default)\d*\]:\s?)+")


def readable_failure(stderr: str, limit: int = 40) -> str:
    """The last exception of a worker's stderr, without ``[rankN]:`` prefixes and warning lines."""
    lines = [_RANK_PREFIX.sub("", line) for line in stderr.splitlines()]
    lines = [line for line in lines if "Warning" not in line and "warnings.warn" not in line]
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=0)
    block = lines[start:]
    tail = [line for line in block if line and not line.startswith((" ", "Traceback"))]
    return "\n".join((tail or block)[-limit:])


def _last_json(proc: subprocess.CompletedProcess, what: str) -> dict:
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    pytest.fail(f"{what} crashed (exit {proc.returncode}):\n{readable_failure(proc.stderr)}", pytrace=False)
