"""Test-suite setup, shared by every test folder in ``testpaths`` (tests/, plugins/qwen/tests/,
examples/ferrule-llama/tests/): it sits at the repository root so that a plugin's own tests
(kept beside the plugin) get the same environment and fixtures.

- Only the in-tree plugins and the example out-of-tree package are visible
  (``FERRULE_PLUGINS=qwen,inkling,llama``), so another installed third-party plugin cannot change
  what these tests see; tests that need others set it.
- The conformance kit ``ferrule.testing`` runs over the in-tree families; the fixture plugins
  under tests/fixtures run it in a subprocess (tests/test_fixture_families.py).
- The process-wide registry is rebuilt around every test.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("FERRULE_PLUGINS", "qwen,inkling,llama")

pytest_plugins = ["ferrule.testing"]

# Fixture plugin packages carry their own kit tests; tests/test_fixture_families.py runs them in a
# subprocess where the fixtures are discoverable (tests/fixture_plugins.py).
collect_ignore_glob = ["tests/fixtures/*"]


@pytest.fixture(autouse=True)
def _fresh_registry():
    from ferrule import registry

    registry.reset_registry()
    yield
    registry.reset_registry()
