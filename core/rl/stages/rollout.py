"""Rollout stage: render each prompt with the chat template, then generate ``n`` responses per
prompt on the rollout engine(s), in shards with one seed each (:func:`ferrule.rl.distributed.plan_shards`).

Input: prompts (:class:`~ferrule.rl.tasks.Prompt`), their token ids, the sampling parameters.
Output: :class:`~ferrule.rollout.GenerateResult` list, prompt-major in prompt order, with
``prompt_index`` the prompt's position in the step's batch (the driver only).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ferrule.rl import distributed as rl_dist
from ferrule.rl import rollout_engine
from ferrule.rl.config_types import ConfigError
from ferrule.rl.tasks import has_media
from ferrule.chat import render_chat_ids
from ferrule.rollout import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ferrule.rl.config_schema import DataConfig, RLConfig
    from ferrule.contract.specs import ChatTemplateSpec, TowerSpec
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.tasks import Prompt, PromptSource
    from ferrule.rollout import GenerateResult, RolloutEngine

__all__ = ["prompt_token_ids", "PromptRenderer", "sampling_params", "generate", "generate_rollouts", "decode"]


def prompt_token_ids(template: ChatTemplateSpec, tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict],
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """Token ids of one prompt: the chat template with an open assistant turn, rendered with the
    tokenizer's special tokens and ``data.chat_template_kwargs`` (``tools`` goes to ``tools=``),
    i.e. ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)``."""
    extra = dict(chat_template_kwargs or {})
    tools = extra.pop("tools", None)
    return render_chat_ids(template, tokenizer, list(messages), tools=tools, add_generation_prompt=True,
                           **extra).token_ids


class PromptRenderer:
    """Token ids (and preprocessed media) of prompts, each rendered once and cached.

    Args:
        template / tokenizer: the chat template spec and the checkpoint's tokenizer.
        towers: the family's :class:`~ferrule.contract.specs.TowerSpec` list (empty: text only).
        hf_config: the HF config dict (placeholder token ids).
        data_cfg: ``cfg.data`` (``chat_template_kwargs``, ``max_prompt_tokens``).

    Attributes:
        ids_cache: ``{(kind, prompt.index): token ids}``; media_cache: ``{(kind, prompt.index): media}``
            (``kind`` is ``"train"`` or ``"eval"``).
    """

    def __init__(self, template: ChatTemplateSpec, tokenizer: PreTrainedTokenizerBase, towers: Sequence[TowerSpec],
                 hf_config: Mapping[str, Any], data_cfg: DataConfig) -> None:
        self.template, self.tokenizer, self.towers = template, tokenizer, list(towers)
        self.hf_config, self.data = hf_config, data_cfg
        self.ids_cache: dict[tuple[str, int], tuple[int, ...]] = {}
        self.media_cache: dict[tuple[str, int], dict] = {}

    def ids(self, prompt: Prompt, kind: str) -> tuple[int, ...]:
        """Token ids of ``prompt`` (placeholders expanded for its media).

        Raises:
            ConfigError: the prompt renders to more than ``data.max_prompt_tokens`` tokens.
            ferrule.media.MediaError: its media cannot be read or do not fit the towers.
        """
        key = (kind, prompt.index)
        if key not in self.ids_cache:
            ids = prompt_token_ids(self.template, self.tokenizer, prompt.messages, self.data.chat_template_kwargs)
            if has_media(prompt):
                from ferrule.media import expand_placeholders, message_media

                where = f"prompt {prompt.id!r}"
                media = message_media(prompt.messages, self.towers, self.hf_config, where,
                                      base_dir=prompt.media_dir or None)
                ids = tuple(expand_placeholders(ids, media, {t.modality: t.placeholder_id(self.hf_config)
                                                             for t in self.towers}, where,
                                                specs={t.modality: t for t in self.towers}))
                self.media_cache[key] = media
            if len(ids) > self.data.max_prompt_tokens:
                raise ConfigError([f"data.max_prompt_tokens: prompt {prompt.id!r} renders to {len(ids)} tokens > "
                                   f"{self.data.max_prompt_tokens}; raise data.max_prompt_tokens (and "
                                   "train.micro_batch_tokens) or shorten the prompts"])
            self.ids_cache[key] = ids
        return self.ids_cache[key]

    def check_all_media(self, sources: Mapping[str, PromptSource | None]) -> None:
        """Render every prompt with media of ``{kind: source}`` now (bad media stop the run before step 1)."""
        for kind, source in sources.items():
            if source is None:
                continue
            for i in range(len(source)):
                if has_media(source[i]):
                    self.ids(source[i], kind)


def media_of(media_cache: Mapping[tuple[str, int], dict], prompt: Prompt) -> dict | None:
    """The preprocessed media of a rendered prompt (None: text only)."""
    return media_cache.get(("train", prompt.index), media_cache.get(("eval", prompt.index)))


def sampling_params(cfg: RLConfig, stop_ids: Sequence[int], stop_strings: Sequence[str], *, n: int,
                    temperature: float, max_new_tokens: int, seed: int | None, routes: bool = False) -> SamplingParams:
    """:class:`~ferrule.rollout.SamplingParams` of ``cfg.rollout`` (greedy: no top-p / top-k); ``routes``:
    ask for the routed experts (the training rollout under ``algorithm.routing_replay``)."""
    ro = cfg.rollout
    return SamplingParams(temperature=temperature, top_p=ro.top_p if temperature > 0 else 1.0,
                          top_k=ro.top_k if temperature > 0 else -1, max_new_tokens=max_new_tokens,
                          stop_token_ids=tuple(stop_ids), stop=tuple(stop_strings), n=n, seed=seed,
                          return_raw_logprobs=rollout_engine.wants_raw_logprobs(cfg, temperature),
                          return_routed_experts=routes)


def decode(tokenizer: PreTrainedTokenizerBase, results: Sequence[GenerateResult]) -> list[str]:
    """Response texts of ``results`` (special tokens skipped)."""
    return [tokenizer.decode(list(r.token_ids), skip_special_tokens=True) for r in results]


def generate(engine: RolloutEngine, params: SamplingParams, prompts: Sequence[Prompt],
             prompt_ids: Sequence[tuple[int, ...]], media: Callable[[Prompt], dict | None]) -> list[GenerateResult]:
    """One generate call on ``engine`` for ``prompts`` (evaluation; not sharded, not collective)."""
    return engine.generate([GenerateRequest(ids, request_id=p.id, media=media(p))
                            for p, ids in zip(prompts, prompt_ids)], params)


def generate_rollouts(roles: RankRoles, engine: RolloutEngine | None, params: SamplingParams | None, *, seed: int,
                      prompts_per_shard: int, step: int, prompts: Sequence[Prompt] | None = None,
                      prompt_ids: Sequence[tuple[int, ...]] | None = None,
                      media: Callable[[Prompt], dict | None] = lambda p: None,
                      round_: int = 0) -> list[GenerateResult] | None:
    """The step's rollout in shards (:func:`ferrule.rl.distributed.plan_shards`); collective.

    The driver passes the prompts and gets every shard's results, prompt-major in prompt
    order (``prompt_index`` = position in ``prompts``); each rollout rank runs its shards (shard
    ``k`` with ``params.seed`` replaced by the shard's seed); other ranks only take part in the
    two object collectives. ``round_``: the refill round of ``algorithm.dynamic_sampling`` (0: the
    step's first rollout), which salts the shard seeds (:func:`ferrule.rl.distributed.shard_seed`).
    Returns None off the driver.
    """
    plan = None
    if roles.is_driver:
        shards = rl_dist.plan_shards(len(prompts), prompts_per_shard, len(roles.rollout_ranks), seed, step,
                                     round_)
        plan = (params, [(sh, [(prompt_ids[i], prompts[i].id, media(prompts[i])) for i in range(sh.start, sh.stop)])
                         for sh in shards])
    if roles.distributed:
        plan = rl_dist.broadcast_object(plan)
    params, work = plan
    mine = []
    if roles.replica is not None:
        for sh, reqs in work:
            if sh.replica != roles.replica:
                continue
            out = engine.generate([GenerateRequest(ids, request_id=rid, media=m) for ids, rid, m in reqs],
                                  dataclasses.replace(params, seed=sh.seed))
            mine.append((sh.index, [dataclasses.replace(r, prompt_index=r.prompt_index + sh.start) for r in out]))
    gathered = rl_dist.gather_objects(mine) if roles.distributed else [mine]
    if not roles.is_driver:
        return None
    return [r for _, res in sorted((x for per_rank in gathered for x in per_rank), key=lambda x: x[0])
            for r in res]
