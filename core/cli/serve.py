"""``ferrule serve --base-model DIR [--base-model DIR2 ...]``: run the Tinker-compatible service (FastAPI + uvicorn).

Mounted by ``ferrule.cli`` as ``app.command("serve")(serve_command)``. User errors (a bad
base-model directory, a missing or malformed key file, no keys at all) print one line and exit
with code 2.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from ferrule.lora.settings import MAX_LORA_RANK


NO_KEYS = ("no API keys: give --api-keys FILE or set FERRULE_SERVE_API_KEYS=tml-... (the service never runs "
           "without authentication).")
#: libraries whose INFO lines are not the service's (megatron's DDP lists every parameter of each new
#: client's model, ~240 lines for SmolLM2): WARNING and above only
QUIET_LOGGERS = ("megatron", "torch", "transformers", "urllib3", "httpx")


def configure_logging() -> None:
    """``ferrule.serve``'s operation lines at INFO; other libraries at WARNING (:data:`QUIET_LOGGERS`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per base / client model load, between the log lines


def _ready_server(app, host: str, port: int, line: str):
    """A uvicorn server that prints ``line`` once it listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(line, flush=True)

    return Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))


#: ``--api-keys`` help; ``\\[`` keeps rich (the CLI's markup mode) from taking ``[tenant]`` for a style tag
API_KEYS_HELP = ("File of API keys, one per line: 'tml-KEY \\[TENANT]' (KEY: at least 4 more characters; TENANT, "
                 "optional and separated by whitespace, names the tenant the key acts for: keys with one TENANT share "
                 "its sessions, models and checkpoints, a key without one is a tenant of its own); '#' starts a "
                 "comment, blank lines are skipped. Keys can also come from the environment variable "
                 "FERRULE_SERVE_API_KEYS, a comma-separated list of 'tml-KEY\\[=TENANT]' items (added to the file's). "
                 "The server refuses to start without a key.")


def served_bases(base_model: Path | list[Path] | None, model_name: str | list[str] | None = None,
                 models_file: Path | None = None) -> list[tuple[str | None, Path]]:
    """``(name or None, directory)`` per served base: the ``--base-model`` options in order (the
    i-th ``--model-name`` names the i-th), then the models file's lines.

    Raises:
        ValueError: more ``--model-name`` than ``--base-model``, or no base at all.
    """
    from ferrule.serve.registry import parse_models_file

    dirs = [] if base_model is None else [base_model] if isinstance(base_model, (str, Path)) else list(base_model)
    names = [] if model_name is None else [model_name] if isinstance(model_name, str) else list(model_name)
    if len(names) > len(dirs):
        raise ValueError(f"{len(names)} --model-name for {len(dirs)} --base-model; give one --model-name per "
                         "--base-model at most (in the same order).")
    out = [(names[i] if i < len(names) else None, Path(d)) for i, d in enumerate(dirs)]
    out += parse_models_file(models_file) if models_file is not None else []
    if not out:
        raise ValueError("no base model: give --base-model DIR (repeatable) or --models-file FILE.")
    return out


#: the config sections ``ferrule serve --engine-setting`` may set
SERVE_SETTING_SECTIONS = ("train_engine", "rollout_engine")


def parse_engine_settings(items: list[str]) -> dict[str, Any]:
    """``--engine-setting section.key=value`` items -> ``{section: settings object}`` of
    :data:`SERVE_SETTING_SECTIONS` (typed and checked as the ``ferrule train`` config checks them).

    Raises:
        ValueError: every bad item at once, each naming the key and what it expects.
    """
    from ferrule.rl.config_types import ConfigError
    from ferrule.rl.config import config_from_dict

    wrong = [i for i in items if i.split(".", 1)[0] not in SERVE_SETTING_SECTIONS]
    if wrong:
        raise ValueError(f"--engine-setting {wrong[0]!r}: expected SECTION.KEY=VALUE with SECTION one of "
                         f"{', '.join(SERVE_SETTING_SECTIONS)} (e.g. rollout_engine.kv_bucket=128).")
    try:
        cfg = config_from_dict({}, items, origin="--engine-setting", validate=False)
    except ConfigError as exc:
        raise ValueError("--engine-setting: " + "; ".join(exc.problems)) from None
    return {s: getattr(cfg, s) for s in SERVE_SETTING_SECTIONS}


def build_app(base_model: Path | list[Path] | None, storage: Path, api_keys: Path | None = None,
              model_name: str | list[str] | None = None, long_poll_s: float = 30.0, fwdbwd_max_chunk_len: int = 1024,
              limits=None, max_snapshots: int | None = None, models_file: Path | None = None,
              max_loaded_bases: int | None = None, sampler_dtype: str | None = "auto",
              max_loaded_bytes: int | None = None,
              worker_threads: int | None = None, event_loop_threads: int | None = None,
              sampler_checkpoints: str = "auto", engine_settings: list[str] | None = None):
    """The FastAPI app ``ferrule serve`` runs (tests start it with uvicorn in a thread); bases
    as :func:`served_bases` lists them, at most ``max_loaded_bases`` (holding at most ``max_loaded_bytes``)
    loaded at once (:class:`~ferrule.serve.registry.BaseRegistry`), each sampling on the training device in
    ``sampler_dtype``; the worker uses ``worker_threads`` torch threads, the event loop's thread
    ``event_loop_threads`` (None: unchanged; :mod:`ferrule.serve.placement`). ``engine_settings``:
    ``section.key=value`` items of the ``train_engine`` / ``rollout_engine`` sections of a ``ferrule train``
    config (:func:`parse_engine_settings`).

    Raises:
        FileNotFoundError: a base directory, the models file or ``api_keys`` does not exist.
        ValueError: no API keys, a key without the ``tml-`` prefix, no base, two bases of one name,
            an unknown ``sampler_dtype``, ``worker_threads < 1``, a bad ``--engine-setting``.
    """
    from ferrule.serve.app import create_app
    from ferrule.serve.backend import MAX_SNAPSHOTS
    from ferrule.serve.paths import load_api_keys
    from ferrule.serve.registry import DEFAULT_MAX_LOADED, BaseRegistry

    from ferrule.serve.placement import sampler_placement

    keys = load_api_keys(api_keys)
    if not keys:  # before the model loads (minutes for a real one)
        raise ValueError(NO_KEYS)
    sampler_placement(sampler_dtype)  # a bad --sampler-dtype before any model loads
    from ferrule.serve.backend import SAMPLER_CHECKPOINTS

    if sampler_checkpoints not in SAMPLER_CHECKPOINTS:
        raise ValueError(f"--sampler-checkpoints {sampler_checkpoints!r}: use auto, adapter or merged.")
    if worker_threads is not None and worker_threads < 1:
        raise ValueError(f"--worker-threads {worker_threads}: expected an int >= 1.")
    settings = parse_engine_settings(engine_settings or [])
    bases = served_bases(base_model, model_name, models_file)
    backend = BaseRegistry(bases, max_loaded=DEFAULT_MAX_LOADED if max_loaded_bases is None else max_loaded_bases,
                           max_loaded_bytes=max_loaded_bytes,
                           max_snapshots=max_snapshots or MAX_SNAPSHOTS, sampler_dtype=sampler_dtype,
                           sampler_checkpoints=sampler_checkpoints, engine_settings=settings)
    return create_app(backend, storage, keys, long_poll_s=long_poll_s, fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
                      limits=limits, worker_threads=worker_threads, event_loop_threads=event_loop_threads)


def serve_command(
    base_model: Annotated[list[Path] | None, typer.Option(
        "--base-model", help="HF checkpoint dir (config.json + safetensors) or a ferrule torch_dist checkpoint to "
        "train and sample; repeat it to serve several bases (the first loads at start, the others on first use).")]
    = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    storage: Annotated[Path, typer.Option(help="Root for the database and every checkpoint.")] = Path("ferrule-serve"),
    api_keys: Annotated[Path | None, typer.Option("--api-keys", help=API_KEYS_HELP)] = None,
    model_name: Annotated[list[str] | None, typer.Option(help="Name clients pass as base_model (default: the "
                                                         "directory name); the i-th names the i-th --base-model.")]
    = None,
    models_file: Annotated[Path | None, typer.Option(help="File of more bases, one 'DIR [NAME]' per line ('#' "
                                                    "comments; relative DIRs from the file's folder).")] = None,
    max_loaded_bases: Annotated[int, typer.Option(help="Most bases holding weights at once; one more unloads the "
                                                  "least recently used base without live training clients.")] = 2,
    max_loaded_bytes: Annotated[str | None, typer.Option(help="Most bytes the loaded bases may hold together (e.g. "
                                                         "40GiB: sampler weights, training clients, snapshots); "
                                                         "loading one more unloads least recently used idle bases, or "
                                                         "is refused naming this option. Default: no limit.")]
    = None,
    fwdbwd_max_chunk_len: Annotated[int, typer.Option(help="Data per forward_backward request the SDK may send "
                                                      "(it chunks larger batches).")] = 1024,
    max_samples_per_request: Annotated[int, typer.Option(help="Most num_samples of one sample request (400 "
                                                         "above).")] = 256,
    max_tokens_per_request: Annotated[int, typer.Option(help="Most tokens one request may process: num_samples x "
                                                        "(prompt + max_tokens) for sample, the data's tokens for "
                                                        "forward_backward (400 above).")] = 1 << 20,
    max_lora_rank: Annotated[int, typer.Option(help="Largest LoRA rank of a training client (400 above).")] = MAX_LORA_RANK,
    max_queued_per_tenant: Annotated[int, typer.Option(help="Requests one tenant may have queued or running (429 "
                                                       "above; the SDK retries).")] = 512,
    max_image_bytes: Annotated[int, typer.Option(help="Most encoded bytes of one image chunk (400 above).")] = 32 << 20,
    max_image_pixels: Annotated[int, typer.Option(help="Most width x height of one image chunk, read from its header "
                                                  "before decoding (400 above).")] = 2048 * 2048,
    max_audio_frames: Annotated[int, typer.Option(help="Most dMel frames (20 per second) of one audio chunk (400 "
                                                  "above).")] = 36_000,
    max_memory: Annotated[str | None, typer.Option(help="Memory budget of the whole service (e.g. 24GiB, 512MiB): "
                                                   "a request whose estimated need does not fit in what loaded "
                                                   "weights, training clients and snapshots leave is refused with a "
                                                   "400 (docs/serve.md). Default: no budget.")] = None,
    max_snapshots: Annotated[int, typer.Option(help="Unnamed sampler snapshots (made by save weights and "
                                               "get sampling client) kept in memory per tenant.")] = 4,
    sampler_dtype: Annotated[str, typer.Option(help="dtype of every base's sampler, which runs on the training "
                                               "device (the GPU on a CUDA machine): auto (bfloat16 on CUDA, float32 "
                                               "on CPU), bfloat16, float16 or float32.")] = "auto",
    sampler_checkpoints: Annotated[str, typer.Option(help="What a LoRA client's sampler weights (checkpoints and "
                                                     "snapshots) are: auto (its PEFT adapter, served unmerged on the "
                                                     "base, batched with other tenants'; merged only for an adapter "
                                                     "of routed-expert or stacked parameters, logged with why), "
                                                     "adapter (always the adapter: a client whose adapter adapts "
                                                     "routed-expert or stacked parameters is refused with a 400 "
                                                     "naming auto and merged) or merged (the full model, HF "
                                                     "safetensors, a full copy per snapshot).")] = "auto",
    worker_threads: Annotated[int | None, typer.Option(help="torch CPU threads of the worker that runs every "
                                                       "operation (default: the CPUs this process may use minus one, "
                                                       "at least 1; the event loop's thread uses 1).")] = None,
    engine_setting: Annotated[list[str] | None, typer.Option(
        "--engine-setting", help="SECTION.KEY=VALUE of the train_engine or rollout_engine settings (the keys of "
                                 "docs/train.md's config reference; for example rollout_engine.kv_bucket = 128, "
                                 "written without spaces); repeatable.")] = None,
) -> None:
    """Serve the Tinker HTTP API: point tinker.ServiceClient(base_url=http://HOST:PORT) at it."""
    import time

    from ferrule.user_errors import print_user_error

    configure_logging()
    t0 = time.monotonic()
    try:
        from ferrule.serve.limits import ServeLimits

        from ferrule.serve.memory import parse_bytes

        limits = ServeLimits(max_samples_per_request, max_tokens_per_request, max_lora_rank, max_queued_per_tenant,
                             max_image_bytes, max_image_pixels, max_audio_frames,
                             None if max_memory is None else parse_bytes(max_memory))
        if max_snapshots < 1:
            raise ValueError(f"--max-snapshots {max_snapshots}: keep at least 1 snapshot per tenant.")
        from ferrule.serve.placement import default_worker_threads

        app = build_app(base_model, storage, api_keys, model_name, fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
                        limits=limits, max_snapshots=max_snapshots, models_file=models_file,
                        max_loaded_bases=max_loaded_bases, sampler_dtype=sampler_dtype,
                        max_loaded_bytes=None if max_loaded_bytes is None
                        else parse_bytes(max_loaded_bytes, "--max-loaded-bytes"),
                        worker_threads=default_worker_threads() if worker_threads is None else worker_threads,
                        event_loop_threads=1, sampler_checkpoints=sampler_checkpoints,
                        engine_settings=engine_setting)
    except (FileNotFoundError, ValueError) as exc:
        print_user_error(str(exc))
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # Ctrl-C while the first base loads: the server never listened
        print(f"ferrule serve: stopped while loading the base model, before it was ready "
              f"({time.monotonic() - t0:.0f} s); nothing was served.", flush=True)
        raise typer.Exit(130) from None
    from ferrule.serve.backend import SAMPLER_CHECKPOINTS

    bases = app.state.bases
    waiting = [n for n in bases.names if n not in bases.loaded()]
    later = f"; {', '.join(waiting)} load on first use" if waiting else ""
    server = _ready_server(app, host, port, f"ferrule serve: ready on http://{host}:{port} (base models "
                                            f"{', '.join(bases.names)}; {', '.join(bases.loaded())} loaded in "
                                            f"{time.monotonic() - t0:.0f} s{later}; sampler checkpoints "
                                            f"{sampler_checkpoints}: {SAMPLER_CHECKPOINTS[sampler_checkpoints]}); "
                                            "Ctrl-C stops it")
    # uvicorn handles SIGINT / SIGTERM (graceful shutdown), then raises the signal again with the handler it
    # found: SIGINT's is Python's KeyboardInterrupt, SIGTERM's (default) would end the process before the line
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) \
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else None
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(stopped_line(app, storage), flush=True)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stopped_line(app, storage: Path) -> str:
    """The line ``ferrule serve`` prints when it stops: what stays in ``storage`` (the database, the saved
    checkpoints ``checkpoints/<model_id>/<kind>/<name>``) and how many training clients' state was in memory only."""
    from ferrule.serve.store import DB_FILE

    root = Path(storage).absolute()
    saved = sum(1 for d in (root / "checkpoints").glob("*/*/*") if d.is_dir())
    bases = app.state.bases
    live = sum(len(bases.get(name).engines) for name in bases.names)
    lost = (f"; {live} training client(s) held their state in memory only (gone; resume from a saved state with "
            f"create_training_client_from_state_with_optimizer)" if live else "")
    return f"ferrule serve: stopped; {root} keeps {DB_FILE} and {saved} saved checkpoint(s){lost}."
