"""The shared-rows contract: a family row that a shared row now duplicates wins, with a warning naming both.

References: transformers' Mistral (the logits ``ferrule check`` compares with), the row keys
written in the tests themselves.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

from fixture_plugins import ROOT, plugin_env
from inproc import environment, run_ferrule


def _window(hf):
    return None if hf.get("sliding_window") is None else (int(hf["sliding_window"]) - 1, 0)


def _window_to_hf(value, _cfg, _opts):
    return {} if value is None else {"sliding_window": value[0] + 1}


def test_family_row_wins_over_a_shared_row_with_a_warning_naming_both():
    """Last round's Mistral translated sliding_window itself; today's DECODER_ENTRIES do too (before: ValueError
    'entries 21 and 46', the plugin unloaded)."""
    from ferrule.config_translation import DECODER_ENTRIES, ConfigTranslation, Derived, SharedRowOverlapWarning

    own = Derived("window_size", _window, _window_to_hf, hf_keys=("sliding_window",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = ConfigTranslation("mistral-r1", (*DECODER_ENTRIES, own))
    (w,) = [c for c in caught if issubclass(c.category, SharedRowOverlapWarning)]
    text = str(w.message)
    assert "Derived(config 'window_size' <- 'sliding_window'; _window)" in text, text
    assert "Derived(config 'window_size' <- 'sliding_window', 'layer_types'; window_size_from_hf)" in text, text
    assert "SLIDING_WINDOW_ENTRIES" in text and "the family's row wins" in text
    rows = [e for e in table.entries if getattr(e, "mcore", None) == "window_size"]
    assert rows == [own]


def test_two_family_rows_for_one_value_are_named_by_their_keys():
    from ferrule.config_translation import ConfigTranslation, Field

    with pytest.raises(ValueError) as err:
        ConfigTranslation("t", (Field("n_layer", "num_layers"), Field("num_hidden_layers", "num_layers")))
    msg = str(err.value)
    assert "Field('n_layer' -> config 'num_layers')" in msg and "Field('num_hidden_layers' -> config 'num_layers')" in msg
    assert not re.search(r"entries \d+ and \d+", msg)


def _mistral_dir(env, tmp_path):
    from ferrule.conformance import numeric as cn

    with environment(env), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the overlap warning: asserted on `ferrule plugins`' stderr
        cn.tiny_hf_dir("mistral", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_last_rounds_mistral_plugin_loads_with_a_warning_and_passes_check(tmp_path):
    env = dict(plugin_env(tmp_path, ("ferrule-mistral-r1-fixture",)), COLUMNS="200")
    plugins = subprocess.run([sys.executable, "-m", "ferrule.cli", "plugins"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=200)
    assert plugins.returncode == 0, plugins.stderr[-3000:]
    assert re.search(r"mistral\s*│ mistral\s*│ validated", plugins.stdout), plugins.stdout
    assert "load failures: none" in plugins.stdout
    assert "SharedRowOverlapWarning" in plugins.stderr and "the family's row wins" in plugins.stderr
    hf = _mistral_dir(env, tmp_path)
    check = run_ferrule(["check", hf, "--seq-len", "16"], env=env, cwd=ROOT)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert re.search(r"logits \(tp=1, fp32\)\s*│ ok", check.stdout), check.stdout


@pytest.mark.timeout(300)
def test_plugins_never_lists_an_incomplete_family_as_validated(tmp_path):
    """Non-strict loading, a hook that raises: the family shows as incomplete (before: 'validated' with
    missing parts)."""
    env = dict(plugin_env(tmp_path, ("ferrule-mistral-r1-fixture",)), COLUMNS="250",
               FERRULE_MISTRAL_R1_BROKEN_GROUPS="1", FERRULE_STRICT_PLUGINS="0")
    proc = subprocess.run([sys.executable, "-m", "ferrule.cli", "plugins"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("│ mistral"))
    assert "incomplete" in row and "validated" not in row.split("│")[3], proc.stdout
    assert "update_groups" in row and "planted: update groups unavailable" in proc.stdout
