"""The asset builders' command line (``python -m ferrule_examples.inkling2_synthetic OUT_DIR`` and kin): ``--help``
prints usage and writes nothing (it used to be taken for OUT_DIR and build ``./--help/``), no OUT_DIR is a usage error."""

from __future__ import annotations

import pytest

from ferrule_examples.builder_cli import builder_main


def _never(path):
    raise AssertionError(f"built {path}")


@pytest.mark.timeout(60)
def test_help_prints_usage_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import ferrule_examples.inkling2_synthetic as synthetic

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        builder_main(synthetic.__name__, synthetic.__doc__, _never, ["--help"])
    assert e.value.code == 0 and list(tmp_path.iterdir()) == []
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ferrule_examples.inkling2_synthetic [-h] OUT_DIR") and "Inkling-2" in out
    with pytest.raises(SystemExit) as e:
        builder_main(synthetic.__name__, synthetic.__doc__, _never, [])
    assert e.value.code == 2 and "OUT_DIR" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_out_dir_is_passed_to_the_builder(tmp_path, capsys):
    seen = []
    assert builder_main("m", None, lambda p: seen.append(p) or p, [str(tmp_path / "x")]) == 0
    assert seen == [tmp_path / "x"] and capsys.readouterr().out.strip() == str(tmp_path / "x")
