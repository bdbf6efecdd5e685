"""SGLang rollout engine: launch (or attach to) an SGLang server and drive its native HTTP API.

Written against sgl-project/sglang (read, not installed here):

- routes: ``python/sglang/srt/entrypoints/http_server.py`` (``/generate``, ``/health``,
  ``/get_model_info``, ``/get_server_info``, ``/flush_cache``, ``/update_weights_from_tensor``,
  ``/update_weights_from_disk``, ``/init_weights_update_group``,
  ``/update_weights_from_distributed``, ``/load_lora_adapter``, ``/unload_lora_adapter``);
- request bodies: ``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``,
  ``UpdateWeightsFromTensorReqInput``, ``UpdateWeightFromDiskReqInput``,
  ``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
  ``LoadLoRAAdapterReqInput``) and ``python/sglang/srt/sampling/sampling_params.py``;
- response of ``/generate``: ``TokenizerManager`` builds ``{"text", "output_ids", "meta_info"}``
  per prompt; ``meta_info["output_token_logprobs"]`` is a list of ``(logprob, token_id, text|None)``
  (``TokenizerManager.detokenize_logprob_tokens``) and ``meta_info["finish_reason"]`` is
  ``BaseFinishReason.to_json()`` (``{"type": "stop", "matched": ...}``, ``{"type": "length",
  "length": n}`` or ``{"type": "abort", "message": ...}``, ``schedule_batch.py``).

SGLang's logprobs follow the convention of :mod:`ferrule.rollout.base` by default (tempered,
before top-k/top-p). Every non-2xx answer raises :class:`SGLangHTTPError` with the status and body.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable, Sequence

from ferrule import envs
from ferrule.rollout.base import GenerateRequest, GenerateResult, RolloutError, SamplingParams, as_requests

WEIGHT_TRANSPORTS = ("tensor", "disk")


class SGLangHTTPError(RolloutError):
    """An SGLang endpoint answered with a non-2xx status (or ``success: false``)."""

    def __init__(self, method: str, path: str, status: int, body: str):
        self.method, self.path, self.status, self.body = method, path, status, body
        super().__init__(f"SGLang {method} {path} -> HTTP {status}: {body[:2000]}")


# ---------------------------------------------------------------------------------- pure helpers
def sampling_params_to_sglang(params: SamplingParams, row_seed: int | None) -> dict[str, Any]:
    """Our :class:`SamplingParams` as SGLang ``sampling_params`` (``sampling_params.py`` field names).

    ``n`` is not sent: prompts are repeated client-side so every sample is one row with its own
    ``sampling_seed`` (SGLang's per-request seed field).

    Raises:
        ValueError: ``return_raw_logprobs`` (SGLang returns untempered logprobs only when the
            server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, then for every request).
    """
    if params.return_raw_logprobs:
        raise ValueError("SGLangEngine cannot return raw and tempered logprobs together; launch the server with "
                         "SGLANG_RETURN_ORIGINAL_LOGPROB=1 to get untempered logprobs instead.")
    out: dict[str, Any] = {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": params.effective_top_k or -1,
        "min_p": float(params.min_p),
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.stop:
        out["stop"] = list(params.stop)
    if row_seed is not None:
        out["sampling_seed"] = row_seed
    return out


def build_generate_payload(requests: Sequence[GenerateRequest], params: SamplingParams,
                           lora_name: str | None = None) -> dict[str, Any]:
    """Body of ``POST /generate`` (``GenerateReqInput``) for a batch, prompt-major, ``n`` rows per prompt.

    Row ``k = i * n + j`` is prompt ``i``, sample ``j``; its seed is ``seed + k`` when a seed is set.
    """
    rows = [list(r.prompt_token_ids) for r in requests for _ in range(params.n)]
    sp = [sampling_params_to_sglang(params, None if params.seed is None else params.seed + k) for k in range(len(rows))]
    body: dict[str, Any] = {"input_ids": rows, "sampling_params": sp, "return_logprob": True,
                            "logprob_start_len": -1, "stream": False}
    if lora_name is not None:
        body["lora_path"] = [lora_name] * len(rows)
    return body


def parse_generate_response(body: Any, requests: Sequence[GenerateRequest], params: SamplingParams,
                            weights_version: int | None = None) -> list[GenerateResult]:
    """Turn the ``/generate`` answer (a list, one dict per row) into :class:`GenerateResult` s.

    Raises:
        RolloutError: wrong number of rows, an aborted row, ``output_token_logprobs`` that
            disagree with ``output_ids``, or an unknown finish reason.
    """
    expected = len(requests) * params.n
    if isinstance(body, dict):
        body = [body]
    if not isinstance(body, list) or len(body) != expected:
        got = len(body) if isinstance(body, list) else type(body).__name__
        raise RolloutError(f"SGLang /generate returned {got} rows; expected {expected} "
                           f"({len(requests)} prompts x n={params.n}).")
    results = []
    for k, row in enumerate(body):
        i, j = divmod(k, params.n)
        meta = row.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "abort":
            raise RolloutError(f"SGLang aborted row {k} (prompt {i}, sample {j}): {finish.get('message')!r}")
        if kind not in ("stop", "length"):
            raise RolloutError(f"SGLang row {k}: unknown finish_reason {finish!r}; expected type stop/length.")
        ids = [int(t) for t in row.get("output_ids") or []]
        lps = meta.get("output_token_logprobs")
        if lps is None:
            raise RolloutError(f"SGLang row {k} has no meta_info.output_token_logprobs; was return_logprob sent?")
        lp_ids = [int(e[1]) for e in lps]
        if lp_ids != ids:
            raise RolloutError(f"SGLang row {k}: output_token_logprobs ids {lp_ids[:8]}... disagree with "
                               f"output_ids {ids[:8]}...")
        results.append(GenerateResult(token_ids=tuple(ids), logprobs=tuple(float(e[0]) for e in lps),
                                      finish_reason=kind, prompt_index=i, sample_index=j,
                                      request_id=requests[i].request_id, weights_version=weights_version))
    return results


def build_update_from_disk_payload(model_path: str, version: int, load_format: str | None = None) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_disk`` (``UpdateWeightFromDiskReqInput``)."""
    body: dict[str, Any] = {"model_path": model_path, "weight_version": str(version)}
    if load_format is not None:
        body["load_format"] = load_format
    return body


def build_init_weights_update_group_payload(master_address: str, master_port: int, rank_offset: int,
                                            world_size: int, group_name: str = "weight_update_group",
                                            backend: str = "nccl") -> dict[str, Any]:
    """Body of ``POST /init_weights_update_group`` (``InitWeightsUpdateGroupReqInput``)."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def build_update_from_distributed_payload(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                          version: int, group_name: str = "weight_update_group",
                                          flush_cache: bool = True) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_distributed`` (``UpdateWeightsFromDistributedReqInput``).

    ``dtypes`` are torch dtype names without the ``torch.`` prefix (``"bfloat16"``); the
    trainer then broadcasts each tensor, in this order, on the named process group.
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}.")
    return {"names": list(names), "dtypes": [str(d).replace("torch.", "") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": str(version)}


def build_load_lora_payload(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    """Body of ``POST /load_lora_adapter`` (``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path``, ``pinned``).

    ``lora_path`` is a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    that the *server* can read; requests then pick the adapter by ``lora_path=[lora_name, ...]`` in
    ``/generate`` (:func:`build_generate_payload`).
    """
    if not lora_name or not isinstance(lora_name, str):
        raise ValueError(f"lora_name={lora_name!r}; expected a non-empty string.")
    return {"lora_name": lora_name, "lora_path": os.fspath(lora_path), "pinned": bool(pinned)}


def write_peft_adapter_dir(path: str, tensors: dict[str, Any], peft_config: dict[str, Any]) -> str:
    """Write ``tensors`` + ``peft_config`` as a PEFT adapter folder, atomically (temp folder, then rename).

    Files: ``adapter_model.safetensors`` (contiguous CPU copies, the given dtypes) and
    ``adapter_config.json`` (what ``PeftModel.from_pretrained`` and SGLang's ``LoRAConfig`` read).

    Raises:
        FileExistsError: ``path`` exists. ValueError: no tensors, or names that are not PEFT
            ``lora_A`` / ``lora_B`` weights.
    """
    import json
    import shutil

    from safetensors.torch import save_file

    bad = [n for n in tensors if not (n.endswith(".lora_A.weight") or n.endswith(".lora_B.weight"))]
    if not tensors or bad:
        raise ValueError(f"write_peft_adapter_dir: expected PEFT lora_A / lora_B weights, got "
                         f"{len(tensors)} tensors, offending names {bad[:5]}.")
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; adapter folders are written once per version.")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    try:
        save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()},
                  os.path.join(tmp, "adapter_model.safetensors"))
        with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
            json.dump({k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in peft_config.items()},
                      f, indent=2, default=str)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------- engine
class SGLangEngine:
    """Rollout engine backed by an SGLang server.

    Args:
        url: attach to a running server (``http://host:port``); or
        model_path: launch ``python -m sglang.launch_server --model-path model_path --host
            host --port port *launch_args`` as a subprocess (own process group; stdout/stderr
            to ``log_path``, default a temp file) and wait until ``GET /health`` answers 200.
        launch_args: extra server flags, e.g. ``("--tp-size", "2", "--enable-lora")``.
        weight_transport: ``"tensor"`` (``/update_weights_from_tensor`` with CUDA-IPC handles;
            needs ``sglang`` importable here and the server on this host) or ``"disk"``
            (each call writes a safetensors file and calls ``/update_weights_from_disk``).
        startup_timeout / request_timeout: seconds.
        lora_dir: where :meth:`update_lora_adapter` writes adapter folders (a path the server can
            read; default a temp folder). lora_name_prefix: served adapters are named
            ``<prefix>-v<version>-<n>``.

    Raises:
        ValueError: neither or both of url / model_path; unknown transport.
        RolloutError: the server process exits or is not healthy within ``startup_timeout``
            (the message carries the log tail).
    """

    kind = "sglang"

    def __init__(self, url: str | None = None, *, model_path: str | None = None, launch_args: Sequence[str] = (),
                 host: str = "127.0.0.1", port: int | None = None, python: str = sys.executable,
                 weight_transport: str = "tensor", startup_timeout: float = 900.0, request_timeout: float = 1800.0,
                 log_path: str | None = None, env: dict[str, str] | None = None, disk_dir: str | None = None,
                 lora_dir: str | None = None, lora_name_prefix: str = "ferrule-policy"):
        import httpx

        if (url is None) == (model_path is None):
            raise ValueError("SGLangEngine needs exactly one of url= (attach) or model_path= (launch).")
        if weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(f"weight_transport={weight_transport!r}; expected one of {WEIGHT_TRANSPORTS}.")
        self.weight_transport = weight_transport
        self.weights_version = 0
        self.process: subprocess.Popen | None = None
        self.log_path = log_path
        self.disk_dir = disk_dir
        self.lora_dir = lora_dir
        self.lora_name_prefix = lora_name_prefix
        self.served_lora: tuple[str, str] | None = None  # (lora_name, folder) of update_lora_adapter's adapter
        self._lora_loads = 0
        if model_path is not None:
            port = port or free_port()
            url = f"http://{host}:{port}"
            self._launch(python, model_path, host, port, launch_args, env)
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=request_timeout)
        if self.process is not None:
            self._wait_ready(startup_timeout)

    # -------------------------------------------------------------- process
    def _launch(self, python, model_path, host, port, launch_args, env) -> None:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port),
               *launch_args]
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="ferrule-sglang-", suffix=".log")
            os.close(fd)
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=envs.child_env(**(env or {})), start_new_session=True)
        self.command = cmd

    def log_tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the server log ('' when attached)."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return b"".join(collections.deque(f, maxlen=lines)).decode(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RolloutError(f"SGLang server exited with code {self.process.returncode} during startup "
                                   f"({' '.join(self.command)}). Log tail ({self.log_path}):\n{self.log_tail()}")
            try:
                if self._http.get("/health", timeout=30).status_code == 200:
                    return
            except Exception:  # connection refused while the server boots
                pass
            time.sleep(2.0)
        self.shutdown()
        raise RolloutError(f"SGLang server not healthy after {timeout:.0f} s. Log tail ({self.log_path}):\n"
                           f"{self.log_tail()}")

    # -------------------------------------------------------------- HTTP
    def _request(self, method: str, path: str, json: Any = None) -> Any:
        resp = self._http.request(method, path, json=json)
        if not 200 <= resp.status_code < 300:
            raise SGLangHTTPError(method, path, resp.status_code, resp.text)
        if "application/json" not in resp.headers.get("content-type", ""):
            return resp.text
        body = resp.json()
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangHTTPError(method, path, resp.status_code, resp.text)
        return body

    # -------------------------------------------------------------- protocol
    def generate(self, requests: Sequence[GenerateRequest | Sequence[int]], sampling_params: SamplingParams,
                 lora_name: str | None = None) -> list[GenerateResult]:
        """``POST /generate``; results prompt-major (see :class:`ferrule.rollout.base.RolloutEngine`).

        ``lora_name``: the adapter to apply (default: the one :meth:`update_lora_adapter` serves, if any).
        """
        reqs = as_requests(requests)
        if sampling_params.return_routed_experts:  # never train on routes nobody recorded
            raise ValueError("return_routed_experts: the SGLang client does not ask the server for routed experts "
                             "yet; use the embedded engine for MoE routing replay (algorithm.routing_replay).")
        with_media = [i for i, r in enumerate(reqs) if r.media]
        if with_media:  # never drop media silently
            raise NotImplementedError(f"requests {with_media[:5]} carry media; the SGLang client does not send media "
                                      f"yet; use the embedded engine for multimodal prompts.")
        if lora_name is None and self.served_lora is not None:
            lora_name = self.served_lora[0]
        body = self._request("POST", "/generate", build_generate_payload(reqs, sampling_params, lora_name))
        return parse_generate_response(body, reqs, sampling_params, self.weights_version)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Send HF-named tensors with the configured transport; then ``weights_version = version``."""
        if version < self.weights_version:
            raise ValueError(f"update_weights(version={version}) is older than weights_version={self.weights_version}.")
        items = list(named_tensors)
        if self.weight_transport == "tensor":
            self.update_weights_from_tensor(items, version)
        else:
            self.update_weights_via_disk(items, version)
        self.weights_version = version

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        """``POST /update_weights_from_tensor`` with ``load_format="flattened_bucket"`` (one bucket per dtype).

        Serialisation uses SGLang's own ``MultiprocessingSerializer`` and ``FlattenedTensorBucket``
        (CUDA IPC handles), so ``sglang`` must be importable here and the tensors must be on a
        GPU of this host. Each TP rank of the server gets the same serialized bucket.
        """
        try:
            from sglang.srt.utils import MultiprocessingSerializer
            try:
                from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
            except ImportError:
                from sglang.srt.model_executor.model_runner import FlattenedTensorBucket
        except ImportError as exc:
            raise RolloutError("weight_transport='tensor' needs the sglang package in this process; install it or "
                               "use weight_transport='disk'.") from exc
        tp_size = int(self.server_info().get("tp_size", 1))
        by_dtype: dict[Any, list] = collections.defaultdict(list)
        for name, t in named_tensors:
            by_dtype[t.dtype].append((name, t))
        for group in by_dtype.values():
            bucket = FlattenedTensorBucket(named_tensors=group)
            payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
            blob = MultiprocessingSerializer.serialize(payload, output_str=True)
            self._request("POST", "/update_weights_from_tensor", {
                "serialized_named_tensors": [blob] * tp_size, "load_format": "flattened_bucket",
                "flush_cache": True, "weight_version": str(version)})

    def update_weights_via_disk(self, named_tensors: list[tuple[str, Any]], version: int) -> None:
        """Write the tensors to ``<disk_dir>/v<version>-<n>/model.safetensors``; ``POST /update_weights_from_disk``.

        The folder is removed once the call returns (the server has read it by then, or refused
        it), so a run does not keep one copy of the weights per sync on disk.
        """
        import shutil

        from safetensors.torch import save_file

        root = self.disk_dir or tempfile.mkdtemp(prefix="ferrule-sglang-weights-")
        os.makedirs(root, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"v{version}-", dir=root)
        try:
            save_file({n: t.detach().contiguous().cpu() for n, t in named_tensors},
                      os.path.join(path, "model.safetensors"))
            self._request("POST", "/update_weights_from_disk", build_update_from_disk_payload(path, version))
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """``POST /init_weights_update_group``: the server joins a process group for broadcast updates."""
        self._request("POST", "/init_weights_update_group", build_init_weights_update_group_payload(
            master_address, master_port, rank_offset, world_size, group_name, backend))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                                        shapes: Sequence[Sequence[int]], version: int,
                                        group_name: str = "weight_update_group") -> None:
        """``POST /update_weights_from_distributed`` (metadata); the trainer broadcasts the tensors.

        The HTTP call returns only after the server received every tensor, so call it from a
        thread while the trainer runs its ``torch.distributed.broadcast`` calls.
        """
        self._request("POST", "/update_weights_from_distributed",
                      build_update_from_distributed_payload(names, dtypes, shapes, version, group_name))
        self.weights_version = version

    def flush_cache(self) -> None:
        """``POST /flush_cache`` (400 when requests are running -> SGLangHTTPError)."""
        self._request("POST", "/flush_cache")

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False, **kwargs: Any) -> None:
        """``POST /load_lora_adapter`` (server needs ``--enable-lora``); use with ``generate(lora_name=name)``."""
        if kwargs:
            raise TypeError(f"SGLangEngine.load_lora_adapter got unsupported arguments {sorted(kwargs)}.")
        self._request("POST", "/load_lora_adapter", build_load_lora_payload(name, path, pinned))

    def unload_lora_adapter(self, name: str) -> None:
        """``POST /unload_lora_adapter``."""
        self._request("POST", "/unload_lora_adapter", {"lora_name": name})

    def update_lora_adapter(self, tensors: dict[str, Any], peft_config: dict[str, Any], version: int) -> None:
        """Serve a new version of the policy adapter: write it, load it under a new name, drop the old one.

        SGLang loads adapters from a path the server reads (``/load_lora_adapter``), so the adapter
        goes to ``<lora_dir>/<name>`` (:func:`write_peft_adapter_dir`; the server must see the same
        filesystem) and is loaded as ``<name> = <lora_name_prefix>-v<version>-<n>`` (``n`` counts
        loads, so names never repeat); then
        the previous version is unloaded and its folder removed. A load that fails leaves the previous
        adapter served. ``generate`` without ``lora_name`` uses the current adapter.

        The server must be launched with ``--enable-lora`` and room for the adapter
        (``--max-lora-rank``, ``--lora-target-modules``, ``--max-loaded-loras`` >= 2 while the old and
        new versions overlap).

        Raises:
            ValueError: a version going backwards. SGLangHTTPError: the server refused the load.
        """
        import shutil

        if version < self.weights_version:
            raise ValueError(f"update_lora_adapter(version={version}) is older than weights_version="
                             f"{self.weights_version}.")
        root = self.lora_dir or tempfile.mkdtemp(prefix="ferrule-sglang-lora-")
        self.lora_dir = root
        self._lora_loads += 1  # names stay unique when one version is sent twice (a re-sync after resume)
        name = f"{self.lora_name_prefix}-v{version}-{self._lora_loads}"
        path = os.path.join(root, name)
        write_peft_adapter_dir(path, tensors, peft_config)
        try:
            self.load_lora_adapter(name, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        previous, self.served_lora = self.served_lora, (name, path)
        self.weights_version = version
        if previous is not None:
            self.unload_lora_adapter(previous[0])
            shutil.rmtree(previous[1], ignore_errors=True)

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``."""
        return self._request("GET", "/get_model_info")

    def server_info(self) -> dict[str, Any]:
        """``GET /get_server_info`` (server args incl. ``tp_size``)."""
        return self._request("GET", "/get_server_info")

    def health(self) -> dict[str, Any]:
        """``GET /health`` (runs a 1-token generation server-side) + model info."""
        self._request("GET", "/health")
        info = self.model_info()
        return {"status": "ok", "kind": self.kind, "url": self.url, "weights_version": self.weights_version,
                "server_weight_version": info.get("weight_version"), "model_path": info.get("model_path"),
                "pid": None if self.process is None else self.process.pid}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Close the HTTP client; stop the server process group if this engine launched it."""
        if getattr(self, "_http", None) is not None:
            self._http.close()
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
