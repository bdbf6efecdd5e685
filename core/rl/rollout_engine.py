"""The rollout engine of ``ferrule train``: which one, on which ranks, and ``rollout.engine: sglang``.

``rollout.engine: embedded`` (default): one :class:`~ferrule.rollout.embedded.EmbeddedEngine` on
the first rank of every data-parallel replica (:mod:`ferrule.rl.distributed`).

``rollout.engine: sglang``: one :class:`~ferrule.rollout.sglang.SGLangEngine` on the driver
(global rank 0) only, at any world size; no rank builds an embedded engine.

- **Server**: attach to ``rollout.sglang_url``, or launch ``python -m sglang.launch_server
  --model-path MODEL.HF_DIR --host 127.0.0.1 --port <free> --dtype MODEL.DTYPE <sglang_args>``
  (:func:`sglang_launch_args`; log in ``RUN_DIR/sglang_server.log``). A launched server is
  stopped when the run ends, also on an error (:func:`release_rollout_engine`, an ``atexit``
  hook, and a SIGTERM handler on the driver, since torchrun stops ranks with SIGTERM).
- **Tokenizer**: the client has none; the driver loads ``AutoTokenizer.from_pretrained(model.hf_dir)``
  (the files the embedded engine would load) to render prompts, resolve stop tokens and decode.
- **Rollout shards**: every shard goes to the driver (one replica for
  :func:`~ferrule.rl.distributed.plan_shards`): ``rollout.prompts_per_shard: 0`` is one
  ``/generate`` call for the whole step, which the server batches; a value > 0 makes several
  calls in sequence, each with its shard's seed. Each row carries ``sampling_seed = shard seed +
  row`` (:func:`~ferrule.rollout.sglang.build_generate_payload`); SGLang's docs say sampling is
  reproducible only with ``--enable-deterministic-inference``, and its kernels differ from the
  embedded engine's, so samples equal the embedded engine's in distribution only.
- **Weight sync**: unchanged: :func:`ferrule.sync.sync_weights` gathers the update-group buckets
  once over the driver's replica (TP all-gather, PP broadcast) and rank 0 sends them with
  ``rollout.sglang_weight_transport``; the other replicas send nothing (no fan-out: no other
  rollout engine). With ``lora:`` only the adapter travels
  (:func:`ferrule.sync.sync_lora_adapter` -> ``SGLangEngine.update_lora_adapter``).

Refused at config time (:func:`sglang_config_problems`), each naming its key: a temperature
other than 1 (the loop needs temperature-1 logprobs, see the message), launch flags together
with ``sglang_url``, flags that the loop sets itself, LoRA without the server's LoRA flags.
Refused when the trainer is built (:func:`check_rollout_engine`): ``--check-weight-update-equal``
(the server's weights cannot be read back). Refused in setup: prompts with media (the client
sends none), a launch where ``sglang`` is not importable, ``sglang_weight_transport: tensor``
without a GPU or without ``sglang`` importable, an attached URL that does not answer ``/health``.

Not run against a live SGLang server (none can run on the machines this was written on).
"""

from __future__ import annotations

import dataclasses

import atexit
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ferrule.rl.config_types import ConfigError
from ferrule.rollout import get_rollout_engine

if TYPE_CHECKING:
    from ferrule.rl.config_schema import RLConfig

__all__ = ["SERVER_LOG", "WEIGHTS_DIR", "LORA_DIR", "build_rollout_engine", "check_rollout_engine",
           "load_tokenizer", "release_rollout_engine", "sglang_config_problems", "sglang_launch_args",
           "wants_raw_logprobs"]

#: server log of a launched server, in the run folder
SERVER_LOG = "sglang_server.log"
#: ``sglang_weight_transport: disk``: bucket folders (each removed once the server loaded it)
WEIGHTS_DIR = "sglang_weights"
#: LoRA adapter folders written for ``/load_lora_adapter`` (the previous version is removed)
LORA_DIR = "sglang_lora"
#: seconds an attached server has to answer its first ``GET /health``
ATTACH_HEALTH_TIMEOUT_S = 60.0
#: flags the loop sets itself: key -> why
RESERVED = {
    "model_path": "the server loads model.hf_dir",
    "host": "ferrule launches the server on 127.0.0.1; to serve elsewhere run it yourself and set rollout.sglang_url",
    "port": "ferrule picks a free port; to choose one run the server yourself and set rollout.sglang_url",
}
_KEY = re.compile(r"^[a-z][a-z0-9]*([_-][a-z0-9]+)*$")


def _flag_key(key: str) -> str:
    return key.replace("-", "_")


def sglang_launch_args(args: Mapping[str, Any]) -> list[str]:
    """``rollout.sglang_args`` as ``sglang.launch_server`` command-line arguments, in the given order.

    Each key ``k`` becomes ``--k`` with ``_`` written as ``-`` (``mem_fraction_static`` ->
    ``--mem-fraction-static``; dashed keys are accepted as they are). Values: ``true`` -> the bare
    switch; ``false`` -> nothing (a switch left off); an int, float or string -> one argument
    (``str(value)``); a non-empty list of those -> the flag followed by each item (argparse
    ``nargs="+"``, e.g. ``lora_target_modules: [q_proj, v_proj]``); a dict -> one JSON argument
    (e.g. ``json_model_override_args``).

    Raises:
        ConfigError: every bad entry at once, each naming ``rollout.sglang_args.<key>``: a key
            that is not a lower-case flag name (written with leading dashes, upper case, spaces),
            a key the loop sets itself (:data:`RESERVED`), ``null``, an empty list, or a list
            holding something other than scalars.
    """
    out: list[str] = []
    problems: list[str] = []
    for key, value in args.items():
        where = f"rollout.sglang_args.{key}"
        if not isinstance(key, str) or not _KEY.match(key):
            problems.append(f"{where}: not an SGLang flag name; write the flag without leading dashes, lower case, "
                            "e.g. mem_fraction_static for --mem-fraction-static")
            continue
        if _flag_key(key) in RESERVED:
            problems.append(f"{where}: set by the loop ({RESERVED[_flag_key(key)]}); remove it")
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            continue
        elif isinstance(value, (int, float, str)):
            out += [flag, str(value)]
        elif isinstance(value, list):
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, (int, float, str))]
            if not value or bad:
                problems.append(f"{where}: a list value must hold one or more numbers or strings (the flag's "
                                f"values), got {value!r}")
                continue
            out += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            problems.append(f"{where}: {value!r} has no command-line form; give true/false, a number, a string, a "
                            "list or a dict, or remove the key")
    if problems:
        raise ConfigError(problems)
    return out


def sglang_config_problems(cfg: RLConfig) -> list[str]:
    """What ``rollout.engine: sglang`` cannot do with ``cfg`` (empty list: nothing, or another engine).

    No file access and no server: called by :func:`ferrule.rl.config_checks.validate_config`.
    """
    ro = cfg.rollout
    if ro.engine != "sglang":
        return []
    p: list[str] = []
    if ro.temperature != 1.0:
        p.append(f"rollout.temperature: {ro.temperature} with rollout.engine=sglang; the loop trains on the "
                 "temperature-1 logprobs of the sampled tokens, and an SGLang server returns the tempered ones "
                 "(or, launched with SGLANG_RETURN_ORIGINAL_LOGPROB=1, only the untempered ones for every "
                 "request, which the client does not read as such yet); at temperature 1 they are the same: set "
                 "rollout.temperature=1.0, or use rollout.engine=embedded")
    if ro.sglang_url:
        if not re.match(r"^https?://[^/\s]+", ro.sglang_url):
            p.append(f"rollout.sglang_url: {ro.sglang_url!r} is not an http(s) URL; write it as "
                     "http://HOST:PORT (e.g. http://127.0.0.1:30000)")
        if ro.sglang_args:
            p.append(f"rollout.sglang_args: {sorted(ro.sglang_args)} are launch flags, but rollout.sglang_url "
                     "attaches to a server that is already running; pass them to that server and remove them "
                     "here, or clear rollout.sglang_url to let the loop launch one")
        return p
    try:
        sglang_launch_args(ro.sglang_args)
    except ConfigError as exc:
        p += exc.problems
    args = {_flag_key(k): v for k, v in ro.sglang_args.items() if isinstance(k, str)}
    if "dtype" in args and args["dtype"] != cfg.model.dtype:
        p.append(f"rollout.sglang_args.dtype: {args['dtype']!r} differs from model.dtype={cfg.model.dtype!r}; the "
                 "loop launches the server with --dtype model.dtype so that rollout and training share one "
                 "precision: remove rollout.sglang_args.dtype")
    if cfg.lora.rank > 0:
        if args.get("enable_lora") is not True:
            p.append("rollout.sglang_args.enable_lora: lora.rank > 0 serves the adapter through SGLang's "
                     "/load_lora_adapter, which needs the server launched with --enable-lora; set "
                     "rollout.sglang_args.enable_lora=true")
        rank = args.get("max_lora_rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < cfg.lora.rank:
            p.append(f"rollout.sglang_args.max_lora_rank: {rank!r}; the server sizes its LoRA buffers at launch "
                     f"and adapters are loaded later, so set it to >= lora.rank={cfg.lora.rank}")
        if not args.get("lora_target_modules"):
            p.append("rollout.sglang_args.lora_target_modules: required with lora.rank > 0 (the server allocates "
                     "LoRA buffers at launch for these HF module names); e.g. [q_proj, k_proj, v_proj, o_proj] "
                     "or the modules of lora.target_modules")
        loaded = args.get("max_loaded_loras")
        if loaded is not None and (isinstance(loaded, bool) or not isinstance(loaded, int) or loaded < 2):
            p.append(f"rollout.sglang_args.max_loaded_loras: {loaded!r}; each sync loads the new adapter before "
                     "unloading the old one, so two must fit: set it to >= 2 or remove it")
    return p


def check_rollout_engine(cfg: RLConfig, *, check_weight_update_equal: bool) -> None:
    """Refusals of the run's options that depend on the rollout engine (before anything is loaded).

    Raises:
        ConfigError: ``--check-weight-update-equal`` with ``rollout.engine: sglang`` (the check
            reads the served tensors back, ``get_hf_state_dict`` / ``weight_checksums``, or the
            served adapter, ``get_lora_state_dict`` / ``lora_checksums``; an SGLang server offers
            neither).
    """
    if cfg.rollout.engine == "sglang" and check_weight_update_equal:
        raise ConfigError(["--check-weight-update-equal: rollout.engine=sglang cannot be verified (the server does "
                           "not hand its weights or adapter back); drop the flag, or verify the sync with "
                           "rollout.engine=embedded"])


def wants_raw_logprobs(cfg: RLConfig, temperature: float) -> bool:
    """Whether a ``generate`` at ``temperature`` asks for untempered logprobs (``return_raw_logprobs``).

    The embedded engine returns both; with SGLang the config check keeps the rollout at
    temperature 1, where its (tempered) logprobs are the untempered ones, and evaluation uses no
    logprobs, so none are asked for.
    """
    return temperature > 0 and cfg.rollout.engine == "embedded"


def load_tokenizer(hf_dir: str) -> Any:
    """``AutoTokenizer.from_pretrained(hf_dir)`` when the folder has ``tokenizer.json`` or
    ``tokenizer_config.json`` (what the embedded engine loads), else None."""
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def _sglang_engine_kwargs(cfg: RLConfig) -> dict[str, Any]:
    """Constructor arguments of the driver's :class:`~ferrule.rollout.sglang.SGLangEngine` (no I/O)."""
    ro, run_dir = cfg.rollout, Path(cfg.logging.run_dir)
    kwargs: dict[str, Any] = {"weight_transport": ro.sglang_weight_transport,
                              "disk_dir": str(run_dir / WEIGHTS_DIR), "lora_dir": str(run_dir / LORA_DIR)}
    if ro.sglang_url:
        kwargs["url"] = ro.sglang_url
    else:
        extra = sglang_launch_args(ro.sglang_args)
        if "dtype" not in {_flag_key(k) for k in ro.sglang_args}:
            extra = ["--dtype", cfg.model.dtype, *extra]
        kwargs.update(model_path=str(cfg.model.hf_dir), launch_args=tuple(extra), python=sys.executable,
                      log_path=str(run_dir / SERVER_LOG))
    return kwargs


def _sglang_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def _check_transport(cfg: RLConfig, device: Any) -> None:
    """sglang importable for a launch; the tensor transport's needs (a GPU, sglang in this process)."""
    problems = []
    if not cfg.rollout.sglang_url and not _sglang_importable():
        raise ConfigError(["rollout.engine: sglang with no rollout.sglang_url launches `python -m "
                           f"sglang.launch_server` with this Python ({sys.executable}), which cannot import sglang; "
                           "install sglang here, or start a server yourself and set rollout.sglang_url"])
    if cfg.rollout.sglang_weight_transport != "tensor":
        return
    if getattr(device, "type", str(device)) != "cuda":
        problems.append("rollout.sglang_weight_transport: tensor hands the server CUDA IPC handles of the train "
                        "engine's tensors, but training runs on the CPU here; set "
                        "rollout.sglang_weight_transport=disk")
    if not _sglang_importable():
        problems.append("rollout.sglang_weight_transport: tensor serializes the buckets with sglang's own "
                        "serializer, and sglang is not importable in this process; install sglang here or set "
                        "rollout.sglang_weight_transport=disk")
    if problems:
        raise ConfigError(problems)


def _stop_on_sigterm(engine: Any) -> None:
    """Stop a launched server when this process gets SIGTERM (torchrun's way of stopping ranks), then
    die of the signal as before; and at interpreter exit."""
    atexit.register(engine.shutdown)
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        engine.shutdown()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    engine._ferrule_sigterm = (on_sigterm, previous)


def build_rollout_engine(cfg: RLConfig, *, dtype: Any, device: Any) -> tuple[Any, Any]:
    """The rollout engine of this rank and the tokenizer the loop renders and decodes with.

    Call only on a rank that holds a rollout engine (``RankRoles.replica is not None``; with
    ``rollout.engine: sglang`` that is the driver alone, see
    :func:`ferrule.rl.distributed.rank_roles`).

    Args:
        dtype: parameter dtype of the embedded engine (``torch`` dtype from ``model.dtype``).
        device: the train engine's device (the embedded engine runs there).

    Returns:
        ``(engine, tokenizer)``; the tokenizer is None when ``model.hf_dir`` has no tokenizer files.

    Raises:
        ConfigError: a launch where ``sglang`` is not importable; ``sglang_weight_transport: tensor``
            that cannot work here; an attached server
            (``rollout.sglang_url``) that does not answer ``GET /health`` within
            :data:`ATTACH_HEALTH_TIMEOUT_S` seconds.
        RolloutError: a launched SGLang server exits or stays unhealthy (with its log tail).
    """
    if cfg.rollout.engine == "embedded":
        settings = cfg.rollout_engine
        if cfg.algorithm.routing_replay:  # routes are recorded by hooks on the eager decode path only
            settings = dataclasses.replace(settings, cuda_graph=False, compile_decode=False, fast_decode=False)
        engine = get_rollout_engine("embedded", hf_dir=cfg.model.hf_dir, dtype=dtype, device=device,
                                    settings=settings)
        return engine, engine.tokenizer
    _check_transport(cfg, device)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    kwargs = _sglang_engine_kwargs(cfg)
    if "model_path" in kwargs:
        Path(cfg.logging.run_dir).mkdir(parents=True, exist_ok=True)
    engine = get_rollout_engine("sglang", **kwargs)
    if cfg.rollout.sglang_url:
        _check_attached(engine, cfg.rollout.sglang_url)
    elif engine.process is not None:
        _stop_on_sigterm(engine)
    return engine, tokenizer


def _check_attached(engine: Any, url: str, timeout_s: float = ATTACH_HEALTH_TIMEOUT_S) -> None:
    """``GET /health`` once, so that a wrong ``rollout.sglang_url`` fails before training starts."""
    try:
        resp = engine._http.get("/health", timeout=timeout_s)
        why = None if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:200]}"
    except Exception as exc:  # connection refused, DNS, timeout: all mean the same to the user
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        engine.shutdown()
        raise ConfigError([f"rollout.sglang_url: {url} does not answer GET /health ({why}); start the server "
                           "there, fix the URL, or clear it to let the loop launch one"])


def release_rollout_engine(engine: Any) -> None:
    """Stop what :func:`build_rollout_engine` started for ``rollout.engine: sglang`` (a launched
    server; an attached one is left running) and drop the SIGTERM handler; idempotent. The
    embedded engine is left as it is (tests and callers read it after a run)."""
    if engine is None or getattr(engine, "kind", None) != "sglang":
        return
    engine.shutdown()
    handler = getattr(engine, "_ferrule_sigterm", None)
    if handler is not None and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is handler[0]:
            signal.signal(signal.SIGTERM, handler[1] if handler[1] is not None else signal.SIG_DFL)
        engine._ferrule_sigterm = None
