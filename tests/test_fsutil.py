"""ferrule.fsutil: atomic directory commit and default permissions."""

from __future__ import annotations

import os
import stat
import tempfile

from ferrule.fsutil import apply_default_mode, commit_dir


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
