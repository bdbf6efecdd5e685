"""Faults around ``ferrule convert`` (issue 28): a kill of a multi-rank conversion, a full disk,
temporary folders of killed conversions.

Each fault is injected from outside ferrule: a signal from the test to the ``ferrule convert``
process (or its whole group, as a terminal's Ctrl-C does), ``shutil.disk_usage`` reporting
little free space, a write that raises ``ENOSPC``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrule.conformance import numeric as cn

#: Runs ``ferrule convert`` (``ferrule.cli.main``); with FAULT_SLOW_WRITE=PREFIX every torch_dist
#: tensor write of every rank touches PREFIX<pid>, then sleeps. The patch sits at module level so the
#: spawned ranks (which import this file as ``__mp_main__``) get it too; with FAULT_SLOW_WRITE_RANKS_ONLY=1
#: (a multi-rank conversion: only the ranks write) the parent skips it and its megatron import, which cost
#: 15-17 s per killed conversion on the 2-core machine.
RUNNER = """\
import os, sys, time
from pathlib import Path

prefix = os.environ.get("FAULT_SLOW_WRITE")
if prefix and (__name__ == "__mp_main__" or not os.environ.get("FAULT_SLOW_WRITE_RANKS_ONLY")):
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def slow_write_item(*args, **kwargs):
        Path(prefix + str(os.getpid())).write_text("")
        time.sleep(300)

    fa._write_item = slow_write_item
if __name__ == "__main__":
    from ferrule.cli import main
    sys.argv = ["ferrule", *sys.argv[1:]]
    main()
"""


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return cn.tiny_hf_dir("qwen2", tmp_path_factory.mktemp("src") / "hf")


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", FERRULE_PLUGINS="qwen", **extra)


def _group_members(pgid: int) -> list[str]:
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error):
            continue
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_no_rank_outlives_a_killed_multi_rank_conversion(qwen2_dir, tmp_path, how):
    """``ferrule convert --tp 2`` run as a script's background job (``ferrule convert ... &``: SIGINT
    ignored) is signalled while both ranks are inside a torch_dist write: afterwards its process group
    is empty (bounded wait), and after a SIGTERM no temporary folder or lock is left. torch's spawn
    gives its ranks SIGINT as the death signal, which such a rank ignores (as one blocked in a C call
    never acts on it): after a kill -9 both ranks lived on under PID 1; after a SIGTERM the
    temporary output stayed."""
    (tmp_path / "runner.py").write_text(RUNNER)
    prefix, out = tmp_path / "writing-", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), "convert", "hf-to-torch-dist",
                             str(qwen2_dir), str(out), "--tp", "2"],
                            env=_env(FAULT_SLOW_WRITE=str(prefix), FAULT_SLOW_WRITE_RANKS_ONLY="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.time() + 180
        while len(list(tmp_path.glob("writing-*"))) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("writing-*"))) == 2, f"the ranks never wrote: {proc.stderr.read().decode()[-3000:]}"
        os.kill(proc.pid, signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
        rc = proc.wait(timeout=60)
        left = _group_members(proc.pid)
        for _ in range(50):  # children of a killed parent need a moment to be reaped or reparented
            if not left:
                break
            time.sleep(0.2)
            left = _group_members(proc.pid)
        assert left == [], f"processes outlived the {how} of ferrule convert: {left}"
        assert not out.exists()
        if how != "kill -9":  # the parent lived to clean up: no temporary folder, no lock file
            assert rc != 0 and sorted(p.name for p in tmp_path.iterdir()) == ["runner.py"] + sorted(
                p.name for p in tmp_path.glob("writing-*")), list(tmp_path.iterdir())
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.stderr.close()


# ------------------------------------------------------------------ a full disk, leftovers of killed conversions
def _fake_free(monkeypatch, free_bytes: int) -> None:
    import shutil

    real = shutil.disk_usage

    def disk_usage(path):
        u = real(path)
        return type(u)(u.total, u.total - free_bytes, free_bytes)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def _convert(*args: str):
    from typer.testing import CliRunner

    from ferrule.cli import app

    return CliRunner().invoke(app, ["convert", *args])


def _only(folder: Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names), list(folder.iterdir())


@pytest.fixture(scope="module")
def td_dir(qwen2_dir, tmp_path_factory) -> Path:
    from ferrule.converters import hf_to_torch_dist

    return hf_to_torch_dist(qwen2_dir, tmp_path_factory.mktemp("td") / "td")


def _needed_mb(output: str, out: Path) -> float:
    import re

    m = re.search(rf"no space left on {out} \(needed ~([0-9,.]+) MB, free 0\.0 MB\)", " ".join(output.split()))
    assert m, output
    return float(m.group(1).replace(",", ""))


def test_a_conversion_that_does_not_fit_is_refused_before_writing_with_the_sizes(qwen2_dir, td_dir, tmp_path,
                                                                                  monkeypatch):
    """Both directions (shutil.disk_usage reports 10 kB free): exit 2, one line naming OUT with the needed size,
    which is compared with what a real conversion wrote; nothing is left in OUT's folder."""
    real_td = sum(f.stat().st_size for f in td_dir.rglob("*") if f.is_file())
    real_hf = sum(f.stat().st_size for f in qwen2_dir.rglob("*") if f.is_file())
    _fake_free(monkeypatch, 10_000)
    res = _convert("hf-to-torch-dist", str(qwen2_dir), str(tmp_path / "td"))
    assert res.exit_code == 2, res.output
    # the message rounds to 0.1 MB
    assert abs(_needed_mb(res.output, tmp_path / "td") - real_td / 1e6) <= 0.05 + 0.2 * real_td / 1e6, (res.output, real_td)
    res = _convert("torch-dist-to-hf", str(td_dir), str(tmp_path / "hf"))
    assert res.exit_code == 2, res.output
    assert abs(_needed_mb(res.output, tmp_path / "hf") - real_hf / 1e6) <= 0.05 + 0.2 * real_hf / 1e6, (res.output, real_hf)
    _only(tmp_path)


def test_enospc_inside_a_conversion_is_a_full_disk_and_leaves_nothing(qwen2_dir, td_dir, tmp_path, monkeypatch):
    import errno

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    import ferrule.formats.safetensors_io as sio

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fa, "_write_item", full)
    res = _convert("hf-to-torch-dist", str(qwen2_dir), str(tmp_path / "td"))
    assert res.exit_code == 2 and f"no space left on {tmp_path / 'td'} (needed ~" in " ".join(res.output.split()) \
        and "No space left on device" in res.output, res.output
    monkeypatch.setattr(sio.ShardedSafetensorsWriter, "_flush", full)
    res = _convert("torch-dist-to-hf", str(td_dir), str(tmp_path / "hf"))
    assert res.exit_code == 2 and f"no space left on {tmp_path / 'hf'} (needed ~" in " ".join(res.output.split()), \
        res.output
    _only(tmp_path)


def test_temporary_folders_of_killed_conversions_are_removed_on_the_next_one(qwen2_dir, tmp_path):
    """A killed conversion's .OUT.tmp-PID (and a killed overwrite's .OUT.old-HEX) go, and the conversion says so;
    a live PID's folder and other outputs' folders stay."""
    import psutil

    dead = next(pid for pid in range(999_999, 900_000, -1) if not psutil.pid_exists(pid))
    stale = [tmp_path / f".out.tmp-{dead}", tmp_path / ".out.old-0123abcd"]
    kept = [tmp_path / f".out.tmp-{os.getppid()}", tmp_path / f".other.tmp-{dead}"]
    for d in stale + kept:
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"\0" * 1_500_000)
    res = _convert("hf-to-torch-dist", str(qwen2_dir), str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert f"removed 2 temporary folder(s) of interrupted writes of {tmp_path / 'out'} (3.0 MB)" in said, said
    assert not any(d.exists() for d in stale) and all(d.is_dir() for d in kept)


def test_ferrule_export_checks_the_free_space_and_removes_leftovers_of_killed_exports(td_dir, qwen2_dir, tmp_path,
                                                                                     monkeypatch):
    """A run folder whose checkpoint's engine/ is a converted torch_dist folder: an export that does not fit is
    refused with the sizes (OUT named); a killed LoRA export's .OUT.merge-PID-HEX is removed by the next export."""
    import shutil

    import psutil
    from typer.testing import CliRunner

    from ferrule.cli import app

    step = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(td_dir, step / "engine")
    (step / "loop_state.json").write_text("{}")
    out = tmp_path / "exported"
    with monkeypatch.context() as m:
        _fake_free(m, 10_000)
        res = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(out)])
    real_hf = sum(f.stat().st_size for f in qwen2_dir.rglob("*") if f.is_file())
    assert res.exit_code == 2, res.output
    assert abs(_needed_mb(res.output, out) - real_hf / 1e6) <= 0.05 + 0.2 * real_hf / 1e6, (res.output, real_hf)
    dead = next(pid for pid in range(999_999, 900_000, -1) if not psutil.pid_exists(pid))
    (tmp_path / f".exported.merge-{dead}-0123abcd").mkdir()
    res = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(out)])
    assert res.exit_code == 0, res.output
    assert f"removed 1 temporary folder(s) of interrupted writes of {out}" in " ".join(res.output.split()), res.output
    _only(tmp_path, "run", "exported")


def test_ferrule_check_family_is_the_family_of_the_conversion(qwen2_dir, tmp_path, monkeypatch):
    """``ferrule check --family F`` on a checkpoint whose model_type no family claims (here: qwen2's own
    specs registered again as family "qwen2_alias" claiming model_type "qwen2_alias", and "qwen2" unclaimed): the conversion, the round trip
    and the logits all use F. Before, the conversion resolved the family from config.json and failed."""
    import dataclasses

    from ferrule.contract import registry
    from ferrule.converters.check import run_check

    reg = registry.get_registry()
    alias = "qwen2_alias"
    monkeypatch.setitem(reg.families, alias, dataclasses.replace(reg.families["qwen2"], name=alias,
                                                                      model_types=(alias,)))
    for table in (reg.providers, reg.converters, reg.update_groups):
        monkeypatch.setitem(table, alias, dataclasses.replace(table["qwen2"], family=alias))
    monkeypatch.delitem(reg.model_types, "qwen2")
    with pytest.raises(registry.UnknownModelError):
        registry.family_for_hf_config({"model_type": "qwen2"})
    report = run_check(qwen2_dir, family=alias, seq_len=8)
    assert report.family == alias
    assert [(r.step, r.status) for r in report.rows] == [
        ("config", "ok"), ("convert (tp=1)", "ok"), ("round trip (tp=1)", "ok"), ("logits (tp=1, fp32)", "ok")], \
        report.rows


def test_bad_flag_values_are_refused_first_naming_the_flag(qwen2_dir, td_dir, tmp_path):
    """``--tp 0`` & co.: exit 2 with one ``error: --FLAG VALUE: ...`` line, no progress bar drawn, nothing written;
    a layout the model cannot split (found before any work too) draws no bar either."""
    for direction, src, flags in [("hf-to-torch-dist", qwen2_dir, ["--tp", "0"]), ("hf-to-torch-dist", qwen2_dir, ["--ep", "-1"]),
                                  ("hf-to-torch-dist", qwen2_dir, ["--pp", "0"]),
                                  ("torch-dist-to-hf", td_dir, ["--max-shard-gb", "0"])]:
        res = _convert(direction, str(src), str(tmp_path / "out"), *flags)
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {flags[0]} {flags[1]}"), res.output
    res = _convert("hf-to-torch-dist", str(qwen2_dir), str(tmp_path / "out"), "--tp", "3")
    # one line, no bar, no "ValueError:" before ferrule's own message (it is a ParallelLayoutError)
    assert res.exit_code == 2 and res.output.startswith("error: tp=3 must divide") and "torch_dist" not in res.output, \
        res.output
    _only(tmp_path)


def test_check_flag_values_are_refused_first_naming_the_flag(qwen2_dir):
    """``ferrule check --seqs 0`` ran config, convert and round trip, then reported a CRASH (IndexError) with exit
    code 3, "plugin code crashed"; every bad number is now one ``error:`` line naming the flag, exit 2."""
    from typer.testing import CliRunner

    from ferrule.cli import app

    for flag, value in (("--tp", "0"), ("--seqs", "0"), ("--seq-len", "0"), ("--atol", "-1")):
        res = CliRunner().invoke(app, ["check", str(qwen2_dir), flag, value], env={"COLUMNS": "200"})
        assert res.exit_code == 2 and res.output.startswith(f"error: {flag} {value}"), res.output
        assert "convert" not in res.output, res.output


def test_check_in_process_leaves_the_callers_warnings_and_environment_alone(tmp_path, monkeypatch):
    """The check silences warnings and HF's progress bars for its own run only. Before, it set
    ``PYTHONWARNINGS=ignore`` in the caller's os.environ for good: every later subprocess of a test session (or a
    notebook) ran with warnings off (CI: ``ferrule plugins`` stopped printing SharedRowOverlapWarning)."""
    import warnings

    from transformers.utils import logging as hf_logging
    from typer.testing import CliRunner

    from ferrule.cli import app

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    filters, bars = list(warnings.filters), hf_logging.is_progress_bar_enabled()
    res = CliRunner().invoke(app, ["check", str(tmp_path / "missing")], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and res.output.startswith("error:"), res.output
    assert "PYTHONWARNINGS" not in os.environ and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    assert warnings.filters == filters and hf_logging.is_progress_bar_enabled() == bars


def _refuse_on_rank0_hang_on_rank1(rank: int) -> None:
    """A conversion worker whose rank 0 fails at once while rank 1 is still busy (here: asleep)."""
    if rank == 0:
        raise ValueError("rank 0 refuses")
    time.sleep(120)


@pytest.mark.timeout(120)
def test_a_failed_rank_ends_the_others_without_torchs_sigterm_line(tmp_path, capfd, monkeypatch):
    """When one rank of a multi-process conversion fails, the caller gets that rank's error and nothing else
    is printed: torch's ``ProcessContext.join`` logged ``Terminating process N via signal SIGTERM`` for each
    rank still alive (seen above the one-line error of ``ferrule convert --pp 2``); the busy rank is still
    ended (bounded wait) and reaped."""
    import psutil

    from ferrule.converters import workers
    from ferrule.converters.workers import _run

    monkeypatch.setattr(workers, "FAILED_RANK_GRACE_S", 0.5)  # rank 1 never exits by itself: the grace is waited out

    def ranks() -> set[int]:  # spawned ranks of this process (not multiprocessing's resource tracker)
        return {c.pid for c in psutil.Process().children(recursive=True)
                if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline())}

    children_before = ranks()
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^\[error-rank0\] rank 0 refuses$"):
        _run(2, _refuse_on_rank0_hang_on_rank1, (), tmp_path)
    assert time.monotonic() - start < 60
    assert ranks() - children_before == set()
    err = capfd.readouterr().err
    assert "SIGTERM" not in err and "Terminating process" not in err, err


# ------------------------------------------------------------------ SIGTERM, ferrule lora export (issue 45.1, 45.3, 45.4)
@pytest.mark.timeout(240)
def test_a_one_rank_conversion_stopped_by_sigterm_leaves_no_temporary_folder_or_lock(qwen2_dir, tmp_path):
    """SIGTERM (a scheduler's preemption) inside the torch_dist write of ``ferrule convert`` (one rank, in
    process): exit 143, no OUT, no ``.out.tmp-PID``, no ``.out.lock``. Before: the process died at once and
    left both (docs/convert.md said it does not)."""
    (tmp_path / "runner.py").write_text(RUNNER)
    prefix, out = tmp_path / "writing-", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(tmp_path / "runner.py"), "convert", "hf-to-torch-dist",
                             str(qwen2_dir), str(out)], env=_env(FAULT_SLOW_WRITE=str(prefix)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not list(tmp_path.glob("writing-*")) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert list(tmp_path.glob("writing-*")), f"the conversion never wrote: {proc.stderr.read()[-3000:]}"
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        _only(tmp_path, "runner.py", *(p.name for p in tmp_path.glob("writing-*")))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lora_checkpoint(folder: Path) -> Path:
    """The smallest ``TrainEngine.save`` folder ``ferrule lora export`` accepts: ``lora/`` with one PEFT pair."""
    import json

    import torch
    from safetensors.torch import save_file

    (folder / "lora").mkdir(parents=True)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.ones(2, 8), key.format("B"): torch.zeros(8, 2)},
              folder / "lora" / "adapter_model.safetensors")
    (folder / "lora" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}))
    return folder


def _lora_export(*args: str):
    from typer.testing import CliRunner

    from ferrule.cli import app

    return CliRunner().invoke(app, ["lora", "export", *args])


def test_lora_export_into_an_out_another_writer_holds_is_refused_naming_it(tmp_path):
    """Before: two ``ferrule lora export`` into one OUT both exited 0 and one adapter silently replaced the other."""
    ckpt, out = _lora_checkpoint(tmp_path / "ckpt"), tmp_path / "peft"
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.lockf(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / ".peft.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = _lora_export(str(ckpt), str(out))
    finally:
        holder.kill()
        holder.wait()
    assert res.exit_code == 2, res.output
    assert f"output directory {out.absolute()} (another conversion or export writes it) is in use" in \
        " ".join(res.output.split()), res.output
    assert not out.exists() and not list(tmp_path.glob(".peft.tmp-*"))
    res = _lora_export(str(ckpt), str(out))  # the holder is gone: the kernel dropped its lock
    assert res.exit_code == 0 and (out / "adapter_model.safetensors").is_file(), res.output
    _only(tmp_path, "ckpt", "peft")


def test_the_next_writer_removes_every_leftover_of_killed_exports_and_says_how_much(tmp_path):
    """Leftovers no command removed before: ``ferrule lora export``'s ``.OUT.tmp-<uuid>``, and the LoRA merge of
    ``ferrule export`` (a conversion into ``.OUT.merge-PID-HEX``): its ``..OUT.merge-PID-HEX.tmp-PID`` (the fp32
    base, ~28 GB per kill on a 7B) and ``..OUT.merge-PID-HEX.lock``. A live writer's are kept."""
    import psutil

    ckpt, out = _lora_checkpoint(tmp_path / "ckpt"), tmp_path / "peft"
    dead = next(pid for pid in range(999_999, 900_000, -1) if not psutil.pid_exists(pid))
    stale = [tmp_path / ".peft.tmp-0a1b2c3d", tmp_path / f"..peft.merge-{dead}-0123abcd.tmp-{dead}"]
    for d in stale:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1_000_000)
    lock = tmp_path / f"..peft.merge-{dead}-0123abcd.lock"
    lock.write_text("{}")
    alive = tmp_path / f"..peft.merge-{os.getppid()}-4567abcd.tmp-{os.getppid()}"
    alive.mkdir()
    res = _lora_export(str(ckpt), str(out))
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert f"removed 3 temporary folder(s) of interrupted writes of {out.absolute()} (2.0 MB)" in said, said
    assert not any(p.exists() for p in (*stale, lock)) and alive.is_dir()
