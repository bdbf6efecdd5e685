"""Meta-tests: every hookspec is documented in docs/hooks.md with its exact signature and is
exercised by at least one test module."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ferrule.contract import hookspecs
from ferrule.contract.hook_parts import ALL_HOOKS, HOOK_PARTS

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [f for n, f in vars(hookspecs).items() if inspect.isfunction(f) and f.__module__ == hookspecs.__name__]


def _signature(fn) -> str:
    sig = inspect.signature(fn)
    params = ", ".join(f"{p.name}: {p.annotation}" for p in sig.parameters.values())
    return f"{fn.__name__}({params}) -> {sig.return_annotation}"


def test_hookspecs_match_the_hook_parts_table():
    """The one table (ferrule.contract.hook_parts) and the hookspec module list the same hooks, and each
    collect hook is annotated with the spec type its table row expects."""
    assert sorted(f.__name__ for f in HOOKS) == sorted(ALL_HOOKS)
    for part in HOOK_PARTS:
        hook = getattr(hookspecs, part.hook)
        assert inspect.signature(hook).return_annotation == f"Sequence[{part.spec_type.__name__}]", part.hook


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
