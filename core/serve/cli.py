"""``ferrule serve --base-model DIR``: run the Tinker-compatible service (FastAPI + uvicorn).

Mounted by ``ferrule.cli`` as ``app.command("serve")(serve_command)``. User errors (a bad
base-model directory, a missing or malformed key file, no keys at all) print one line and exit
with code 2.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer


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
                 "comment, blank lines are skipped. Keys can also come from $FERRULE_SERVE_API_KEYS="
                 "'tml-KEY\\[=TENANT],tml-KEY2\\[=TENANT2],...' (added to the file's). The server refuses to start "
                 "without a key.")


def build_app(base_model: Path, storage: Path, api_keys: Path | None = None, model_name: str | None = None,
              long_poll_s: float = 30.0, fwdbwd_max_chunk_len: int = 1024, limits=None,
              max_snapshots: int | None = None):
    """The FastAPI app ``ferrule serve`` runs (tests start it with uvicorn in a thread).

    Raises:
        FileNotFoundError: ``base_model`` or ``api_keys`` does not exist.
        ValueError: no API keys, or a key without the ``tml-`` prefix.
    """
    from .app import create_app
    from .backend import MAX_SNAPSHOTS, EngineBackend
    from .paths import load_api_keys

    keys = load_api_keys(api_keys)
    if not keys:  # before the model loads (minutes for a real one)
        raise ValueError(NO_KEYS)
    backend = EngineBackend(base_model, model_name=model_name, max_snapshots=max_snapshots or MAX_SNAPSHOTS)
    return create_app(backend, storage, keys, long_poll_s=long_poll_s, fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
                      limits=limits)


def serve_command(
    base_model: Annotated[Path, typer.Option("--base-model", help="HF checkpoint dir (config.json + safetensors) or "
                                             "a ferrule torch_dist checkpoint to train and sample.")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    storage: Annotated[Path, typer.Option(help="Root for the database and every checkpoint.")] = Path("ferrule-serve"),
    api_keys: Annotated[Path | None, typer.Option("--api-keys", help=API_KEYS_HELP)] = None,
    model_name: Annotated[str | None, typer.Option(help="Name clients pass as base_model (default: the directory "
                                                   "name).")] = None,
    fwdbwd_max_chunk_len: Annotated[int, typer.Option(help="Data per forward_backward request the SDK may send "
                                                      "(it chunks larger batches).")] = 1024,
    max_samples_per_request: Annotated[int, typer.Option(help="Most num_samples of one sample request (400 "
                                                         "above).")] = 256,
    max_tokens_per_request: Annotated[int, typer.Option(help="Most tokens one request may process: num_samples x "
                                                        "(prompt + max_tokens) for sample, the data's tokens for "
                                                        "forward_backward (400 above).")] = 1 << 20,
    max_lora_rank: Annotated[int, typer.Option(help="Largest LoRA rank of a training client (400 above).")] = 128,
    max_queued_per_tenant: Annotated[int, typer.Option(help="Requests one tenant may have queued or running (429 "
                                                       "above; the SDK retries).")] = 512,
    max_image_bytes: Annotated[int, typer.Option(help="Most encoded bytes of one image chunk (400 above).")] = 32 << 20,
    max_image_pixels: Annotated[int, typer.Option(help="Most width x height of one image chunk, read from its header "
                                                  "before decoding (400 above).")] = 2048 * 2048,
    max_audio_frames: Annotated[int, typer.Option(help="Most dMel frames (20 per second) of one audio chunk (400 "
                                                  "above).")] = 36_000,
    max_snapshots: Annotated[int, typer.Option(help="Unnamed sampler snapshots (save_weights_and_get_sampling_"
                                               "client) kept in memory per tenant.")] = 4,
) -> None:
    """Serve the Tinker HTTP API: point tinker.ServiceClient(base_url=http://HOST:PORT) at it."""
    import time

    from ferrule.cli_errors import print_user_error

    configure_logging()
    t0 = time.monotonic()
    try:
        from .limits import ServeLimits

        limits = ServeLimits(max_samples_per_request, max_tokens_per_request, max_lora_rank, max_queued_per_tenant,
                             max_image_bytes, max_image_pixels, max_audio_frames)
        if max_snapshots < 1:
            raise ValueError(f"--max-snapshots {max_snapshots}: keep at least 1 snapshot per tenant.")
        app = build_app(base_model, storage, api_keys, model_name, fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
                        limits=limits, max_snapshots=max_snapshots)
    except (FileNotFoundError, ValueError) as exc:
        print_user_error(str(exc))
        raise typer.Exit(2) from None
    _ready_server(app, host, port, f"ferrule serve: ready on http://{host}:{port} (base model {base_model}, "
                                   f"loaded in {time.monotonic() - t0:.0f} s); Ctrl-C stops it").run()
