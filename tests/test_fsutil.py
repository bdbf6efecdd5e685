"""ferrule.fs.util: atomic directory commit, default permissions, package data files."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from ferrule.fs.util import apply_default_mode, commit_dir


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_commit_dir_replaces_atomically_with_default_modes(tmp_path):
    umask = os.umask(0o022)
    try:
        out = tmp_path / "ckpt"
        out.mkdir()
        (out / "old.txt").write_text("old")
        tmp = tempfile.mkdtemp(dir=tmp_path)  # 0700, like every temp dir we write into
        fd, f = tempfile.mkstemp(dir=tmp)       # 0600
        os.write(fd, b"new")
        os.close(fd)
        assert _mode(tmp) == 0o700 and _mode(f) == 0o600
        commit_dir(tmp, out)
        assert not os.path.exists(tmp)
        assert [p.name for p in out.iterdir()] == [os.path.basename(f)]
        assert _mode(out) == 0o755 and _mode(out / os.path.basename(f)) == 0o644
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.old")]
    finally:
        os.umask(umask)


def test_apply_default_mode_on_a_file(tmp_path):
    umask = os.umask(0o027)
    try:
        fd, f = tempfile.mkstemp(dir=tmp_path)
        os.close(fd)
        apply_default_mode(f)
        assert _mode(f) == 0o640
    finally:
        os.umask(umask)


def test_find_package_file_env_then_package_location(tmp_path, monkeypatch):
    from ferrule.fs.util import find_package_file

    pkg = tmp_path / "site" / "fake_vocab_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "v.tiktoken").write_text("x")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("FERRULE_TEST_VOCAB", raising=False)
    cands = (("absent_pkg_xyz", "v.tiktoken"), ("fake_vocab_pkg", "data/v.tiktoken"))
    assert find_package_file("FERRULE_TEST_VOCAB", cands, missing_hint="hint") == pkg / "data" / "v.tiktoken"
    other = tmp_path / "other.tiktoken"
    other.write_text("y")
    monkeypatch.setenv("FERRULE_TEST_VOCAB", str(other))
    assert find_package_file("FERRULE_TEST_VOCAB", cands, missing_hint="hint") == other
    monkeypatch.setenv("FERRULE_TEST_VOCAB", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="FERRULE_TEST_VOCAB=.*is not a file; install it"):
        find_package_file("FERRULE_TEST_VOCAB", cands, missing_hint="install it")
    monkeypatch.delenv("FERRULE_TEST_VOCAB")
    with pytest.raises(FileNotFoundError, match="^install it$"):
        find_package_file("FERRULE_TEST_VOCAB", cands[:1], missing_hint="install it")


def test_a_disk_full_for_an_instant_is_not_reported_with_a_contradicting_free_space(tmp_path, monkeypatch):
    """Issue 45.7: a write that failed with ENOSPC on a disk that has room again by the time the message is made
    printed "no space left on OUT (needed ~1.0 MB, free 209.7 MB): free some space" and nothing else."""
    import errno
    import shutil

    from ferrule.fs.output_dir import disk_full_from

    real = shutil.disk_usage

    def disk_usage(path, free=209_700_000):
        u = real(path)
        return type(u)(u.total, u.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    enospc = OSError(errno.ENOSPC, "No space left on device")
    said = str(disk_full_from(enospc, tmp_path / "out", 1_000_000))
    assert said.startswith(f"no space left on {tmp_path / 'out'} (needed ~1.0 MB, free 209.7 MB): the filesystem "
                           "was full at the moment of a write and has room again now"), said
    monkeypatch.setattr(shutil, "disk_usage", lambda p: disk_usage(p, free=10_000))  # still full: the old advice
    said = str(disk_full_from(enospc, tmp_path / "out", 1_000_000))
    assert "(needed ~1.0 MB, free 0.0 MB): free some space or write elsewhere" in said, said
