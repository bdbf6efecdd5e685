"""Test-suite setup, shared by every test folder in ``testpaths`` (tests/, plugins/qwen/tests/,
examples/ferrule-llama/tests/): it sits at the repository root so that a plugin's own tests
(kept beside the plugin) get the same environment and fixtures.

- Only the in-tree plugins and the example out-of-tree package are visible
  (``FERRULE_PLUGINS=qwen,inkling,inkling2,llama``), so another installed third-party plugin cannot change
  what these tests see; tests that need others set it.
- The conformance kit ``ferrule.testing`` runs over the in-tree families; the fixture plugins
  under tests/fixtures run it in a subprocess (tests/test_fixture_families.py).
- The process-wide registry is rebuilt around every test.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("FERRULE_PLUGINS", "qwen,inkling,inkling2,llama")

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


def pytest_collection_modifyitems(config, items):
    """Every test that skips for want of CUDA carries the ``gpu`` marker, so that ``pytest -m gpu``
    on a GPU machine runs all of them (README "Tests"). Checked where such a skip fires (machines
    without CUDA, CI): a ``skipif`` whose condition holds and whose reason names CUDA or a GPU."""
    import torch

    if torch.cuda.is_available():  # here skips naming CUDA are CPU-only tests skipping for its presence
        return
    unmarked = []
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            continue
        for mark in item.iter_markers("skipif"):
            reason = str(mark.kwargs.get("reason", "")).lower()
            condition = mark.args[0] if mark.args else mark.kwargs.get("condition", False)
            if condition is True and ("cuda" in reason or "gpu" in reason):
                unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError("tests that need CUDA lack @pytest.mark.gpu (add it, so `pytest -m gpu` runs them): "
                                + ", ".join(unmarked[:10]))
