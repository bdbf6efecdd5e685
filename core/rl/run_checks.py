"""Checks of a ``ferrule train`` config that need no model: run by :class:`ferrule.rl.loop.GRPOTrainer`
before anything is loaded, so these errors come in a second rather than after model loading.

- :func:`check_supported`: settings the loop does not implement (yet);
- :func:`preflight`: the run folder, the model folder's files (:func:`model_folder_problems`), the
  model family, the chat template;
- :func:`lora_settings`: the ``lora`` section as :class:`ferrule.lora.LoraSettings` (or None);
- :func:`lock_run_dir`: one trainer per run folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ferrule import envs
from ferrule.rl.config_schema import RLConfig
from ferrule.rl.config_types import ConfigError
from ferrule.contract import registry
from ferrule.fs import locks
from ferrule.rl import distributed as rl_dist

__all__ = ["RUN_LOCK_FILE", "check_supported", "lock_run_dir", "lora_settings", "model_folder_problems", "preflight",
           "unlock_run_dir"]

#: JSON files of an HF model folder that transformers reads when present
MODEL_JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "added_tokens.json")

#: the lock file of a run folder, held by its one trainer (:mod:`ferrule.fs.locks`)
RUN_LOCK_FILE = ".ferrule.lock"


def lora_settings(cfg: RLConfig) -> Any:
    """The ``lora`` section as :class:`ferrule.lora.LoraSettings` (``init_seed = train.seed``), or None
    when ``lora.rank == 0`` (full-parameter training).

    Raises:
        ConfigError: LoRA requested but :mod:`ferrule.lora` (the LoRA train side) is not installed, or
            the settings are refused by ``LoraSettings`` (the message names the key).
    """
    lo = cfg.lora
    if lo.rank == 0:
        return None
    try:
        from ferrule.lora import LoraSettings
    except ImportError:
        raise ConfigError([f"lora.rank: {lo.rank} asks for LoRA training, but this ferrule has no ferrule.lora "
                           "(the LoRA train engine); update ferrule or set lora.rank=0"]) from None
    targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    try:
        return LoraSettings(rank=lo.rank, alpha=float(lo.alpha), dropout=float(lo.dropout), target_modules=targets,
                            target_parameters=tuple(lo.target_parameters),
                            use_rslora=lo.use_rslora, init_seed=cfg.train.seed)
    except ValueError as exc:
        raise ConfigError([f"lora: {exc}"]) from None


def preflight(cfg: RLConfig) -> None:
    """The checks that need no model, run before any is loaded (seconds earlier than setup).

    Raises:
        ConfigError: every problem at once: a fresh run into a run folder that already holds
            metrics (the message names ``--resume``), an unknown ``model.family``, a checkpoint
            whose ``model_type`` no plugin supports, an unknown ``data.chat_template``.
    """
    from ferrule.rl.metrics import METRICS_FILE, read_metrics

    problems = []
    run_dir = Path(cfg.logging.run_dir)
    hf_config, damaged = model_folder_problems(cfg.model.hf_dir)
    if damaged:  # nothing below can be checked on a damaged folder
        raise ConfigError(damaged)
    if not cfg.checkpoint.resume:
        done = read_metrics(run_dir / METRICS_FILE)
        if done:
            problems.append(f"logging.run_dir: {run_dir} already holds a run ({len(done)} logged steps, last "
                            f"step {done[-1].get('step')}); continue it with --resume (`ferrule train --resume "
                            f"--run-dir {run_dir}`), or start a new run with another --run-dir")
    if cfg.model.family:
        try:
            registry.get_family(cfg.model.family)
        except registry.UnknownModelError as exc:
            problems.append(f"model.family: {exc.args[0] if exc.args else exc}")
    else:
        try:
            registry.family_for_hf_config(hf_config)
        except registry.UnknownModelError as exc:
            problems.append(f"model.hf_dir: {exc.args[0] if exc.args else exc}")
    if cfg.data.chat_template:
        try:
            registry.get_chat_template(cfg.data.chat_template)
        except registry.UnknownModelError as exc:
            problems.append(f"data.chat_template: {exc.args[0] if exc.args else exc}")
    problems += size_problems(cfg, hf_config)
    if problems:
        raise ConfigError(problems)


def model_folder_problems(hf_dir: str | Path) -> tuple[dict, list[str]]:
    """The files of an HF model folder that cannot be used, found before any model loads:
    ``(config.json as a dict, problems)``, one problem per file, each naming it and the fix.

    - a JSON file transformers reads (:data:`MODEL_JSON_FILES`) that is not valid JSON (truncated
      by a killed download, hand-edited) or not an object;
    - ``tokenizer.json`` that the ``tokenizers`` library cannot load;
    - a tokenizer whose ids (added tokens included) reach ``vocab_size`` of ``config.json`` (its
      ``text_config`` for a multimodal model): the first rollout would index past the embedding
      table; the tokenizer belongs to another model.

    A folder without ``config.json`` is ``RLConfig.check_paths``'s to report (here: ``({}, [])``).
    """
    folder = Path(hf_dir)
    problems, parsed = [], {}
    for name in MODEL_JSON_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            problems.append(f"model.hf_dir: {path} is not valid JSON{where} ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:80]}): it is truncated or was edited; copy it again "
                            "from the model's source")
            continue
        if not isinstance(value, dict):
            problems.append(f"model.hf_dir: {path} holds a JSON {type(value).__name__}, not an object; copy it again "
                            "from the model's source")
            continue
        parsed[name] = value
    config = parsed.get("config.json", {})
    if "tokenizer.json" in parsed:
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        try:
            n_ids = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        except Exception as exc:  # noqa: BLE001 - any failure to load is a damaged file to the user
            problems.append(f"model.hf_dir: {path} cannot be loaded by the tokenizers library ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:100]}); copy it again from the model's source")
        else:
            text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
            vocab = text.get("vocab_size", config.get("vocab_size"))
            if isinstance(vocab, int) and n_ids > vocab:
                problems.append(f"model.hf_dir: {path} has token ids up to {n_ids - 1} but {folder / 'config.json'} "
                                f"has vocab_size {vocab} (ids 0..{vocab - 1}): the tokenizer belongs to another model; "
                                "put the model's own tokenizer files in the folder")
    return config, problems


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _physical_memory_bytes() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def size_problems(cfg: RLConfig, hf_config: dict, *, memory_bytes: int | None = None) -> list[str]:
    """Sizes this model cannot run, found from ``config.json`` alone (before any model loads).

    The embedded rollout engine decodes a replica's ``ceil(prompts_per_step / replicas) *
    n_samples_per_prompt`` rows at once in a static KV cache of ``rows * longest * layers * 2 *
    num_key_value_heads * head_dim`` values of ``model.dtype`` (:mod:`ferrule.rollout._static_cache`;
    ``longest = data.max_prompt_tokens + max(rollout.max_new_tokens, eval.max_new_tokens)``). More
    bytes than the machine's physical memory (``memory_bytes``, default ``SC_PHYS_PAGES *
    SC_PAGE_SIZE``) cannot run: too many samples per prompt, or too many tokens. (A sequence
    longer than ``max_position_embeddings`` is not refused: the limits are caps, real prompts are
    shorter, and RoPE models run past it.) With ``rollout.engine: sglang`` a prompt + new tokens
    reaching the server's context length is refused (:func:`sglang_context_length`): SGLang rejects
    such requests.

    Returns:
        One message per problem (naming the keys and the limit), or ``[]``.
    """
    text = hf_config.get("text_config") or hf_config
    ro, d, e, t = cfg.rollout, cfg.data, cfg.eval, cfg.train
    longest = d.max_prompt_tokens + max(ro.max_new_tokens, e.max_new_tokens)
    p: list[str] = []
    try:
        heads = int(text["num_attention_heads"])
        layers, kv = int(text["num_hidden_layers"]), int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return p  # a config this estimate does not understand: the model build will say more
    replicas = max(1, rl_dist.launch_world_size() // (cfg.parallel.tp * cfg.parallel.pp))
    rows = -(-t.prompts_per_step // replicas) * ro.n_samples_per_prompt
    need = rows * longest * layers * 2 * kv * head_dim * _DTYPE_BYTES.get(cfg.model.dtype, 4)
    have = memory_bytes if memory_bytes is not None else _physical_memory_bytes()
    if ro.engine == "embedded" and have and need > have:
        p.append(f"rollout.n_samples_per_prompt, max_new_tokens: {rows} rows ({t.prompts_per_step} prompts x "
                 f"{ro.n_samples_per_prompt} samples per replica) of up to {longest} tokens (data.max_prompt_tokens "
                 f"+ max_new_tokens) need {need / 2**30:.1f} GiB of KV cache alone, more than this machine's "
                 f"{have / 2**30:.1f} GiB; lower rollout.n_samples_per_prompt, train.prompts_per_step, "
                 "rollout.max_new_tokens or data.max_prompt_tokens")
    p += _sglang_context_problems(cfg, text, longest)
    return p


#: config keys SGLang reads, in its order, for a server's context length (``get_context_length`` in
#: sglang/srt/utils/hf_transformers_utils.py)
SGLANG_CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def sglang_context_length(text_config: dict) -> int | None:
    """The context length an SGLang server launched on this model uses without ``--context-length``:
    the first of :data:`SGLANG_CONTEXT_KEYS` in the (text) config, times ``rope_scaling.factor`` unless
    the scaling names ``original_max_position_embeddings`` or is ``llama3`` (SGLang's rule); None
    when the config has none of the keys."""
    scaling = text_config.get("rope_scaling") or {}
    factor = scaling.get("factor", 1) or 1
    if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
        factor = 1
    for key in SGLANG_CONTEXT_KEYS:
        if text_config.get(key) is not None:
            return int(factor * int(text_config[key]))
    return None


def _sglang_context_problems(cfg: RLConfig, text_config: dict, longest: int) -> list[str]:
    """An SGLang server refuses every request whose prompt + ``max_new_tokens`` reaches its context
    length ("Requested token count exceeds the model's maximum context length", sglang's
    ``TokenizerManager._validate_one_request``), which stops the run at the first long prompt. Checked
    for a server the loop launches (not ``rollout.sglang_url``: its length is the server's)."""
    ro = cfg.rollout
    if ro.engine != "sglang" or ro.sglang_url:
        return []
    given = ro.sglang_args.get("context_length") or ro.sglang_args.get("context-length")
    context = int(given) if given else sglang_context_length(text_config)
    if context is None or longest < context:
        return []
    where = "rollout.sglang_args.context_length" if given else "the model's max_position_embeddings"
    return [f"data.max_prompt_tokens, rollout.max_new_tokens: a prompt of up to {cfg.data.max_prompt_tokens} tokens "
            f"+ {longest - cfg.data.max_prompt_tokens} new tokens reaches the SGLang server's context length "
            f"{context} ({where}), which refuses such a request and stops the run; lower data.max_prompt_tokens "
            f"or max_new_tokens so that their sum is below {context}, or raise rollout.sglang_args.context_length"]


def check_supported(cfg: RLConfig) -> None:
    """Raise :class:`ConfigError` for settings the loop does not implement (yet)."""
    p = []
    a = cfg.algorithm
    if a.kl_coef > 0 and a.kl_estimator != "k3":
        p.append(f"algorithm.kl_estimator: {a.kl_estimator!r} is not implemented as a loss term "
                 "(ferrule.losses uses k3); set algorithm.kl_estimator=k3")
    if cfg.lora.rank > 0:
        try:
            lora_settings(cfg)
        except ConfigError as exc:
            p.extend(exc.problems)
    # parallel.*: checked against the world size and the model by ferrule.rl.distributed.check_layout
    if p:
        raise ConfigError(p)


def lock_run_dir(cfg: RLConfig) -> Path | None:
    """Make this process the one trainer of ``logging.run_dir`` (global rank 0 takes the lock;
    other ranks return None). The kernel releases it when the process ends, ``kill -9`` included.

    Returns:
        The lock file (``RUN_DIR/.ferrule.lock``) to pass to :func:`unlock_run_dir`, or None.

    Raises:
        ConfigError: another live process holds the folder (its pid, host, start time and command
            are named).
    """
    import os

    if envs.rank() != 0:
        return None
    run_dir = Path(cfg.logging.run_dir)
    path = run_dir / RUN_LOCK_FILE
    try:
        locks.acquire(path, f"logging.run_dir: {run_dir}")
    except locks.LockedError as exc:
        raise ConfigError([f"{exc} (a second trainer would log every step twice); or choose another "
                           "--run-dir"]) from None
    return path


def unlock_run_dir(path: Path | None) -> None:
    """Release :func:`lock_run_dir`'s lock (None: nothing to do); a run folder left empty (an error
    before the run wrote anything) is removed."""
    if path is not None:
        from ferrule.fs import locks

        locks.release(path, remove=True)
        try:
            path.parent.rmdir()  # only when empty
        except OSError:
            pass
