"""Prompt sources for RL: reasoning-gym tasks and JSONL files; answer extraction; data order.

**Sources.** Both return :class:`Prompt` objects by index and score an extracted answer with
the task's own verifier (:meth:`PromptSource.score`, a float, usually in [0, 1]).

- :class:`ReasoningGymSource`: ``reasoning_gym.create_dataset(name, size=N, seed=S, **kwargs)``
  (procedural, offline, deterministic by seed); the verifier is the dataset's ``score_answer``.
- :class:`JsonlSource`: one JSON object per line (blank lines ignored) with the fields

  ============ ======== =====================================================================
  field        required meaning
  ============ ======== =====================================================================
  ``prompt``   one of   the user question (str); the system prompt and template are applied
  ``messages`` one of   a full chat ``[{"role": "system"|"user"|"assistant", "content": str}]``
                        used as is (system prompt and template are *not* applied); a content
                        may also be a list of parts ``{"type": "text", "text": str}``,
                        ``{"type": "image", "image": PATH}`` or ``{"type": "audio", "audio":
                        PATH}`` (paths relative to the file; media for a family with towers,
                        :mod:`ferrule.media`)
  ``answer``   yes*     reference answer (str, or a number which is converted with ``str``);
                        *optional only if ``require_answer=False`` (custom reward functions)
  ``id``       no       identifier (str or int) kept in :attr:`Prompt.id`
  ``metadata`` no       object; if ``metadata.source_dataset`` names a reasoning-gym dataset,
                        that dataset's ``score_answer`` is the verifier, else exact match
  ============ ======== =====================================================================

  Any other field, a missing field or a wrong type is a :class:`PromptFileError` naming the
  file and the 1-based line number.

**Answer extraction** (:func:`extract_answer`). reasoning-gym's system prompts
(``reasoning_gym.utils.SYSTEM_PROMPTS``) ask the model to put the final answer between
``<answer>`` and ``</answer>``; the default ``"answer_tag"`` mode takes the *last* such block
(whitespace stripped), like ``reasoning_gym.utils.extract_answer``. ``"last_number"`` takes the
last number in the text (optional minus sign, thousands commas removed, optional decimals;
for arithmetic tasks with small models that do not follow the tag format, e.g. SmolLM2-135M
answers "4 - 1 = 3"); ``"last_line"`` the last non-empty line; ``"full"`` the whole stripped
response.

**Data order** (:class:`PromptSampler`). Epoch ``k`` visits every index once, in a permutation
drawn by ``random.Random`` seeded from ``sha256("ferrule-data:{seed}:{k}")`` (stable across
Python versions and platforms). Batches run across epoch boundaries. ``state_dict()`` /
``load_state_dict()`` resume exactly.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
EXTRACTION_MODES = ("answer_tag", "last_number", "last_line", "full")


class PromptFileError(ValueError):
    """A malformed JSONL prompt file; the message names the file and line."""


@dataclass(frozen=True)
class Prompt:
    """One RL prompt.

    Attributes:
        index: position in its source (0-based); the sampler's unit.
        messages: chat messages to render with the chat template
            (``[{"role": ..., "content": ...}]``; system prompt included when configured).
        answer: reference answer, or None (JSONL without answers).
        entry: the raw record the verifier needs (a reasoning-gym entry dict, or the JSONL object).
        id: a stable identifier (``"task:index"`` or the JSONL ``id``).
        question: the user question before templating ("" for ``messages`` records).
        media_dir: folder that relative media paths in ``messages`` are relative to.
    """

    index: int
    messages: tuple[dict[str, str], ...]
    answer: str | None
    entry: dict[str, Any] = field(repr=False)
    id: str = ""
    question: str = ""
    media_dir: str = ""


class PromptSource(Protocol):
    """A finite, indexable prompt set with a verifier."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...

    def score(self, answer: str | None, prompt: Prompt) -> float:
        """Verifier score of an extracted answer (None: nothing extracted)."""
        ...


def extract_answer(response: str, mode: str = "answer_tag") -> str | None:
    """Extract the final answer from a response text.

    Args:
        response: decoded response (special tokens removed).
        mode: ``"answer_tag"`` (last ``<answer>...</answer>``, stripped), ``"last_number"`` (last
            number, e.g. ``"-1,234.5"`` -> ``"-1234.5"``), ``"last_line"`` (last
            non-empty line, stripped) or ``"full"`` (whole response, stripped).

    Returns:
        The answer string, or None when nothing could be extracted (no tag / empty response).

    Raises:
        ValueError: unknown ``mode``.
    """
    if mode == "answer_tag":
        matches = _ANSWER_RE.findall(response)
        return matches[-1].strip() if matches else None
    if mode == "last_number":
        numbers = _NUMBER_RE.findall(response)
        return numbers[-1].replace(",", "") if numbers else None
    if mode == "last_line":
        lines = [ln.strip() for ln in response.splitlines() if ln.strip()]
        return lines[-1] if lines else None
    if mode == "full":
        return response.strip() or None
    raise ValueError(f"unknown answer extraction mode {mode!r}; use one of {list(EXTRACTION_MODES)}")


def resolve_system_prompt(preset: str = "direct", text: str = "") -> str:
    """The system prompt: ``text`` if non-empty, else reasoning-gym's ``SYSTEM_PROMPTS[preset]``
    (``"none"`` -> "").

    Raises:
        KeyError: unknown preset (the message lists the valid names).
    """
    if text:
        return text
    if preset == "none":
        return ""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if preset not in SYSTEM_PROMPTS:
        raise KeyError(f"unknown system prompt preset {preset!r}; use one of {sorted(SYSTEM_PROMPTS)} or 'none'")
    return SYSTEM_PROMPTS[preset]


def build_messages(question: str, system_prompt: str = "", prompt_template: str = "{question}"
                   ) -> tuple[dict[str, str], ...]:
    """``[system?, user]`` messages for one question (``prompt_template.format(question=...)``)."""
    user = {"role": "user", "content": prompt_template.format(question=question)}
    return (({"role": "system", "content": system_prompt}, user) if system_prompt else (user,))


def exact_match(answer: str | None, reference: str | None) -> float:
    """1.0 if the answers match after whitespace normalization, or as numbers; else 0.0.

    Numbers compare with ``float`` equality after parsing (``"4" == "4.0"``; commas removed).
    """
    if answer is None or reference is None:
        return 0.0
    a, r = " ".join(answer.split()), " ".join(str(reference).split())
    if a == r:
        return 1.0
    try:
        return 1.0 if float(a.replace(",", "")) == float(r.replace(",", "")) else 0.0
    except ValueError:
        return 0.0


class ReasoningGymSource:
    """reasoning-gym procedural dataset as a :class:`PromptSource`.

    Args:
        task: dataset name (``basic_arithmetic``, ``countdown``, ...).
        size: number of items; seed: generation seed; task_kwargs: dataset config fields.
        system_prompt, prompt_template: see :func:`build_messages`.

    Raises:
        ValueError: unknown task name (with the closest names) or bad task_kwargs.
    """

    def __init__(self, task: str, size: int, seed: int, task_kwargs: dict[str, Any] | None = None,
                 system_prompt: str = "", prompt_template: str = "{question}"):
        import reasoning_gym
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            import difflib

            near = difflib.get_close_matches(task, sorted(DATASETS), n=3)
            raise ValueError(f"unknown reasoning-gym task {task!r}; closest: {near}")
        try:
            self.dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_kwargs or {}))
        except (TypeError, AssertionError, ValueError) as exc:
            raise ValueError(f"reasoning-gym task {task!r} rejected task_kwargs={task_kwargs}: {exc}") from exc
        self.name, self.size, self.seed = task, size, seed
        self.system_prompt, self.prompt_template = system_prompt, prompt_template

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name}: index {index} out of range [0, {self.size})")
        entry = self.dataset[index]
        return Prompt(index=index, messages=build_messages(entry["question"], self.system_prompt,
                                                           self.prompt_template),
                      answer=str(entry["answer"]), entry=entry, id=f"{self.name}:{index}",
                      question=entry["question"])

    def score(self, answer: str | None, prompt: Prompt) -> float:
        return float(self.dataset.score_answer(answer, prompt.entry))


_JSONL_FIELDS = ("prompt", "messages", "answer", "id", "metadata")
_PART_FIELDS = {"text": ("text", str), "image": ("image", str), "audio": ("audio", str)}


def _valid_parts(content: Any) -> bool:
    """True for a non-empty list of ``{"type": t, t: str}`` parts with ``t`` in text / image / audio."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and p.get("type") in _PART_FIELDS and set(p) == {"type", p["type"]}
        and isinstance(p[p["type"]], str) for p in content)


def has_media(prompt: "Prompt") -> bool:
    """True if a message of ``prompt`` holds an image or audio part."""
    return any(isinstance(m["content"], list) and any(p["type"] != "text" for p in m["content"])
               for m in prompt.messages)
_ROLES = ("system", "user", "assistant")


class JsonlSource:
    """JSONL prompt file as a :class:`PromptSource` (format in the module docstring).

    The whole file is parsed and checked at construction.

    Raises:
        PromptFileError: missing file, bad JSON, missing/unknown fields or wrong types (with
            the line number), or an empty file.
    """

    def __init__(self, path: str | Path, system_prompt: str = "", prompt_template: str = "{question}",
                 require_answer: bool = True):
        self.path = Path(path)
        self.name = self.path.name
        if not self.path.is_file():
            raise PromptFileError(f"{self.path}: prompt file does not exist")
        self._prompts: list[Prompt] = []
        self._scorers: dict[str, Any] = {}
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    self._prompts.append(self._parse(line, lineno, system_prompt, prompt_template,
                                                     require_answer))
        if not self._prompts:
            raise PromptFileError(f"{self.path}: no prompts (the file is empty)")

    def _parse(self, line: str, lineno: int, system_prompt: str, template: str, require_answer: bool) -> Prompt:
        where = f"{self.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(_JSONL_FIELDS))
        if unknown:
            raise PromptFileError(f"{where}: unknown field(s) {unknown}; allowed: {list(_JSONL_FIELDS)} "
                                  "(put extra data under 'metadata')")
        if ("prompt" in obj) == ("messages" in obj):
            raise PromptFileError(f"{where}: give exactly one of 'prompt' (str) or 'messages' (list)")
        question = ""
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
            question = obj["prompt"]
            messages = build_messages(question, system_prompt, template)
        else:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in _ROLES
                    and (isinstance(m["content"], str) or _valid_parts(m["content"])) for m in msgs):
                raise PromptFileError(f"{where}: 'messages' must be a non-empty list of "
                                      f"{{'role': one of {list(_ROLES)}, 'content': str or a list of parts "
                                      f"{{'type': 'text', 'text': str}} / {{'type': 'image', 'image': path}} / "
                                      f"{{'type': 'audio', 'audio': path}}}}")
            if msgs[-1]["role"] != "user":
                raise PromptFileError(f"{where}: the last message must have role 'user'")
            messages = tuple(dict(m) for m in msgs)
        answer = obj.get("answer")
        if answer is None:
            if require_answer:
                raise PromptFileError(f"{where}: missing 'answer' (the reference answer the verifier needs)")
        elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise PromptFileError(f"{where}: 'answer' must be a string or a number, got {type(answer).__name__}")
        else:
            answer = str(answer)
        if "id" in obj and (isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int))):
            raise PromptFileError(f"{where}: 'id' must be a string or an integer")
        if "metadata" in obj and not isinstance(obj["metadata"], dict):
            raise PromptFileError(f"{where}: 'metadata' must be a JSON object")
        index = len(self._prompts)
        return Prompt(index=index, messages=messages, answer=answer, entry=obj,
                      id=str(obj.get("id", f"{self.name}:{lineno}")), question=question,
                      media_dir=str(self.path.parent.absolute()))

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self._prompts[index]

    def score(self, answer: str | None, prompt: Prompt) -> float:
        task = (prompt.entry.get("metadata") or {}).get("source_dataset")
        if task:
            from reasoning_gym.factory import DATASETS

            if task in DATASETS:
                if task not in self._scorers:
                    from reasoning_gym import get_score_answer_fn

                    self._scorers[task] = get_score_answer_fn(task)
                entry = {"question": prompt.question, "answer": prompt.answer,
                         "metadata": prompt.entry["metadata"]}
                return float(self._scorers[task](answer, entry))
        return exact_match(answer, prompt.answer)


def _epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        digest = hashlib.sha256(f"ferrule-data:{seed}:{epoch}".encode()).digest()
        random.Random(int.from_bytes(digest[:8], "big")).shuffle(order)
    return order


class PromptSampler:
    """Deterministic, resumable prompt order over a :class:`PromptSource`.

    Args:
        source: the prompts; seed: order seed (``train.seed``); shuffle: permute every epoch.

    ``next_batch(k)`` returns the next ``k`` prompts; ``state_dict()`` captures the position
    (``{"seed", "shuffle", "num_prompts", "epoch", "cursor", "served"}``) so that a resumed
    sampler continues with the same prompts an uninterrupted one would have produced.
    """

    def __init__(self, source: PromptSource, seed: int, shuffle: bool = True):
        if len(source) < 1:
            raise ValueError("PromptSampler needs a non-empty prompt source")
        self.source, self.seed, self.shuffle = source, int(seed), bool(shuffle)
        self.epoch, self.cursor, self.served = 0, 0, 0
        self._order = _epoch_permutation(len(source), self.seed, 0, self.shuffle)

    def next_indices(self, k: int) -> list[int]:
        """Indices of the next ``k`` prompts (advances the position)."""
        if k < 1:
            raise ValueError(f"batch size must be >= 1, got {k}")
        out: list[int] = []
        while len(out) < k:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = _epoch_permutation(len(self.source), self.seed, self.epoch, self.shuffle)
            take = min(k - len(out), len(self._order) - self.cursor)
            out += self._order[self.cursor:self.cursor + take]
            self.cursor += take
        self.served += k
        return out

    def next_batch(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (advances the position)."""
        return [self.source[i] for i in self.next_indices(k)]

    def state_dict(self) -> dict[str, int | bool]:
        return {"seed": self.seed, "shuffle": self.shuffle, "num_prompts": len(self.source),
                "epoch": self.epoch, "cursor": self.cursor, "served": self.served}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: the state was saved with another seed, shuffle flag or source size
                (resuming it would silently change the data order).
        """
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_prompts", len(self.source))):
            if state.get(key) != mine:
                raise ValueError(f"prompt sampler state has {key}={state.get(key)!r} but this run has "
                                 f"{key}={mine!r}; resume with the original data config")
        if not 0 <= int(state["cursor"]) <= len(self.source):
            raise ValueError(f"prompt sampler state cursor {state['cursor']} out of range")
        self.epoch, self.cursor, self.served = int(state["epoch"]), int(state["cursor"]), int(state["served"])
        self._order = _epoch_permutation(len(self.source), self.seed, self.epoch, self.shuffle)


def build_prompt_source(data_cfg: Any, *, eval_cfg: Any = None, require_answer: bool = True) -> PromptSource:
    """The training (or, with ``eval_cfg``, held-out) prompt source of a ``DataConfig``.

    For evaluation: reasoning-gym tasks are regenerated with ``eval_cfg.seed`` and
    ``eval_cfg.n_prompts`` items; JSONL sources read ``eval_cfg.jsonl_path``.
    """
    system = resolve_system_prompt(data_cfg.system_prompt_preset, data_cfg.system_prompt)
    if data_cfg.task:
        size, seed = (eval_cfg.n_prompts, eval_cfg.seed) if eval_cfg is not None else (data_cfg.size, data_cfg.seed)
        if eval_cfg is None or not eval_cfg.jsonl_path:
            return ReasoningGymSource(data_cfg.task, size, seed, data_cfg.task_kwargs, system,
                                      data_cfg.prompt_template)
    path = eval_cfg.jsonl_path if eval_cfg is not None else data_cfg.jsonl_path
    return JsonlSource(path, system, data_cfg.prompt_template, require_answer=require_answer)

