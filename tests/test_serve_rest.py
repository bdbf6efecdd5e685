"""The REST routes the cookbook's ``checkpoint_utils`` and ``weights`` tools use, through the
unmodified ``tinker`` 0.38.0 SDK's ``RestClient``: training runs (list, get, by tinker path, with
``user_metadata``), checkpoints (list, delete, confined to the tenant), ``ttl_seconds``,
``weights_info`` and the archive download of a checkpoint (plain HTTP: the SDK has no call for it).
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "dist"))
tinker = pytest.importorskip("tinker", reason="the tinker SDK (serve extra) is not installed")
httpx = pytest.importorskip("httpx")
from serve_helpers import ALICE, BOB, MODEL_NAME, base, server  # noqa: E402,F401  (fixtures)


def test_training_runs_checkpoints_weights_info_and_archive(server):
    sc = server.client(ALICE)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, train_unembed=False,
                                        user_metadata={"recipe": "sl_basic"}).result()
    state = tc.save_state("step-1", user_metadata={"step": "1"}).result(timeout=120).path
    sampler = tc.save_weights_for_sampler("s-1", ttl_seconds=7200).result(timeout=120).path
    rest = sc.create_rest_client()
    run = rest.get_training_run(tc.model_id).result(timeout=60)
    assert run.training_run_id == tc.model_id and run.is_lora and run.lora_rank == 4
    assert run.base_model == MODEL_NAME and run.user_metadata == {"recipe": "sl_basic"}
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(sampler).result(timeout=60).training_run_id == tc.model_id
    runs = rest.list_training_runs(limit=100).result(timeout=60)
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= 1
    cps = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints}
    assert cps[state].user_metadata == {"step": "1"} and cps[state].expires_at is None
    assert cps[sampler].expires_at is not None and cps[state].checkpoint_type == "training"
    info = rest.get_weights_info_by_tinker_path(state).result(timeout=60)
    assert info.base_model == MODEL_NAME and info.is_lora and info.lora_rank == 4
    assert info.train_unembed is False and info.train_mlp is True and info.train_attn is True
    # archive: the checkpoint's files, byte for byte
    model_id, kind, name = sampler.removeprefix("tinker://").split("/")
    res = httpx.get(f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/archive",
                    headers={"X-API-Key": ALICE}, timeout=60)
    assert res.status_code == 200 and res.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        got = tar.extractfile(f"{name}/model.safetensors").read()
    assert got == (server.storage / "checkpoints" / model_id / kind / name / "model.safetensors").read_bytes()
    # another tenant sees nothing of it and cannot delete it
    bob = server.client(BOB).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run(tc.model_id).result(timeout=60)
    with pytest.raises(tinker.NotFoundError):
        bob.delete_checkpoint_from_tinker_path(state).result(timeout=60)
    res = httpx.get(f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/archive",
                    headers={"X-API-Key": BOB}, timeout=60)
    assert res.status_code == 404
    assert tc.model_id not in [r.training_run_id for r in bob.list_training_runs(limit=100).result(timeout=60)
                               .training_runs]
    # the owner deletes: files and record go, the path answers 404 afterwards
    rest.delete_checkpoint_from_tinker_path(state).result(timeout=60)
    assert not (server.storage / "checkpoints" / model_id / "weights" / "step-1").exists()
    assert state not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints]
    with pytest.raises(Exception, match="does not exist"):
        sc.create_training_client_from_state(state).result(timeout=60)


def test_ttl_seconds_expires_a_checkpoint(server):
    sc = server.client(ALICE)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    path = tc.save_weights_for_sampler("short", ttl_seconds=3600).result(timeout=120).path
    rest = sc.create_rest_client()
    assert path in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints]
    store = server.app.state.store
    store.set_checkpoint_info(path, 1.0, None)            # its hour has passed
    assert path not in [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints]
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    assert not (server.storage / "checkpoints" / model_id / kind / name).exists()
    with pytest.raises(Exception, match="does not exist"):
        sc.create_sampling_client(model_path=path).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        tc.save_weights_for_sampler("bad", ttl_seconds=0).result(timeout=60)
