"""Make the fixture plugin packages under tests/fixtures discoverable without installing them.

An installed distribution is, to ``importlib.metadata``, a ``NAME-VERSION.dist-info`` folder
with ``METADATA`` and ``entry_points.txt`` on ``sys.path``; :func:`plugin_env` writes exactly
that (from each fixture's own ``pyproject.toml``) into a temporary folder and returns the
environment a subprocess needs: ``PYTHONPATH`` with the fixture sources and that folder, and
``FERRULE_PLUGINS`` naming the fixture entry points (plus ``qwen`` so the in-tree plugin stays).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
KIT_FIXTURES = ("ferrule-swa-fixture", "ferrule-gemma2-fixture", "ferrule-olmo2-fixture", "ferrule-gemma3-fixture",
                "ferrule-gptoss-fixture")


def plugin_env(tmp_path: Path, fixtures: tuple[str, ...] = KIT_FIXTURES) -> dict[str, str]:
    site = tmp_path / "fixture-site"
    site.mkdir(parents=True, exist_ok=True)
    paths, names = [], ["qwen"]
    for fixture in fixtures:
        project = tomllib.loads((FIXTURES / fixture / "pyproject.toml").read_text())["project"]
        dist = project["name"].replace("-", "_")
        info = site / f"{dist}-{project['version']}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
        eps = project["entry-points"]["ferrule"]
        (info / "entry_points.txt").write_text("[ferrule]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
        names += list(eps)
        paths.append(str(FIXTURES / fixture))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["FERRULE_PLUGINS"] = ",".join(names)
    env["FERRULE_STRICT_PLUGINS"] = "1"
    return env
