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


def test_training_runs_checkpoints_weights_info_and_archive(server, tmp_path):
    sc = server.client(ALICE)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, train_unembed=False,
                                        user_metadata={"recipe": "sl_basic"}).result()
    from serve_helpers import adam, sdk_data

    tc.forward_backward(sdk_data(seed=5, lengths=(6, 9)), "cross_entropy").result(timeout=120)
    tc.optim_step(adam()).result(timeout=120)   # a non-zero adapter: the download check below is a real one
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
    on_disk = server.storage / "checkpoints" / model_id / kind / name
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert got == {f"{name}/{f.name}": f.read_bytes() for f in on_disk.iterdir()}
    # a LoRA client's sampler checkpoint is its PEFT adapter (the default): the downloaded folder loads in
    # transformers + PEFT on the base and computes the service's own logprobs of that path
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / name
    folder.mkdir()
    for member, data in got.items():
        (tmp_path / member).write_bytes(data)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {f.name for f in folder.iterdir()}
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(server.backend.base_dir,
                                                                       dtype=torch.float32), folder).eval()
    prompt = [5, 9, 33, 2, 71, 14, 8]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].double(), -1)
    ref = lp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    served = sc.create_sampling_client(model_path=sampler).compute_logprobs(
        tinker.types.ModelInput.from_ints(prompt)).result(timeout=120)[1:]
    assert float((torch.tensor(served, dtype=torch.float64) - ref).abs().max()) < 1e-5
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


def test_sessions_ttl_and_unserved_sdk_routes_answer_naming_them(server):
    """list_sessions / get_session and set_checkpoint_ttl are served; every other SDK route answers with a
    message naming the SDK call (before: a bare 404 Not Found / 405 Method Not Allowed)."""
    sc = server.client(ALICE)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    session_id = tc.model_id.split(":train:")[0]
    rest = sc.create_rest_client()
    assert session_id in rest.list_sessions(limit=1000).result(timeout=60).sessions
    info = rest.get_session(session_id).result(timeout=60)
    assert tc.model_id in info.training_run_ids
    assert session_id not in server.client(BOB).create_rest_client().list_sessions(limit=1000).result(timeout=60) \
        .sessions
    with pytest.raises(tinker.NotFoundError):
        server.client(BOB).create_rest_client().get_session(session_id).result(timeout=60)
    # ttl: set, then removed; the checkpoint's user_metadata stays
    path = tc.save_weights_for_sampler("ttl-1").result(timeout=120).path
    store = server.app.state.store
    store.set_checkpoint_info(path, None, {"k": "v"})
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result(timeout=60)
    cp = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result(timeout=60).checkpoints}[path]
    assert cp.expires_at is not None and cp.user_metadata == {"k": "v"}
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result(timeout=60)
    assert store.checkpoint_info(path) == {"expires_at": None, "user_metadata": {"k": "v"}}
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    for method, route, call in (
            ("POST", f"training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "publish_checkpoint"),
            ("DELETE", f"training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "unpublish_checkpoint"),
            ("POST", "copy_weights", "copy_weights"), ("POST", "sessions/search", "search_sessions"),
            ("GET", "billing/usage/events", "billing"), ("POST", "retrieve_futures", "retrieve_futures")):
        r = httpx.request(method, f"{server.url}/api/v1/{route}", headers={"X-API-Key": ALICE}, json={}, timeout=30)
        assert r.status_code in (400, 404, 405) and f"does not serve {method} /api/v1/{route}" in r.json()["detail"] \
            and call in r.json()["detail"], (method, route, r.status_code, r.text)
    r = httpx.get(f"{server.url}/api/v1/no_such_call", headers={"X-API-Key": ALICE}, timeout=30)
    assert r.status_code == 404 and "docs/serve.md" in r.json()["detail"]
    assert (server.storage / "checkpoints" / model_id / kind / name).is_dir()   # nothing was touched


def test_tinker_checkpoint_download_gives_a_folder_transformers_loads(server, tmp_path, monkeypatch):
    """`tinker checkpoint download` (the 0.38 CLI, in process) of a LoRA client's save_state: it exports
    through save_weights_external + signed URLs; the folder loads in transformers and computes the
    client's own logprobs."""
    import torch
    from click.testing import CliRunner
    from serve_helpers import adam, sdk_data
    from tinker.cli.__main__ import main_cli
    from transformers import AutoModelForCausalLM

    sc = server.client(ALICE)
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    data = sdk_data(seed=8, lengths=(6, 9))
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam()).result()
    state = tc.save_state("dl").result(timeout=120).path
    served = tc.forward(data, "cross_entropy").result(timeout=120)
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", ALICE)
    r = CliRunner().invoke(main_cli, ["checkpoint", "download", state, "--output", str(tmp_path)])
    assert r.exit_code == 0, r.output
    folder = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    assert {"config.json", "model.safetensors"} <= {f.name for f in folder.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for d, o in zip(data, served.loss_fn_outputs):
            lp = torch.log_softmax(hf(torch.tensor([d.model_input.to_ints()])).logits[0].double(), -1)
            ref = lp.gather(-1, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())[:, None])[:, 0]
            assert float((ref - torch.tensor(o["logprobs"].tolist()).double()).abs().max()) < 1e-5
    # the CLI deleted its temporary export; a signed URL does not open another file or outlive its signature
    rest = sc.create_rest_client()
    assert not [c for c in rest.list_user_checkpoints().result(timeout=60).checkpoints
                if c.checkpoint_type == "external"]
    r = httpx.get(f"{server.url}/api/v1/external_weights_files/{tc.model_id}/download/config.json?expires=9999999999"
                  "&signature=00", timeout=30)
    assert r.status_code == 403 and "not signed" in r.json()["detail"]


def test_every_route_the_sdk_calls_is_served_or_answered_naming_it(server):
    """Every (method, path) the installed tinker SDK's resources call either is served or answers with a
    message naming it (``ferrule serve does not serve ...``; a served route's unknown id names the id):
    never a bare 404 / 405 nor the catch-all for paths no SDK knows. Paths are read from the SDK's source."""
    import re

    root = Path(tinker.__file__).parent
    calls = set()
    for f in [*root.glob("resources/*.py"), *root.glob("lib/**/*.py")]:
        for m in re.finditer(r"\._?(get|post|put|delete|patch)\(\s*f?\"(/api/v1/[^\"]*)\"", f.read_text()):
            calls.add((m.group(1).upper(), re.sub(r"\{[^}]+\}", "x1", m.group(2))))
    assert len(calls) >= 40, calls   # the SDK 0.38 calls 45; fewer means the pattern no longer reads it
    with httpx.Client(base_url=server.url, headers={"X-API-Key": ALICE}, timeout=30) as http:   # one connection
        answers = [(method, path, http.request(method, path, json={})) for method, path in sorted(calls)]
    for method, path, r in answers:
        if r.status_code in (404, 405):
            detail = r.json()["detail"]
            assert f"does not serve {method} {path} (" in detail or "does not exist for this API key" in detail, \
                (method, path, r.status_code, detail)
