"""The ``ferrule`` CLI: version, help, and the plugins listing (in-process, via typer's runner)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import ferrule
from ferrule.cli import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"ferrule {ferrule.__version__}"


def test_plugins_lists_in_tree_families(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = runner.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    out = result.output
    for fam in ("qwen2", "qwen3", "qwen3_moe", "inkling"):
        assert fam in out
    assert "load failures: none" in out
    assert "inkling_mm_model" in out


def test_plugins_reports_a_broken_plugin(monkeypatch):
    from importlib import metadata

    from ferrule import registry

    real = metadata.entry_points

    def fake(group):
        eps = list(real(group=group))
        return eps + [metadata.EntryPoint(name="broken", value="no_such_module_xyz", group=group)]

    monkeypatch.setattr(registry.metadata, "entry_points", fake)
    monkeypatch.delenv("FERRULE_STRICT_PLUGINS", raising=False)  # strict mode is tested in test_registry
    monkeypatch.setenv("FERRULE_PLUGINS", "qwen,inkling,broken")
    monkeypatch.setenv("COLUMNS", "200")
    result = runner.invoke(app, ["plugins", "--traceback"])
    assert result.exit_code == 0, result.output
    assert "load failures" in result.output and "no_such_module_xyz" in result.output
    assert "qwen2" in result.output


def _command_paths():
    import click
    import typer.main

    def walk(cmd, path):
        yield path
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, path + [name])

    return list(walk(typer.main.get_command(app), []))


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "ferrule")
def test_every_command_has_help(path):
    result = runner.invoke(app, path + ["--help"])
    assert result.exit_code == 0 and "Usage" in result.output, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) >= 3, f"`ferrule {' '.join(path)} --help` says almost nothing"


def test_chat_template_var_must_be_json(tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text('[{"role": "user", "content": "hi"}]')
    result = runner.invoke(app, ["chat-template", "render", str(msgs), "--family", "qwen3", "--no-ids",
                                 "--var", "enable_thinking=False"])
    assert result.exit_code == 2
    assert "not JSON" in result.output and "enable_thinking" in result.output
    ok = runner.invoke(app, ["chat-template", "render", str(msgs), "--family", "qwen3", "--no-ids",
                             "--generation-prompt", "--var", "enable_thinking=false"])
    assert ok.exit_code == 0, ok.output
    assert "<think>\n\n</think>" in ok.output


def test_train_resume_without_checkpoint_is_an_error(tmp_path):
    cfg = "examples/configs/tiny_ci.yaml"
    from pathlib import Path

    from ferrule.conformance_numeric import tiny_hf_dir

    root = Path(__file__).resolve().parents[1]
    hf = tiny_hf_dir("qwen3", tmp_path / "hf")
    result = runner.invoke(app, ["train", str(root / cfg), f"model.hf_dir={hf}", "--resume",
                                 "--run-dir", str(tmp_path / "typo")])
    assert result.exit_code == 2, result.output
    assert "no complete checkpoint" in result.output
    assert not (tmp_path / "typo").exists()
