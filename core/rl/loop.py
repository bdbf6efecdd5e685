"""The GRPO loop of ``ferrule train``: prompts -> rollout -> rewards -> advantages -> fb -> step -> sync.

One step (``train.prompts_per_step`` prompts, ``rollout.n_samples_per_prompt`` samples each):

1. **Prompts**: the next prompts of the resumable :class:`~ferrule.rl.tasks.PromptSampler`,
   rendered with the family's chat template (``add_generation_prompt=True``, the tokenizer's
   special tokens and ``data.chat_template_kwargs``, as ``apply_chat_template``) and tokenized.
2. **Rollout**: the rollout engine samples ``n`` responses per prompt with seed
   ``sha256("ferrule-rollout:{train.seed}:{step}")`` (so a resumed run samples what an
   uninterrupted one would); generation stops at the template's stop tokens, EOS or
   ``max_new_tokens``. The engine also returns the temperature-1 logprobs of the sampled tokens.
3. **Rewards**: decoded responses -> answer extraction -> the task's verifier -> ``reward.mode``
   (+ format reward). A sample whose reward function raises gets ``reward.failure_reward`` and
   is counted (``reward_errors``), with a warning for a step where many raised; a broken function
   is refused at set-up, where it scores the task's reference answers (:mod:`ferrule.rl.rewards`).
4. **Advantages**: group-normalized (:func:`~ferrule.rl.advantages.grpo_advantages`), one per
   sample, broadcast over its response tokens.
5. **Old / reference logprobs**: with ``algorithm.use_tis`` or several optimizer steps per
   rollout, the train engine's ``forward_logprobs`` gives the pre-update ("old") logprobs that
   the PPO ratio divides by; otherwise the rollout engine's logprobs play that role (one fewer
   forward pass). With ``kl_coef > 0`` a frozen reference (:mod:`ferrule.rl.reference`) scores
   the batch.
6. **Train**: the batch is split into ``train.optim_steps_per_rollout`` mini-batches of whole
   groups; each is one ``forward_backward`` (the engine packs micro-batches of at most
   ``train.micro_batch_tokens`` padded tokens) and one ``optim_step``. The policy loss is
   ``algorithm.loss`` from :mod:`ferrule.losses` (PPO clip by default, ratio bounds
   ``[1 - eps_clip, 1 + eps_clip_high]``), multiplied per token by the truncated IS weight
   ``min(exp(old - rollout), tis_cap)``, plus ``kl_coef * k3`` KL to the reference
   (``k3 = exp(ref - logp) - (ref - logp) - 1``, Schulman 2020). Per-token weights make each
   optimizer step the mean over all response tokens of its mini-batch (``token_mean``), so the
   micro-batch split does not change the update.
7. **Weight sync** through the family's update groups (:func:`ferrule.sync.sync_weights`);
   ``check_weight_update_equal`` verifies every tensor after each sync. With LoRA only the
   adapter travels (:func:`ferrule.sync.sync_lora_adapter`, then
   :func:`ferrule.rl.distributed.fan_out_lora_adapter` to the other replicas).
8. **Eval / checkpoint** every ``eval.interval`` / ``checkpoint.interval`` steps (and at the end).

Checkpoint ``CKPT_DIR/step_NNNNNN/`` = ``engine/`` (:meth:`TrainEngine.save`: model, optimizer,
scheduler, RNG; atomic) + ``loop_state.json`` (step, sampler position; written last, atomically:
a folder without it is incomplete and ignored). Resume loads both, re-syncs the rollout engine
and continues with the same prompts and rollout seeds, so its metrics equal an uninterrupted
run's (tests/test_rl_e2e.py).

Several ranks (``torchrun --nproc-per-node N -m ferrule train CONFIG``, ``parallel.tp/pp/ep``):
global rank 0 drives (prompts, rewards, advantages, metrics, checkpoint loop state, evaluation),
every data-parallel replica's first rank generates its rollout shards, and every rank trains on
the same batch (:mod:`ferrule.rl.distributed`). Rollouts are cut into shards of
``rollout.prompts_per_shard`` prompts with one seed each, so a run samples the same responses at
any world size for the same ``prompts_per_shard``. With ``rollout.engine: sglang`` the driver alone
drives an SGLang server and runs every shard (:mod:`ferrule.rl.sglang_rollout`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ferrule.rl.checkpoints import (LOOP_STATE_FILE, RESUME_MUTABLE, atomic_write, config_differences,
                                    list_checkpoints)
from ferrule.rl.config import ConfigError, RLConfig
from ferrule.rl.run_checks import check_supported, lock_run_dir, lora_settings, preflight, unlock_run_dir
from ferrule.rl import distributed as rl_dist
from ferrule.rl import sglang_rollout
from ferrule.rl.seeds import rollout_seed
from ferrule.rl.tasks import has_media

__all__ = ["GRPOTrainer", "RunResult", "train", "rollout_seed", "check_supported", "list_checkpoints",
           "config_differences", "LOOP_STATE_FILE", "RESUME_MUTABLE", "SAMPLES_FILE", "prompt_token_ids", "preflight"]

SAMPLES_FILE = "samples.jsonl"
#: Reward-function failures printed per run (every one is counted in the metrics).
MAX_SHOWN_REWARD_FAILURES = 5


def prompt_token_ids(template: Any, tokenizer: Any, messages: Any,
                     chat_template_kwargs: dict[str, Any] | None = None) -> tuple[int, ...]:
    """Token ids of one prompt: the chat template with an open assistant turn, rendered with the
    tokenizer's special tokens and ``data.chat_template_kwargs`` (``tools`` goes to ``tools=``),
    i.e. ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)``."""
    from ferrule.chat import render_chat_ids

    extra = dict(chat_template_kwargs or {})
    tools = extra.pop("tools", None)
    return render_chat_ids(template, tokenizer, list(messages), tools=tools, add_generation_prompt=True,
                           **extra).token_ids


@dataclass
class RunResult:
    """What :meth:`GRPOTrainer.run` did.

    Attributes:
        run_dir: the run folder. start_step: completed steps when the run began (resume point).
        last_step: completed steps at exit. interrupted: stopped early (Ctrl-C or ``stop_after``).
        checkpoint: last checkpoint written (None if none). plot: reward-curve PNG (or None).
        metrics: the entries logged by this process (``metrics.jsonl`` has all of them).
    """

    run_dir: Path
    start_step: int
    last_step: int
    interrupted: bool
    checkpoint: Path | None
    plot: Path | None
    metrics: list[dict[str, Any]] = field(default_factory=list)


def _reset_peak_memory() -> None:
    from ferrule.megatron.device import get_backend

    get_backend().reset_peak_memory()


def _memory_metrics() -> dict[str, int]:
    """This rank's memory after the step: CUDA allocated / step peak, or the host RSS / process peak."""
    from ferrule.megatron.device import get_backend

    stats = get_backend().memory_stats()
    if "allocated" in stats:
        return {"memory_allocated_bytes": stats["allocated"], "memory_peak_bytes": stats["peak_allocated"]}
    return {"memory_allocated_bytes": stats["rss"], "memory_peak_bytes": stats["peak_rss"]}


class GRPOTrainer:
    """Builds the engines for an :class:`RLConfig` and runs the loop (module docstring).

    Args:
        cfg: the validated config (``load_config``).
        check_weight_update_equal: verify the rollout engine's weights after every sync
            (exact compare; slow for large models).
        console: a ``rich.console.Console`` for messages (default: stderr).

    Raises:
        ConfigError: unsupported settings, missing paths, a resume whose config differs in
            data/model/algorithm keys, or a fresh run into a folder that already has metrics.
    """

    def __init__(self, cfg: RLConfig, *, check_weight_update_equal: bool = False, console: Any = None):
        from rich.console import Console

        check_supported(cfg)
        sglang_rollout.check_rollout_engine(cfg, check_weight_update_equal=check_weight_update_equal)
        cfg.check_paths()
        self._run_lock = lock_run_dir(cfg)  # a second trainer on this run folder stops here, naming this one
        try:
            preflight(cfg)
            hf_config = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
            rl_dist.check_layout(cfg, hf_config, rl_dist.launch_world_size())
        except BaseException:
            unlock_run_dir(self._run_lock)
            raise
        self.cfg = cfg
        #: only global rank 0 prints (the others' errors still reach stderr through the CLI)
        self._quiet = int(os.environ.get("RANK", "0") or 0) != 0
        self.roles = rl_dist.RankRoles(0, 1, (0,))
        self.check_equal = check_weight_update_equal
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self._stop_requested = False
        self._setup_done = False
        self._reward_failures_shown = 0
        self.last_sync: Any = None  # SyncStats of the latest weight sync

    # ------------------------------------------------------------------ setup
    def _log(self, text: str) -> None:
        if not self._quiet:
            self.console.print(text, markup=False, highlight=False)

    def setup(self) -> None:
        """Build prompt sources, reward function, rollout engine, template, train engine (idempotent)."""
        if self._setup_done:
            return
        import torch
        import transformers  # noqa: F401  (modeling code before megatron's CPU patches)
        from transformers import GenerationMixin  # noqa: F401

        from ferrule import registry
        from ferrule.chat import stop_token_ids
        from ferrule.rl.rewards import build_reward_fn_from_config
        from ferrule.rl.tasks import PromptSampler, build_prompt_source

        cfg = self.cfg
        dtype = getattr(torch, cfg.model.dtype)
        t0 = time.perf_counter()
        self.source = build_prompt_source(cfg.data)
        self.sampler = PromptSampler(self.source, cfg.train.seed, cfg.data.shuffle)
        self.reward_fn = build_reward_fn_from_config(cfg, self.source)
        self.eval_source = build_prompt_source(cfg.data, eval_cfg=cfg.eval) if cfg.eval.interval > 0 else None
        self.eval_reward_fn = (build_reward_fn_from_config(cfg, self.eval_source)
                               if self.eval_source is not None else None)
        if cfg.reward.check_reference:  # a broken reward function is refused here, not at step 1
            self._check_reward_fn()

        hf_config = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
        self.family = cfg.model.family or registry.family_for_hf_config(hf_config).name
        from ferrule.megatron.device import get_backend
        from ferrule.megatron.engine import OptimizerSettings, TrainEngine
        from ferrule.megatron.parallel import ParallelLayout, init_distributed

        # the rollout model's modeling module is imported before megatron's CPU patches (get_backend)
        # replace torch.cuda.Stream, as when the rollout engine was built first
        registry.hf_model_class(hf_config)
        # the process group first (torchrun env or one local process), with the config's timeout
        layout = ParallelLayout(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep)
        init_distributed(layout, seed=cfg.train.seed, timeout_s=cfg.parallel.timeout_s)
        o, t = cfg.optimizer, cfg.train
        total_optim_steps = t.steps * t.optim_steps_per_rollout
        settings = OptimizerSettings(
            lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_steps * t.optim_steps_per_rollout,
            lr_decay_steps=(None if o.lr_decay_style == "constant"
                            else (o.lr_decay_steps or t.steps) * t.optim_steps_per_rollout),
            lr_decay_style=o.lr_decay_style, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad)
        kwargs = dict(optimizer=settings, params_dtype=dtype, seed=t.seed, max_tokens_per_microbatch=t.micro_batch_tokens)
        lora = lora_settings(cfg)
        if lora is not None:  # adapters on the frozen base; the sync then sends only the adapter
            kwargs["lora"] = lora
        if cfg.model.torch_dist_dir:
            self.engine = TrainEngine.from_torch_dist(cfg.model.torch_dist_dir, layout, load_optimizer=False, **kwargs)
        else:
            self.engine = TrainEngine.from_hf(cfg.model.hf_dir, layout, **kwargs)
        self.roles = rl_dist.rank_roles(driver_only_rollout=cfg.rollout.engine == "sglang")

        # the embedded engine runs where training runs: the GPU when there is one, else the CPU; one
        # per data-parallel replica, on its first rank (sglang: the driver's client of the server)
        self.rollout = self.tokenizer = None
        self.template, self.stop_ids, self.stop_strings = None, (), ()
        if self.roles.replica is not None:
            self.rollout, self.tokenizer = sglang_rollout.build_rollout_engine(cfg, dtype=dtype,
                                                                               device=get_backend().device)
        if self.roles.is_driver:
            if self.tokenizer is None:
                raise ConfigError([f"model.hf_dir: {cfg.model.hf_dir!r} has no tokenizer files (tokenizer.json / "
                                   "tokenizer_config.json); the loop renders prompts with the checkpoint's tokenizer"])
            if cfg.data.chat_template:
                self.template = registry.get_chat_template(cfg.data.chat_template)
            else:
                templates = registry.chat_templates_for(self.family)
                if not templates:
                    raise ConfigError([f"data.chat_template: family {self.family!r} registers no chat template; "
                                       "name one with data.chat_template (see `ferrule chat-template list`)"])
                self.template = templates[0]
            stop_ids = list(stop_token_ids(self.template, self.tokenizer))
            stop_strings = []
            for tok in cfg.rollout.extra_stop_tokens:
                ids = self.tokenizer.encode(tok, add_special_tokens=False)
                (stop_ids.extend(ids) if len(ids) == 1 else stop_strings.append(tok))
            self.stop_ids, self.stop_strings = tuple(dict.fromkeys(stop_ids)), tuple(stop_strings)
        self._setup_colocation()
        self._prompt_cache: dict[tuple[str, int], tuple[int, ...]] = {}
        self._media_cache: dict[tuple[str, int], dict] = {}
        self.towers = registry.get_towers(self.family)

        self.reference = None
        if cfg.algorithm.kl_coef > 0 and self.roles.is_driver:
            from ferrule.rl.reference import ReferencePolicy

            self.reference = ReferencePolicy(cfg.model.hf_dir, dtype=dtype)

        self._total_optim_steps = total_optim_steps
        if self.roles.is_driver:
            self._check_all_media()
            if self._media_cache and cfg.rollout.engine == "sglang":
                raise ConfigError(["rollout.engine: sglang cannot take the prompts' images or audio (the SGLang "
                                   "client sends no media yet); use rollout.engine=embedded for multimodal prompts"])
            if self._media_cache and self.reference is not None:
                raise ConfigError(["algorithm.kl_coef: the reference policy does not take media yet; use kl_coef 0 "
                                   "with prompts that carry images or audio"])
        r = self.roles
        layout_note = (f", {r.world_size} ranks (tp {cfg.parallel.tp}, pp {cfg.parallel.pp}, ep {cfg.parallel.ep}, "
                       f"dp {r.world_size // (cfg.parallel.tp * cfg.parallel.pp)}; rollout on ranks "
                       f"{list(r.rollout_ranks)})" if r.distributed else "")
        if self.roles.is_driver:
            self._log(f"ferrule train: family {self.family}, template {self.template.name}, "
                      f"{len(self.source)} prompts ({self.source.name}){layout_note}, "
                      f"setup {time.perf_counter() - t0:.1f} s")
        self._setup_done = True

    def _check_reward_fn(self) -> None:
        """:func:`ferrule.rl.rewards.check_reward_fn` on the train (and eval) prompts; prints what it found."""
        from ferrule.rl.rewards import check_reward_fn

        cfg = self.cfg
        for fn, source in ((self.reward_fn, self.source), (self.eval_reward_fn, self.eval_source)):
            if fn is None:
                continue
            found = check_reward_fn(fn, source, extraction=cfg.data.answer_extraction, function=cfg.reward.function)
            if source is self.source and found.checked:
                self._log(f"reward check: the reference answers of {len(found.checked)} prompts score correct"
                          + "".join(f"; raises on the malformed answer {junk!r} ({err}), such samples score "
                                    f"{cfg.reward.failure_reward}" for junk, err in found.raises_on_malformed[:2]))

    # ------------------------------------------------------------------ pieces
    def _prompt_ids(self, prompt: Any, kind: str) -> tuple[int, ...]:
        key = (kind, prompt.index)
        if key not in self._prompt_cache:
            ids = prompt_token_ids(self.template, self.tokenizer, prompt.messages, self.cfg.data.chat_template_kwargs)
            if has_media(prompt):
                from ferrule.media import expand_placeholders, message_media

                where = f"prompt {prompt.id!r}"
                media = message_media(prompt.messages, self.towers, self.engine.hf_config, where,
                                      base_dir=prompt.media_dir or None)
                ids = tuple(expand_placeholders(ids, media, {t.modality: t.placeholder_id(self.engine.hf_config)
                                                             for t in self.towers}, where))
                self._media_cache[key] = media
            if len(ids) > self.cfg.data.max_prompt_tokens:
                raise ConfigError([f"data.max_prompt_tokens: prompt {prompt.id!r} renders to {len(ids)} tokens > "
                                   f"{self.cfg.data.max_prompt_tokens}; raise data.max_prompt_tokens (and "
                                   "train.micro_batch_tokens) or shorten the prompts"])
            self._prompt_cache[key] = ids
        return self._prompt_cache[key]

    def _media_of(self, prompt: Any) -> dict | None:
        """The preprocessed media of a prompt rendered by :meth:`_prompt_ids` (None: text only)."""
        return self._media_cache.get(("train", prompt.index), self._media_cache.get(("eval", prompt.index)))

    def _check_all_media(self) -> None:
        """Preprocess every prompt with media before training (bad media stop the run before step 1)."""
        for kind, source in (("train", self.source), ("eval", self.eval_source)):
            if source is None:
                continue
            for i in range(len(source)):
                if has_media(source[i]):
                    self._prompt_ids(source[i], kind)

    def _sampling_params(self, *, n: int, temperature: float, max_new_tokens: int, seed: int) -> Any:
        from ferrule.rollout import SamplingParams

        ro = self.cfg.rollout
        return SamplingParams(temperature=temperature, top_p=ro.top_p if temperature > 0 else 1.0,
                              top_k=ro.top_k if temperature > 0 else -1, max_new_tokens=max_new_tokens,
                              stop_token_ids=self.stop_ids, stop=self.stop_strings, n=n, seed=seed,
                              return_raw_logprobs=sglang_rollout.wants_raw_logprobs(self.cfg, temperature))

    def _decode(self, results: list[Any]) -> list[str]:
        return [self.tokenizer.decode(list(r.token_ids), skip_special_tokens=True) for r in results]

    def _generate(self, prompts: list[Any], prompt_ids: list[tuple[int, ...]], *, n: int, temperature: float,
                  max_new_tokens: int, seed: int) -> tuple[list[Any], list[str]]:
        """One generate call on this rank's engine (evaluation; the driver only)."""
        from ferrule.rollout import GenerateRequest

        params = self._sampling_params(n=n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
        results = self.rollout.generate([GenerateRequest(ids, request_id=p.id, media=self._media_of(p))
                                         for p, ids in zip(prompts, prompt_ids)], params)
        return results, self._decode(results)

    def _rollout(self, step: int, prompts: list[Any] | None = None,
                 prompt_ids: list[tuple[int, ...]] | None = None) -> list[Any] | None:
        """The step's rollout in shards (:func:`ferrule.rl.distributed.plan_shards`); collective.

        The driver passes the prompts and gets every shard's results, prompt-major in prompt
        order (``prompt_index`` = position in ``prompts``); each rollout rank runs its shards;
        other ranks only take part in the two object collectives. Returns None off the driver.
        """
        from ferrule.rollout import GenerateRequest

        roles, ro = self.roles, self.cfg.rollout
        plan = None
        if roles.is_driver:
            shards = rl_dist.plan_shards(len(prompts), ro.prompts_per_shard, len(roles.rollout_ranks),
                                         self.cfg.train.seed, step)
            params = self._sampling_params(n=ro.n_samples_per_prompt, temperature=ro.temperature,
                                           max_new_tokens=ro.max_new_tokens, seed=None)
            plan = (params, [(sh, [(prompt_ids[i], prompts[i].id, self._media_of(prompts[i]))
                                   for i in range(sh.start, sh.stop)])
                             for sh in shards])
        if roles.distributed:
            plan = rl_dist.broadcast_object(plan)
        params, work = plan
        mine = []
        if roles.replica is not None:
            for sh, reqs in work:
                if sh.replica != roles.replica:
                    continue
                out = self.rollout.generate([GenerateRequest(ids, request_id=rid, media=m) for ids, rid, m in reqs],
                                            dataclasses.replace(params, seed=sh.seed))
                mine.append((sh.index, [dataclasses.replace(r, prompt_index=r.prompt_index + sh.start) for r in out]))
        gathered = rl_dist.gather_objects(mine) if roles.distributed else [mine]
        if not roles.is_driver:
            return None
        return [r for _, res in sorted((x for per_rank in gathered for x in per_rank), key=lambda x: x[0])
                for r in res]

    def _evaluate(self, step: int) -> dict[str, float]:
        from ferrule.rl.rewards import reward_error_metrics

        e = self.cfg.eval
        prompts = [self.eval_source[i] for i in range(len(self.eval_source))]
        ids = [self._prompt_ids(p, "eval") for p in prompts]
        results, texts = self._generate(prompts, ids, n=1, temperature=e.temperature,
                                        max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                        seed=rollout_seed(self.cfg.train.seed, step, "eval"))
        rewards = self._score(self.eval_reward_fn, texts, prompts, f"evaluation at step {step}")
        out = {"eval_reward_mean": float(np.mean([r.reward for r in rewards])),
               "eval_accuracy": float(np.mean([r.correct for r in rewards]))}
        out.update(reward_error_metrics(rewards, prefix="eval_"))
        return out

    def _score(self, reward_fn: Any, texts: list[str], prompts: list[Any], where: str) -> list[Any]:
        """Rewards with failures scored as ``reward.failure_reward``; the first few are printed, and a
        warning for a step where many failed (:func:`~ferrule.rl.rewards.reward_failure_warning`)."""
        from ferrule.rl.rewards import describe_failure, reward_failure_warning, score_responses

        rewards = score_responses(reward_fn, texts, prompts, failure_reward=self.cfg.reward.failure_reward)
        warning = reward_failure_warning(rewards, texts, prompts, where)
        if warning:
            self._log(warning)
        for r, text, prompt in zip(rewards, texts, prompts):
            if r.error_type is not None and self._reward_failures_shown < MAX_SHOWN_REWARD_FAILURES:
                self._reward_failures_shown += 1
                self._log(f"{where}: reward function failed, sample scored {self.cfg.reward.failure_reward} "
                          f"({self._reward_failures_shown}/{MAX_SHOWN_REWARD_FAILURES} shown; all are counted in "
                          f"reward_errors): {describe_failure(r, text, prompt)}")
        return rewards

    def _log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        errors = metrics.get("eval_reward_errors") or 0
        self._log(f"eval at step {step}: accuracy {metrics['eval_accuracy']:.3f}, reward "
                  f"{metrics['eval_reward_mean']:.3f} on {len(self.eval_source)} held-out prompts"
                  + (f" ({errors} reward errors)" if errors else ""))

    def _train_mfu(self, samples: list, seconds: float, forward_only_too: bool) -> float | None:
        """Model FLOPs utilisation of the train phase (:func:`ferrule.megatron.flops.training_mfu`):
        forward_backward over every sample, plus forward_logprobs when it ran; None on CPU or where
        the count or the device's peak is unknown."""
        from ferrule.megatron.flops import training_mfu

        device = next(self.engine.model[0].parameters()).device
        lens = [s.num_tokens for s in samples]
        return training_mfu(self.engine.hf_config, lens, seconds, device,
                            forward_only_seq_lens=lens if forward_only_too else ())

    def _sync(self) -> float:
        from ferrule.sync import sync_lora_adapter, sync_weights

        t0 = time.perf_counter()
        if getattr(self.engine, "lora", None) is not None:  # LoRA: only the adapter travels; the base stays put
            stats = sync_lora_adapter(self.engine, self.rollout, version=self.engine.step,
                                      check_equal=self.check_equal)
            # the other replicas' rollout engines get the adapter the driver's engine now serves
            rl_dist.fan_out_lora_adapter(self.roles, self.rollout, self.engine.step, check_equal=self.check_equal)
        else:
            stats = sync_weights(self.engine, self.rollout, version=self.engine.step, check_equal=self.check_equal)
            # the other replicas' rollout engines get the driver engine's tensors (gathered once)
            rl_dist.fan_out_rollout_weights(self.roles, self.rollout, self.engine.step)
        self.last_sync = stats
        return time.perf_counter() - t0

    def _setup_colocation(self) -> None:
        """``train.colocate`` (:mod:`ferrule.rl.colocate`): decide, and keep the phase meter."""
        from ferrule.rl.colocate import Colocation, PhaseMeter, resolve_colocate

        self.meter = PhaseMeter()
        try:
            on, why = resolve_colocate(self.cfg.train.colocate, self.engine, self.rollout, self.cfg,
                                       distributed=self.roles.distributed)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
        self.colocation = Colocation(self.engine, self.rollout, self.meter) if on else None
        if self.cfg.train.colocate is not False:
            self._log(why)

    def _rollout_phase(self) -> None:
        if self.colocation is not None:
            self.colocation.rollout_phase()

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Run step ``step`` (1-based); return ``(metrics, logged samples)``."""
        import torch

        from ferrule.losses import SEQUENCE_LEVEL, finalize_metrics, sum_metrics
        from ferrule.rl.advantages import grpo_advantages, token_weights, zero_std_group_fraction
        from ferrule.rl.batch import (Sample, build_datums, loss_fn_config, response_slice, sequence_datum,
                                      split_groups)
        from ferrule.rl.metrics import rollout_metrics
        from ferrule.rl.rewards import reward_error_metrics

        cfg, ro, a = self.cfg, self.cfg.rollout, self.cfg.algorithm
        n = ro.n_samples_per_prompt
        t_step = time.perf_counter()
        _reset_peak_memory()  # the step's peak (CUDA); CPU reports the process peak RSS
        driver = self.roles.is_driver
        self._rollout_phase()  # colocated: train offloaded, rollout awake
        self.meter.record_now("memory_offloaded_bytes")
        self.meter.start()
        t_roll0 = time.perf_counter()
        if driver:
            prompts = self.sampler.next_batch(cfg.train.prompts_per_step)
            prompt_ids = [self._prompt_ids(p, "train") for p in prompts]
            media = [self._media_of(p) for p in prompts]
            results = self._rollout(step, prompts, prompt_ids)
            texts = self._decode(results)
        else:
            self._rollout(step)
        t_rollout = time.perf_counter() - t_roll0
        self.meter.stop("rollout")
        if self.colocation is not None:
            self.colocation.train_phase()  # rollout asleep, train onloaded
        self.meter.start()
        if driver:
            rewards = self._score(self.reward_fn, texts, [prompts[r.prompt_index] for r in results], f"step {step}")
        if self.roles.distributed:  # every rank builds the same train batch from the driver's rollout
            prompt_ids, results, rewards, media = rl_dist.broadcast_object(
                (prompt_ids, results, rewards, media) if driver else None)
        samples = [Sample(group=r.prompt_index, prompt_ids=prompt_ids[r.prompt_index], response_ids=r.token_ids,
                          rollout_logprobs=r.raw_logprobs if r.raw_logprobs is not None else r.logprobs,
                          truncated=r.finish_reason == "length", media=media[r.prompt_index])
                   for r in results]
        reward_values = [r.reward for r in rewards]
        trainable = [len(s.response_ids) > 0 for s in samples]  # an empty response has no token to train
        adv = grpo_advantages(reward_values, group_size=n, std_normalization=a.grpo_std_normalization,
                              eps=a.advantage_eps, sample_mask=trainable)
        rollout_lp = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]

        t_train0 = time.perf_counter()
        need_old = a.use_tis or cfg.train.optim_steps_per_rollout > 1
        trainer_lp: list[torch.Tensor | None] = [None] * len(samples)
        if need_old:
            old = self.engine.forward_logprobs([sequence_datum(s) for s in samples])
            behaviour = [response_slice(lp, s) for lp, s in zip(old, samples)]
            trainer_lp = list(behaviour)
        else:
            behaviour = rollout_lp
        ref = None
        if self.reference is not None:
            ref = [response_slice(lp, s) for lp, s in zip(
                self.reference.logprobs([s.prompt_ids + s.response_ids for s in samples],
                                        cfg.train.micro_batch_tokens), samples)]
        if self.roles.distributed and a.kl_coef > 0:  # the reference policy lives on rank 0
            ref = rl_dist.broadcast_object(ref)
        loss_name, loss_cfg = loss_fn_config(a)
        sums, grad_norms, lrs, skipped, ppo_kl_num, ppo_kl_den = [], [], [], 0, 0.0, 0
        for k, groups in enumerate(split_groups(len(prompt_ids), cfg.train.optim_steps_per_rollout)):
            idx = [i for i, s in enumerate(samples) if s.group in groups]
            w = token_weights([len(samples[i].response_ids) for i in idx], mode=a.loss_aggregation,
                              max_new_tokens=ro.max_new_tokens)
            datums = build_datums([samples[i] for i in idx], weights=w, advantages=[adv[i] for i in idx],
                                  behaviour_logprobs=[behaviour[i] for i in idx], use_tis=a.use_tis,
                                  ref_logprobs=[ref[i] for i in idx] if ref is not None else None,
                                  sequence_ratio=loss_name in SEQUENCE_LEVEL)
            out = self.engine.forward_backward(datums, loss_name, loss_cfg)
            sums.append({key: v for key, v in out.metrics.items() if key.endswith(":sum")})
            for j, i in enumerate(idx):
                cur = response_slice(out.loss_fn_outputs[j]["logprobs"], samples[i])
                if k == 0 and trainer_lp[i] is None:
                    trainer_lp[i] = cur
                d = (behaviour[i] - cur).double()  # log(p_old / p_cur)
                ppo_kl_num += float((d.exp() - 1 - d).sum())
                ppo_kl_den += d.numel()
            res = self.engine.optim_step()
            grad_norms.append(res["grad_norm"])
            lrs.append(res["learning_rate"])
            skipped += not res["success"]
        t_train = time.perf_counter() - t_train0
        self.meter.stop("train")
        self.meter.start()
        t_sync = self._sync()  # colocated: into the sleeping rollout engine's host copies
        self.meter.stop("sync")
        if self.colocation is not None:
            self.colocation.offload_train()

        lm = finalize_metrics(sum_metrics(sums))
        lengths = [len(s.response_ids) for s in samples]
        metrics: dict[str, Any] = rollout_metrics(
            reward_values, group_size=n, response_lengths=lengths, correct=[r.correct for r in rewards],
            format_ok=[r.format_ok for r in rewards], truncated=[s.truncated for s in samples])
        metrics["task_score_mean"] = float(np.mean([r.score if r.score is not None else 0.0 for r in rewards]))
        metrics.update(reward_error_metrics(rewards))
        have = [i for i, lp in enumerate(trainer_lp) if lp is not None]
        diff = torch.cat([(trainer_lp[i] - rollout_lp[i]).abs() for i in have]) if have else torch.zeros(1)
        ppo_kl = ppo_kl_num / max(ppo_kl_den, 1)
        metrics.update({
            "loss": lm["loss:sum"] / len(sums),
            "kl": lm["ref_kl:mean"] if "ref_kl:mean" in lm else ppo_kl,
            "ppo_kl": ppo_kl,
            "clip_fraction": lm.get("clip_fraction:mean", 0.0),
            "ratio_mean": lm.get("ratio:mean"),
            "entropy": float(-torch.cat(rollout_lp).mean()),
            "train_rollout_logprob_abs_diff": float(diff.mean()),
            "grad_norm": float(np.mean(grad_norms)),
            "lr": lrs[-1],
            "advantage_abs_mean": float(np.abs(adv).mean()),
            "zero_std_group_fraction": zero_std_group_fraction(reward_values, n, sample_mask=trainable),
        })
        if self.towers:  # media of the step's prompts (each prompt's n samples share them)
            from ferrule.media import media_token_counts

            for t in self.towers:
                per_prompt = [m or {} for m in media]
                metrics[f"media_{t.modality}_parts"] = sum(len(m.get(t.modality, ())) for m in per_prompt)
                metrics[f"media_{t.modality}_tokens"] = sum(media_token_counts(m).get(t.modality, 0) for m in per_prompt)
        if a.use_tis:
            metrics["tis_weight_mean"] = lm.get("tis_weight:mean")
            metrics["tis_truncated_fraction"] = lm.get("tis_truncated_fraction:mean")
        if skipped:
            metrics["skipped_optim_steps"] = skipped
        gen_tokens = sum(lengths)
        seq_tokens = sum(s.num_tokens + 1 for s in samples)
        t_total = time.perf_counter() - t_step
        metrics.update({"time_rollout_s": t_rollout, "time_train_s": t_train, "time_sync_s": t_sync,
                        "rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9),
                        "train_tokens_per_s": seq_tokens / max(t_train, 1e-9),
                        "mfu": self._train_mfu(samples, t_train, need_old),
                        "weights_version": self.engine.step, "epoch": self.sampler.epoch,
                        "sync_bytes": self.last_sync.bytes})
        metrics.update(_memory_metrics())
        metrics.update(self.meter.pop())
        if self.last_sync.device_memory_after is not None:  # a leaking export shows up here first
            metrics["sync_device_memory_delta_bytes"] = (self.last_sync.device_memory_after
                                                         - self.last_sync.device_memory_before)
        if self.roles.distributed:  # per-rank timings: the slowest and fastest rank of each phase
            times = rl_dist.all_gather_objects((t_rollout, t_train, t_sync, self._stop_requested))
            for j, key in enumerate(("time_rollout_s", "time_train_s", "time_sync_s")):
                metrics[key + "_max"] = max(x[j] for x in times)
                metrics[key + "_min"] = min(x[j] for x in times)
            self._stop_requested = any(x[3] for x in times)  # Ctrl-C on any rank stops all at this step
        if driver and self.eval_source is not None and step % cfg.eval.interval == 0:
            self._rollout_phase()
            t_eval = time.perf_counter()
            metrics.update(self._evaluate(step))
            metrics["time_eval_s"] = time.perf_counter() - t_eval
        t_total = time.perf_counter() - t_step
        metrics["time_step_s"] = t_total
        metrics["tokens_per_s"] = gen_tokens / max(t_total, 1e-9)
        if not driver:
            return metrics, []
        logged = [{"step": step, "prompt_id": prompts[r.prompt_index].id, "sample": r.sample_index,
                   "response": texts[i], "answer": prompts[r.prompt_index].answer, "extracted": rewards[i].extracted,
                   "reward": rewards[i].reward, "score": rewards[i].score, "correct": rewards[i].correct,
                   "advantage": float(adv[i]),
                   **({"reward_error": f"{rewards[i].error_type}: {rewards[i].error}"} if rewards[i].error_type else {})}
                  for i, r in enumerate(results[:cfg.logging.log_samples])]
        return metrics, logged

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> Path:
        """Write ``CKPT_DIR/step_NNNNNN`` (engine + loop state) and prune to ``checkpoint.keep``."""
        path = self.ckpt_dir / f"step_{step:06d}"
        if self.roles.is_driver:
            path.mkdir(parents=True, exist_ok=True)
            (path / LOOP_STATE_FILE).unlink(missing_ok=True)  # incomplete until rewritten below
        if self.roles.distributed:
            import torch.distributed as dist

            dist.barrier()
        self.engine.save(path / "engine")  # collective: every rank writes its shards
        if not self.roles.is_driver:
            return path
        state = {"step": step, "sampler": self.sampler.state_dict(), "engine_step": self.engine.step,
                 "config": self.cfg.to_dict(), "world_size": self.roles.world_size}
        atomic_write(path / LOOP_STATE_FILE, json.dumps(state, indent=2) + "\n")
        keep = self.cfg.checkpoint.keep
        if keep:
            for _, old in list_checkpoints(self.ckpt_dir)[:-keep]:
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
        return path

    def _resume_point(self) -> int:
        found = list_checkpoints(self.ckpt_dir)
        if not found:  # it died before its first checkpoint: the same run again from the start
            from ferrule.rl.metrics import METRICS_FILE, read_metrics

            logged = read_metrics(self.run_dir / METRICS_FILE)
            self._log(f"checkpoint.resume: no complete checkpoint in {self.ckpt_dir} yet; restarting the run at step "
                      f"0" + (f" (its {len(logged)} logged steps are replaced)" if logged else ""))
            return 0
        step, path = found[-1]
        state = json.loads((path / LOOP_STATE_FILE).read_text())
        diffs = config_differences(state.get("config", {}), self.cfg.to_dict())
        if diffs:
            raise ConfigError(diffs + ["resume must keep the data, model, rollout and algorithm settings of the "
                                       "checkpointed run (only train.steps, train.colocate, checkpoint.*, eval.*, logging.* and "
                                       "parallel.* may change); or start a new logging.run_dir"], origin=str(path))
        try:  # before the engine loads: a data set that changed size or order cannot resume
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as exc:
            raise ConfigError([f"{exc} (the training data changed since the checkpoint: restore it, or start a "
                               "new logging.run_dir)"], origin=str(path)) from None
        from ferrule.lora.checkpoint import LoraLayoutError
        from ferrule.megatron.checkpoint import CheckpointMismatchError

        try:
            engine_state = self.engine.load(path / "engine")
        except LoraLayoutError as exc:  # the adapter's Adam state is per rank: only the DP size may change
            raise ConfigError([f"parallel: {exc} For ferrule train: resume this LoRA run with the checkpoint's "
                               f"parallel.* and {state.get('world_size')} ranks, or start a new run"],
                              origin=str(path)) from None
        except CheckpointMismatchError as exc:  # e.g. MoE Adam state across ep=1 / ep>1
            raise ConfigError([f"checkpoint.resume: {exc}"], origin=str(path)) from None
        self._log(f"resumed from {path} (step {step}, optimizer step {self.engine.step})")
        changed = engine_state.get("settings_changed") or {}
        if changed:  # e.g. train.steps grew: the decay horizon is re-planned, never silently kept
            self._log("optimizer settings differ from the checkpoint; this config's are used from step "
                      f"{self.engine.step} on: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
        return int(step)

    def _truncate_samples(self, step: int) -> None:
        from ferrule.rl.metrics import read_run_log

        path = self.run_dir / SAMPLES_FILE
        if path.exists():  # a torn last line is dropped; a damaged one elsewhere is refused (RunLogError)
            keep = [e for e in read_run_log(path, order="nondecreasing") if e["step"] <= step]
            atomic_write(path, "".join(json.dumps(e) + "\n" for e in keep))

    # ------------------------------------------------------------------ the run
    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint (``checkpoint.save_on_interrupt``) and return."""
        self._stop_requested = True

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._stop_requested:
            raise KeyboardInterrupt
        self._stop_requested = True
        self._log("\nCtrl-C: finishing the current step, then saving a checkpoint and exiting "
                  "(press Ctrl-C again to abort without saving)")

    def run(self, *, stop_after: int | None = None) -> RunResult:
        """Run (or resume) the loop up to ``train.steps``; then :meth:`close` (also on an error).

        Args:
            stop_after: stop once this many steps are complete, as if Ctrl-C had been pressed
                (checkpoint saved when enabled); for tests and time-boxed runs.

        Returns:
            :class:`RunResult`.
        """
        try:
            return self._run(stop_after)
        finally:
            self.close()

    def close(self) -> None:
        """Stop an SGLang server that this trainer launched (``rollout.engine: sglang``) and release the
        run folder's lock; idempotent."""
        sglang_rollout.release_rollout_engine(getattr(self, "rollout", None))
        unlock_run_dir(getattr(self, "_run_lock", None))
        self._run_lock = None

    def _run(self, stop_after: int | None) -> RunResult:
        import threading

        from ferrule.rl.metrics import MetricsLogger, StepProgress

        cfg = self.cfg
        self.setup()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = self._resume_point() if cfg.checkpoint.resume else 0
        driver = self.roles.is_driver
        if driver:  # metrics, samples and the resolved config come from global rank 0 only
            try:
                logger = MetricsLogger(self.run_dir, resume_step=start if cfg.checkpoint.resume else None,
                                       tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                       wandb_project=cfg.logging.wandb_project, config=cfg.to_dict())
            except FileExistsError as exc:
                raise ConfigError([f"logging.run_dir: {exc}"]) from None
            self._truncate_samples(start)
            cfg.dump(self.run_dir)
        else:
            logger = _NoLogger()
        t_sync = self._sync()  # the rollout engine serves exactly the train engine's weights from step 1 on
        self._log(f"initial weight sync {t_sync:.2f} s{' (verified equal)' if self.check_equal else ''}; "
                  f"steps {start + 1}..{cfg.train.steps}, run dir {self.run_dir}")
        old_handler = None
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, self._on_sigint)
        logged: list[dict[str, Any]] = []
        ckpt = None
        step = start
        interrupted = False
        try:
            with logger, StepProgress(cfg.train.steps, start, enabled=cfg.logging.progress and driver,
                                      console=self.console) as bar:
                if start == 0 and self.eval_source is not None and driver:
                    self._rollout_phase()
                    logged.append(logger.log(0, self._evaluate(0)))
                    self._log_eval(0, logged[-1])
                    bar.restart_clock()
                while step < cfg.train.steps:
                    step += 1
                    metrics, samples = self.train_step(step)
                    logged.append(logger.log(step, metrics))
                    if "eval_accuracy" in metrics:
                        self._log_eval(step, metrics)
                    if samples and driver:
                        with open(self.run_dir / SAMPLES_FILE, "a") as f:
                            f.writelines(json.dumps(s) + "\n" for s in samples)
                    bar.update(step, metrics)
                    stop = self._stop_requested or (stop_after is not None and step >= stop_after)
                    last = step == cfg.train.steps
                    if cfg.checkpoint.enabled and (step % cfg.checkpoint.interval == 0 or last or
                                                   (stop and cfg.checkpoint.save_on_interrupt)):
                        ckpt = self.save_checkpoint(step)
                    if stop and not last:
                        interrupted = True
                        break
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
        plot = None
        if cfg.logging.plot_at_end and step > 0 and driver:
            from ferrule.rl.plot import plot_run

            plot = plot_run(self.run_dir)
        if interrupted:
            self._log(f"stopped after step {step}" + (f"; resume with --resume (checkpoint {ckpt})" if ckpt else ""))
        return RunResult(run_dir=self.run_dir, start_step=start, last_step=step, interrupted=interrupted,
                         checkpoint=ckpt, plot=plot, metrics=logged)


class _NoLogger:
    """The metrics logger of ranks other than 0: returns the entry, writes nothing."""

    def __enter__(self) -> "_NoLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"step": step, **metrics}


def train(cfg: RLConfig, *, check_weight_update_equal: bool = False, stop_after: int | None = None,
          console: Any = None) -> RunResult:
    """Build a :class:`GRPOTrainer` for ``cfg`` and run it (see :meth:`GRPOTrainer.run`)."""
    return GRPOTrainer(cfg, check_weight_update_equal=check_weight_update_equal, console=console).run(
        stop_after=stop_after)
