"""The wheel: contents, a fresh-venv install, every module importable, entry points working,
and out-of-tree plugin packages (a good one and one that raises on import).

The fresh venv gets no network: third-party dependencies (torch, megatron-core, ...) are made
visible through a ``.pth`` file pointing at the running interpreter's site-packages, and the
wheel plus fixture plugins are installed with ``--no-deps --no-index``.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
pytestmark = pytest.mark.timeout(600)


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k not in {"FERRULE_PLUGINS", "FERRULE_STRICT_PLUGINS"}}
    env.update(kw.pop("env", {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), env=env, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources: a build in the repository rewrites its
    ``ferrule.egg-info``, which the test processes beside this one (pytest-xdist) read through ``sys.path``."""
    import shutil

    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    anywhere = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__")
    top_only = {"build", "runs", "assets", "out", "tests", "examples", "bench"}  # plugins/*/tests are copied: they must stay out of the wheel

    def ignore(folder, names):
        return set(anywhere(folder, names)) | (top_only & set(names) if Path(folder) == ROOT else set())

    shutil.copytree(ROOT, src, ignore=ignore)
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)])
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("ferrule-*.whl")
    return whl


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel) -> Path:
    d = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True, clear=True).create(d)
    py = d / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    here = sysconfig.get_paths()["purelib"]
    # dependencies from the running environment, without its editable ferrule (.pth files inside
    # a directory added by a .pth line are not processed, so the editable finder stays out)
    Path(purelib, "zz_ferrule_test_deps.pth").write_text("\n".join([here, *site.getsitepackages()]) + "\n")
    r = _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])
    assert r.returncode == 0, r.stdout + r.stderr
    return d


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    pkgs = {n.rsplit("/", 1)[0] for n in names if n.endswith(".py")}
    for expected in ("ferrule", "ferrule/converters", "ferrule/plugins", "ferrule/plugins/qwen",
                     "ferrule/plugins/inkling", "ferrule/megatron", "ferrule/rollout"):
        assert expected in pkgs, f"{expected} missing from the wheel: {sorted(pkgs)}"
    # every source module of the tree is in the wheel
    src_dirs = {"core": "ferrule", "converters": "ferrule/converters", "plugins": "ferrule/plugins"}
    for src, dst in src_dirs.items():
        for f in (ROOT / src).rglob("*.py"):
            rel = f.relative_to(ROOT / src).as_posix()
            if src == "core" and rel.split("/")[0] in {"converters", "plugins"}:
                continue
            if "tests" in rel.split("/")[:-1]:  # a plugin's own tests (plugins/qwen/tests): checked below
                continue
            assert f"{dst}/{rel}" in names, f"{src}/{rel} is not packaged (add its package to pyproject)"
        for f in (ROOT / src).rglob("*.jinja"):
            rel = f.relative_to(ROOT / src).as_posix()
            assert f"{dst}/{rel}" in names, f"template {src}/{rel} is not packaged"
    # plugins keep their tests, golden data and workers beside them; none of it ships
    assert not [n for n in names if "/tests/" in n], sorted(n for n in names if "/tests/" in n)
    eps = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(eps).decode()
    assert "[ferrule]" in text and "qwen = ferrule.plugins.qwen.plugin" in text


def test_fresh_venv_imports_every_module_and_lists_plugins(fresh_venv):
    py = fresh_venv / "bin" / "python"
    code = (
        "import importlib, pkgutil, ferrule, sys\n"
        "assert 'site-packages' in ferrule.__file__ and '/core/' not in ferrule.__file__, ferrule.__file__\n"
        "mods = [m.name for m in pkgutil.walk_packages(ferrule.__path__, 'ferrule.')]\n"
        # the Triton decode-attention kernels need triton (GPU machines only; CI's CPU install has none)
        "mods = [m for m in mods if m != 'ferrule.rollout._decode_attn_triton']\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(len(mods))\n"
    )
    r = _run([str(py), "-c", code])
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) >= 8
    r = _run([str(fresh_venv / "bin" / "ferrule"), "plugins"], env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    for fam in ("qwen2", "qwen3", "inkling"):
        assert fam in r.stdout


def test_out_of_tree_plugins(fresh_venv, tmp_path):
    py = str(fresh_venv / "bin" / "python")
    for name in ("ferrule-demo-plugin", "ferrule-broken-plugin"):
        # built with this interpreter's setuptools, installed as a wheel (no network, no build env)
        r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                  str(FIXTURES / name)])
        assert r.returncode == 0, r.stdout + r.stderr
        (whl,) = tmp_path.glob(name.replace("-", "_") + "-*.whl")
        r = _run([py, "-m", "pip", "install", "--no-deps", "--no-index", str(whl)])
        assert r.returncode == 0, r.stdout + r.stderr
    ferrule_bin = str(fresh_venv / "bin" / "ferrule")
    r = _run([ferrule_bin, "plugins"], env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "ferrule-demo-plugin" in r.stdout and "demo_family" in r.stdout
    assert "ferrule-broken-plugin" in r.stdout and "simulated failure at import time" in r.stdout
    assert "qwen2" in r.stdout
    r = _run([ferrule_bin, "plugins"], env={"FERRULE_STRICT_PLUGINS": "1", "COLUMNS": "250"})
    assert r.returncode != 0
    assert "simulated failure at import time" in (r.stdout + r.stderr)
    r = _run([ferrule_bin, "plugins"], env={"FERRULE_STRICT_PLUGINS": "1", "FERRULE_PLUGINS": "qwen,inkling,demo",
                                            "COLUMNS": "250"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo_family" in r.stdout and "broken" not in r.stdout


#: imports that must resolve to the installed package from any working directory (issue 18)
_CWD_PROBE = (
    "import os, sys\n"
    "from ferrule.contract import hookspecs, registry\n"
    "import ferrule.converters, ferrule.plugins.qwen\n"
    "names = [f.name for f in registry.list_families()]\n"
    "assert 'qwen2' in names, names\n"
    "print(os.path.realpath(hookspecs.__file__))\n"
    "print(os.path.realpath(ferrule.converters.__file__))\n"
    "print(os.path.realpath(ferrule.plugins.qwen.__file__))\n"
)


def _probe_with_ferrule_folder(python: str, tmp_path: Path) -> list[str]:
    """Run ``_CWD_PROBE`` in a fresh interpreter whose working directory holds an empty ``ferrule/``
    folder (what a user has beside a clone named ``ferrule``); return the realpaths it printed."""
    (tmp_path / "ferrule").mkdir()
    r = _run([python, "-c", _CWD_PROBE], cwd=tmp_path, env={"FERRULE_PLUGINS": "qwen"})
    assert r.returncode == 0, (
        "`import ferrule` in a directory holding a `ferrule/` folder failed (the folder shadowed the "
        "installed package as a namespace package):\n" + r.stderr[-3000:])
    return r.stdout.strip().splitlines()[-3:]


def test_import_from_a_cwd_holding_a_ferrule_folder_editable(tmp_path):
    """The development install (./install.sh, strict editable mode) resolves ``import ferrule`` to
    this checkout's files, not to the empty folder, and through links, so edits are live."""
    paths = _probe_with_ferrule_folder(sys.executable, tmp_path)
    assert paths == [str(ROOT / "core" / "contract" / "hookspecs.py"), str(ROOT / "converters" / "__init__.py"),
                     str(ROOT / "plugins" / "qwen" / "__init__.py")], paths


def test_import_from_a_cwd_holding_a_ferrule_folder_wheel(fresh_venv, tmp_path):
    paths = _probe_with_ferrule_folder(str(fresh_venv / "bin" / "python"), tmp_path)
    assert all("site-packages" in p for p in paths), paths


def test_editable_link_tree_lists_every_module():
    """Strict editable mode links files, not folders: a module added after ``./install.sh`` is not
    importable until it is run again. Name every such module instead of failing later, far away."""
    import importlib.util

    src_dirs = {"core": "ferrule", "converters": "ferrule.converters", "plugins": "ferrule.plugins"}
    stale = []
    for src, pkg in src_dirs.items():
        for f in sorted((ROOT / src).rglob("*.py")):
            rel = f.relative_to(ROOT / src)
            if "tests" in rel.parts or "build" in rel.parts:
                continue  # test modules (plugins/*/tests) are collected by pytest, not imported by name
            parts = [*rel.parent.parts, rel.stem] if rel.stem != "__init__" else list(rel.parent.parts)
            name = ".".join([pkg, *parts])
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None or Path(spec.origin).resolve() != f.resolve():
                stale.append(f"{src}/{rel.as_posix()} (as {name})")
    assert not stale, ("modules missing from the installed link tree; run ./install.sh again: "
                       + ", ".join(stale))
