"""Meta-tests: every hookspec is documented in docs/hooks.md with its exact signature and is
exercised by at least one test module."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ferrule import hookspecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [f for n, f in vars(hookspecs).items() if inspect.isfunction(f) and f.__module__ == hookspecs.__name__]


def _signature(fn) -> str:
    sig = inspect.signature(fn)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{fn.__name__}({params}) -> {sig.return_annotation}"


def test_expected_hook_set():
    assert sorted(f.__name__ for f in HOOKS) == sorted([
        "register_model_families", "register_providers", "register_converters", "register_update_groups",
        "register_lora_appliers", "register_chat_templates", "register_towers", "resolve_model_family",
    ])


@pytest.mark.parametrize("hook", HOOKS, ids=lambda f: f.__name__)
def test_hook_documented_with_exact_signature(hook):
    docs = (ROOT / "docs" / "hooks.md").read_text()
    assert f"`{_signature(hook)}`" in docs, f"docs/hooks.md lacks the exact signature `{_signature(hook)}`"
    assert hook.__doc__ and "Called by" in hook.__doc__, f"{hook.__name__} docstring must say who calls it"


@pytest.mark.parametrize("hook", HOOKS, ids=lambda f: f.__name__)
def test_hook_has_a_test(hook):
    here = Path(__file__).name
    users = [p.name for p in (ROOT / "tests").rglob("*.py")
             if p.name != here and hook.__name__ in p.read_text(encoding="utf-8")]
    assert users, f"no test module mentions hook {hook.__name__}"
