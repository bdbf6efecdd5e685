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

Each step is a stage module of :mod:`ferrule.rl.stages` (rollout, score, advantages, train,
sync, record) passing typed records (:mod:`ferrule.rl.records`): :meth:`GRPOTrainer.produce` (rollout,
score, dynamic sampling) makes a :class:`~ferrule.rl.records.RolloutBatch`, :meth:`GRPOTrainer.learn`
(advantages, train, sync, record) consumes it through a :class:`~ferrule.rl.records.StepRecord`;
:meth:`GRPOTrainer.train_step` is the two in order, and a schedule (:mod:`ferrule.rl.schedules`,
``train.schedule``) decides when each runs (the rollout of a later step in a thread: one-step-off,
asynchronous).

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
drives an SGLang server and runs every shard (:mod:`ferrule.rl.rollout_engine`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ferrule import envs
from ferrule.rl import build
from ferrule.rl import distributed as rl_dist
from ferrule.rl import rollout_engine
from ferrule.fs.run_layout import LOOP_STATE_FILE, list_checkpoints
from ferrule.rl.checkpoints import RESUME_MUTABLE, config_differences
from ferrule.rl.config_schema import RLConfig
from ferrule.rl.config_types import ConfigError
from ferrule.rl.driver import RunDriver, RunResult
from ferrule.rl.run_checks import check_supported, lock_run_dir, preflight, unlock_run_dir
from ferrule.rl.seeds import rollout_seed
from ferrule.rl.records import RolloutBatch, StepRecord, max_staleness, staleness_of
from ferrule.rl.stages import advantages, checkpoint, dynamic_sampling, record, rollout
from ferrule.rl.stages import train as train_stage
from ferrule.rl.stages.record import SAMPLES_FILE
from ferrule.rl.stages.rollout import prompt_token_ids
from ferrule.rl.stages.score import Scorer, check_reward_functions
from ferrule.rl.stages.sync import sync_policy
from ferrule.contract import registry
from ferrule.megatron.parallel import ParallelLayout, init_distributed
from ferrule.rl.colocate import Colocation, PhaseMeter, resolve_colocate
from ferrule.rl.rewards import build_reward_fn_from_config, reward_error_metrics
from ferrule.rl.tasks import PromptSampler, build_prompt_source

if TYPE_CHECKING:
    from rich.console import Console

    from ferrule.rl.engines import PolicyTrainer, ReferenceScorer
    from ferrule.rl.tasks import Prompt
    from ferrule.rollout import GenerateResult, RolloutEngine, SamplingParams
    from ferrule.sync import SyncStats

__all__ = ["GRPOTrainer", "RunResult", "train", "rollout_seed", "check_supported", "list_checkpoints",
           "config_differences", "LOOP_STATE_FILE", "RESUME_MUTABLE", "SAMPLES_FILE", "prompt_token_ids", "preflight"]


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

    #: the engines, behind the small Protocols the loop needs (:mod:`ferrule.rl.engines`); built by :meth:`setup`
    engine: PolicyTrainer
    rollout: RolloutEngine | None
    reference: ReferenceScorer | None

    def __init__(self, cfg: RLConfig, *, check_weight_update_equal: bool = False, console: Console | None = None):
        from rich.console import Console

        check_supported(cfg)
        rollout_engine.check_rollout_engine(cfg, check_weight_update_equal=check_weight_update_equal)
        cfg.check_paths()
        self._run_lock = lock_run_dir(cfg)  # a second trainer on this run folder stops here, naming this one
        try:
            preflight(cfg)
            hf_config = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
            rl_dist.check_layout(cfg, hf_config, rl_dist.launch_world_size())
            if cfg.train.schedule != "sync" and rl_dist.launch_world_size() > 1:
                raise ConfigError([f"train.schedule={cfg.train.schedule}: runs in one process only (its rollout "
                                   "thread's collectives would interleave with the trainer's); set "
                                   "train.schedule=sync under torchrun"])
        except BaseException:
            unlock_run_dir(self._run_lock)
            raise
        self.cfg = cfg
        #: only global rank 0 prints (the others' errors still reach stderr through the CLI)
        self._quiet = envs.rank() != 0
        self.roles = rl_dist.RankRoles(0, 1, (0,))
        self.check_equal = check_weight_update_equal
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self._stop_requested = False
        self._stop_at_step_end = False  # the stop request agreed by every rank at the end of a step (distributed)
        self._stop_signal: int | None = None
        #: :func:`ferrule.rl.model_identity.model_files` of model.hf_dir at the run's start (checkpoints
        #: record it, --resume compares it); filled by the driver's run before the model loads
        self.model_files: dict | None = None
        self._setup_done = False
        self.score = Scorer(cfg.reward.failure_reward, self._log)
        self.last_sync: SyncStats | None = None  # of the latest weight sync
        #: held around every use of the rollout engine (generate, sync, evaluation): an asynchronous
        #: schedule's rollout thread and the trainer's sync never touch it at once
        self.rollout_lock = threading.RLock()
        self.synced_version = 0  # the train engine's optimizer steps when the rollout engine got its weights
        #: called with the step before / after each step's weight sync (the asynchronous schedule: the sync
        #: waits for the rollouts due on the older weights, the rollout thread waits for the sync)
        self.before_sync: Callable[[int], None] | None = None
        self.on_sync: Callable[[int], None] | None = None
        self._rollout_seconds = 0.0  # this rank's generation time of the latest produce
        self._trained_sampler_state: dict | None = None  # the sampler state of the latest trained batch (driver)

    # ------------------------------------------------------------------ the run (ferrule.rl.driver)
    def run(self, *, stop_after: int | None = None) -> RunResult:
        """Run (or resume) the loop up to ``train.steps`` (:meth:`ferrule.rl.driver.RunDriver.run`);
        then :meth:`close` (also on an error). ``stop_after``: stop once this many steps are complete,
        as if Ctrl-C had been pressed (checkpoint saved when enabled)."""
        return RunDriver(self).run(stop_after=stop_after)

    def request_stop(self) -> None:
        """Finish the current step, save a checkpoint (``checkpoint.save_on_interrupt``) and return."""
        self._stop_requested = True

    def close(self) -> None:
        """Stop an SGLang server that this trainer launched (``rollout.engine: sglang``) and release the
        run folder's lock; idempotent."""
        rollout_engine.release_rollout_engine(getattr(self, "rollout", None))
        unlock_run_dir(getattr(self, "_run_lock", None))
        self._run_lock = None

    def _log(self, text: str) -> None:
        if not self._quiet:
            self.console.print(text, markup=False, highlight=False)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build prompt sources, reward function, rollout engine, template, train engine (idempotent)."""
        if self._setup_done:
            return
        import torch
        import transformers  # noqa: F401  (modeling code before megatron's CPU patches)
        from transformers import GenerationMixin  # noqa: F401

        from ferrule.megatron.device import get_backend

        cfg, t0 = self.cfg, time.perf_counter()
        dtype = getattr(torch, cfg.model.dtype)
        self._build_data()
        hf_config = json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
        self.family = cfg.model.family or registry.family_for_hf_config(hf_config).name
        # the rollout model's modeling module is imported before megatron's CPU patches (get_backend)
        # replace torch.cuda.Stream, as when the rollout engine was built first
        registry.hf_model_class(hf_config)
        # the process group first (torchrun env or one local process), with the config's timeout
        layout = rl_dist.layout_of(cfg)
        init_distributed(layout, seed=cfg.train.seed, timeout_s=cfg.parallel.timeout_s)
        self.engine = build.build_train_engine(cfg, layout, dtype)
        self.roles = rl_dist.rank_roles(driver_only_rollout=cfg.rollout.engine == "sglang")
        # the embedded engine runs where training runs: the GPU when there is one, else the CPU; one
        # per data-parallel replica, on its first rank (sglang: the driver's client of the server)
        self.rollout = self.tokenizer = None
        self.template, self.stop_ids, self.stop_strings = None, (), ()
        if self.roles.replica is not None:
            self.rollout, self.tokenizer = rollout_engine.build_rollout_engine(cfg, dtype=dtype,
                                                                               device=get_backend().device)
        if self.roles.is_driver:
            self.template = build.chat_template(cfg, self.family, self.tokenizer)
            self.stop_ids, self.stop_strings = build.stop_tokens(cfg, self.template, self.tokenizer)
            if self.agent is not None:
                self.agent.bind(self.family, self.template, self.tokenizer, self.stop_ids)
        if self.agent is not None and self.roles.distributed:
            raise ConfigError(["agent.environment: multi-turn episodes run on one process for now; launch without "
                               "torchrun (parallel.tp = pp = ep = 1)"])
        self._setup_colocation()
        self.towers = registry.get_towers(self.family)
        self.prompts = rollout.PromptRenderer(self.template, self.tokenizer, self.towers, self.engine.hf_config,
                                              cfg.data)
        self._media_cache = self.prompts.media_cache
        self.reference = None
        if cfg.algorithm.kl_coef > 0 and self.roles.is_driver:
            from ferrule.rl.reference import ReferencePolicy

            self.reference = ReferencePolicy(cfg.model.hf_dir, dtype=dtype)
        if self.roles.is_driver:
            self.prompts.check_all_media({"train": self.source, "eval": self.eval_source})
            build.check_media_support(cfg, bool(self._media_cache), self.reference)
            self._log(f"ferrule train: family {self.family}, template {self.template.name}, "
                      f"{len(self.source)} prompts ({self.source.name}){build.layout_note(cfg, self.roles)}, "
                      f"setup {time.perf_counter() - t0:.1f} s")
            self._log(build.engine_settings_report(self.engine, self.rollout, cfg))
        self._setup_done = True

    def _build_data(self) -> None:
        """Prompt sources (train, eval), the resumable sampler and the reward functions."""
        cfg = self.cfg
        self.agent = None
        if cfg.agent.environment:  # multi-turn episodes: the environment supplies the items and the rewards
            from ferrule.rl.envs.launcher import AgentRollout

            self.agent = AgentRollout(cfg)
            self.source = self.agent.source
            self.sampler = PromptSampler(self.source, cfg.train.seed, cfg.data.shuffle)
            self.reward_fn = self.eval_source = self.eval_reward_fn = None
            return
        self.source = build_prompt_source(cfg.data)
        self.sampler = PromptSampler(self.source, cfg.train.seed, cfg.data.shuffle)
        self.reward_fn = build_reward_fn_from_config(cfg, self.source)
        self.eval_source = build_prompt_source(cfg.data, eval_cfg=cfg.eval) if cfg.eval.interval > 0 else None
        self.eval_reward_fn = (build_reward_fn_from_config(cfg, self.eval_source)
                               if self.eval_source is not None else None)
        if cfg.reward.check_reference:  # a broken reward function is refused here, not at step 1
            check_reward_functions(cfg, ((self.reward_fn, self.source), (self.eval_reward_fn, self.eval_source)),
                                   self._log)

    def _setup_colocation(self) -> None:
        """``train.colocate`` (:mod:`ferrule.rl.colocate`): decide, and keep the phase meter."""
        self.meter = PhaseMeter()
        try:
            setting = self.cfg.train.colocate if self.cfg.train.schedule == "sync" else False  # overlap: no turns
            on, why = resolve_colocate(setting, self.engine, self.rollout, self.cfg, distributed=self.roles.distributed)
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
        self.colocation = Colocation(self.engine, self.rollout, self.meter) if on else None
        if self.cfg.train.colocate is not False:
            self._log(why)

    # ------------------------------------------------------------------ stages bound to this run
    def _rollout_phase(self) -> None:
        """Colocated: the train engine offloaded, the rollout engine awake (no-op otherwise)."""
        if self.colocation is not None:
            self.colocation.rollout_phase()

    def _train_phase(self) -> None:
        """Colocated: the rollout engine asleep, the train engine onloaded (no-op otherwise)."""
        if self.colocation is not None:
            self.colocation.train_phase()

    def _media_of(self, prompt: Prompt) -> dict | None:
        return rollout.media_of(self._media_cache, prompt)

    def _sampling_params(self, *, n: int, temperature: float, max_new_tokens: int, seed: int | None,
                         routes: bool = False) -> SamplingParams:
        return rollout.sampling_params(self.cfg, self.stop_ids, self.stop_strings, n=n, temperature=temperature,
                                       max_new_tokens=max_new_tokens, seed=seed, routes=routes)

    def _rollout(self, step: int, prompts: list[Prompt] | None = None, prompt_ids: list[tuple[int, ...]] | None = None,
                 round_: int = 0) -> list[GenerateResult] | None:
        """The step's rollout (:func:`ferrule.rl.stages.rollout.generate_rollouts`); collective."""
        ro = self.cfg.rollout
        params = (self._sampling_params(n=ro.n_samples_per_prompt, temperature=ro.temperature,
                                        max_new_tokens=ro.max_new_tokens, seed=None,
                                        routes=self.cfg.algorithm.routing_replay) if self.roles.is_driver else None)
        return rollout.generate_rollouts(self.roles, self.rollout, params, seed=self.cfg.train.seed,
                                         prompts_per_shard=ro.prompts_per_shard, step=step, prompts=prompts,
                                         prompt_ids=prompt_ids, media=self._media_of, round_=round_)

    def _rollout_round(self, step: int, round_: int) -> RolloutBatch | None:
        """One rollout of ``train.prompts_per_step`` new prompts, decoded and scored on the driver
        (None elsewhere); collective."""
        prompts = prompt_ids = state = None
        if self.roles.is_driver:
            prompts = self.sampler.next_batch(self.cfg.train.prompts_per_step)
            state = self.sampler.state_dict()
            prompt_ids = [self.prompts.ids(p, "train") for p in prompts]
        with self.rollout_lock:
            version = self.synced_version
            results = self._rollout(step, prompts, prompt_ids, round_)
        if not self.roles.is_driver:
            return None
        texts = rollout.decode(self.tokenizer, results)
        rewards = self.score(self.reward_fn, texts, [prompts[r.prompt_index] for r in results],
                             f"step {step}" if round_ == 0 else f"step {step} (refill {round_})")
        return RolloutBatch(prompts, prompt_ids, [self._media_of(p) for p in prompts], results, texts, rewards,
                            weight_version=version, sampler_state=state)

    def _agent_round(self, step: int) -> RolloutBatch:
        """One step of multi-turn episodes (:mod:`ferrule.rl.envs.launcher`; one process, no shards): the
        batch carries the episodes' samples and rewards (``agent``) instead of engine results."""
        cfg = self.cfg
        prompts = self.sampler.next_batch(cfg.train.prompts_per_step)
        state = self.sampler.state_dict()
        params = self._sampling_params(n=1, temperature=cfg.rollout.temperature,
                                       max_new_tokens=cfg.rollout.max_new_tokens, seed=None)
        with self.rollout_lock:
            version = self.synced_version
            agent_step = self.agent.run_step(self.rollout, prompts, params, step, self._log)
        return RolloutBatch(prompts, agent_step.prompt_ids, [None] * len(prompts), [], [], agent_step.rewards,
                            weight_version=version, sampler_state=state, agent=agent_step)

    def produce(self, step: int) -> RolloutBatch | None:
        """Stages 1-2 (rollout, score): the step's scored rollout on the driver (None elsewhere),
        with ``algorithm.dynamic_sampling`` over several rounds
        (:mod:`ferrule.rl.stages.dynamic_sampling`); collective (every rank runs the same rounds)."""
        a, t = self.cfg.algorithm, time.perf_counter()
        if not a.dynamic_sampling:  # (config checks refuse dynamic sampling with agent episodes)
            batch = self._agent_round(step) if self.agent is not None else self._rollout_round(step, 0)
            self._rollout_seconds = time.perf_counter() - t
            return None if batch is None else dataclasses.replace(batch, seconds=self._rollout_seconds)
        selector, last = dynamic_sampling.GroupSelector(self.cfg.train.prompts_per_step), None
        for k in range(a.dynamic_sampling_max_rounds):
            last = self._rollout_round(step, k)
            full = self.roles.is_driver and selector.add(last, dynamic_sampling.informative_groups(
                last, a, self.cfg.rollout.max_new_tokens))
            if self.roles.distributed:
                full = rl_dist.broadcast_object(full)
            if full:
                break
        self._rollout_seconds = time.perf_counter() - t
        if not self.roles.is_driver:
            return None
        return dataclasses.replace(selector.batch(), seconds=self._rollout_seconds, selection=selector.metrics(),
                                   sampler_state=last.sampler_state)

    def _sync(self) -> float:
        """Weights (or the LoRA adapter) to every rollout engine (:mod:`ferrule.rl.stages.sync`)."""
        with self.rollout_lock:
            self.last_sync, seconds = sync_policy(self.engine, self.rollout, self.roles,
                                                  check_equal=self.check_equal, settings=self.cfg.weight_sync)
            self.synced_version = self.engine.step
        return seconds

    def _evaluate(self, step: int) -> dict[str, float]:
        """Greedy-or-sampled answers to every held-out prompt, scored (driver only)."""
        e = self.cfg.eval
        prompts = [self.eval_source[i] for i in range(len(self.eval_source))]
        ids = [self.prompts.ids(p, "eval") for p in prompts]
        params = self._sampling_params(n=1, temperature=e.temperature,
                                       max_new_tokens=e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                       seed=rollout_seed(self.cfg.train.seed, step, "eval"))
        with self.rollout_lock:
            results = rollout.generate(self.rollout, params, prompts, ids, self._media_of)
        texts = rollout.decode(self.tokenizer, results)
        rewards = self.score(self.eval_reward_fn, texts, prompts, f"evaluation at step {step}")
        out = {"eval_reward_mean": float(np.mean([r.reward for r in rewards])),
               "eval_accuracy": float(np.mean([r.correct for r in rewards]))}
        out.update(reward_error_metrics(rewards, prefix="eval_"))
        return out

    def _log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        errors = metrics.get("eval_reward_errors") or 0
        self._log(f"eval at step {step}: accuracy {metrics['eval_accuracy']:.3f}, reward "
                  f"{metrics['eval_reward_mean']:.3f} on {len(self.eval_source)} held-out prompts"
                  + (f" ({errors} reward errors)" if errors else ""))

    # ------------------------------------------------------------------ one step: the algorithm
    def train_step(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Run step ``step`` (1-based) on the synchronous schedule: :meth:`produce` with the rollout
        engine awake, then :meth:`learn`; return ``(metrics, logged samples)``. Collective."""
        t_step = time.perf_counter()
        record.reset_peak_memory()
        self._rollout_phase()
        self.meter.record_now("memory_offloaded_bytes")
        self.meter.start()
        batch = self.produce(step)
        self.meter.stop("rollout")
        return self.learn(step, batch, t_step)

    def learn(self, step: int, batch: RolloutBatch | None, t_step: float) -> tuple[dict[str, Any], list[dict]]:
        """Stages 3-6 on the driver's ``batch`` (broadcast to every rank): advantages, train, sync,
        record. Returns ``(metrics, logged samples)``. Collective."""
        self._train_phase()
        self.meter.start()
        if self.roles.distributed:  # every rank builds the same train batch from the driver's rollout
            batch = rl_dist.broadcast_object(batch)
        rec = self._train_on(step, batch)
        self._trained_sampler_state = batch.sampler_state
        self.meter.stop("train")
        # 5. sync: the new policy to every rollout engine (colocated: into its host copies)
        if self.before_sync is not None:
            self.before_sync(step)
        self.meter.start()
        t_sync = self._sync()
        self.meter.stop("sync")
        if self.on_sync is not None:
            self.on_sync(step)
        if self.colocation is not None:
            self.colocation.offload_train()
        # 6. record: metrics (evaluation on its interval) and the logged samples
        metrics = self._step_metrics(rec, t_sync=t_sync)
        t_total = time.perf_counter() - t_step
        metrics["time_step_s"] = t_total
        metrics["tokens_per_s"] = sum(len(s.response_ids) for s in rec.samples) / max(t_total, 1e-9)
        if not self.roles.is_driver:
            return metrics, []
        if batch.agent is not None:
            return metrics, batch.agent.logged
        return metrics, record.logged_samples(step, batch.prompts, batch.results, batch.texts, batch.rewards,
                                              rec.advantages.values, self.cfg.logging.log_samples)

    def _train_on(self, step: int, batch: RolloutBatch) -> StepRecord:
        """Stages 3-4: samples, group-normalized advantages (samples older than ``train.max_staleness``
        left out), old / reference logprobs, ``forward_backward`` + ``optim_step`` per mini-batch."""
        import torch

        cfg = self.cfg
        samples = (batch.agent.samples if batch.agent is not None else
                   advantages.build_samples(batch.prompt_ids, batch.results, batch.media))
        staleness = staleness_of(batch, self.engine.step, cfg.train.optim_steps_per_rollout, len(samples))
        stale = [s > max_staleness(cfg.train) for s in staleness]
        adv = advantages.group_advantages(samples, batch.rewards, cfg.algorithm, cfg.rollout.n_samples_per_prompt,
                                          cfg.rollout.max_new_tokens, exclude=stale)
        rollout_lp = [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
        outcome = train_stage.train_policy(self.engine, samples, adv.values, rollout_lp, cfg=cfg,
                                           reference=self.reference, roles=self.roles,
                                           num_groups=len(batch.prompt_ids), trainable=adv.trainable)
        if batch.agent is not None:  # logprob metrics over the model's tokens only
            rollout_lp, outcome.trainer_logprobs = batch.agent.model_token_logprobs(rollout_lp,
                                                                                    outcome.trainer_logprobs)
        return StepRecord(step, batch, samples, adv, rollout_lp, outcome, staleness, sum(stale))

    def _step_metrics(self, rec: StepRecord, *, t_sync: float) -> dict[str, Any]:
        """The step's metrics (:mod:`ferrule.rl.stages.record`), the per-rank timings (collective when
        distributed; a stop requested on any rank stops all) and the evaluation on its interval."""
        n, t_train, step = self.cfg.rollout.n_samples_per_prompt, rec.outcome.seconds, rec.step
        t_rollout = rec.batch.seconds
        metrics = record.rollout_step_metrics(rec.batch.rewards, rec.samples, n)
        metrics.update(record.train_step_metrics(rec.outcome, rec.rollout_logprobs, rec.advantages, n,
                                                 self.cfg.algorithm.use_tis))
        if self.towers:
            metrics.update(record.media_metrics(self.towers, rec.batch.media))
        metrics.update(record.throughput_metrics(rec.samples, t_rollout=t_rollout, t_train=t_train, t_sync=t_sync))
        metrics.update({"mfu": record.train_mfu(self.engine, rec.samples, t_train, rec.outcome.need_old),
                        "weights_version": self.engine.step,
                        "epoch": (rec.batch.sampler_state or {}).get("epoch", self.sampler.epoch),
                        "sync_bytes": self.last_sync.bytes})
        metrics.update(record.memory_metrics())
        metrics.update(self.meter.pop())
        metrics.update(record.sync_memory_metrics(self.last_sync))
        metrics.update(record.version_metrics(rec))
        metrics.update(rec.batch.selection)
        if rec.batch.agent is not None:
            metrics.update(rec.batch.agent.metrics)
        if self.roles.distributed:  # per-rank timings: the slowest and fastest rank of each phase
            times = rl_dist.all_gather_objects((self._rollout_seconds, t_train, t_sync, self._stop_requested))
            for j, key in enumerate(("time_rollout_s", "time_train_s", "time_sync_s")):
                metrics[key + "_max"] = max(x[j] for x in times)
                metrics[key + "_min"] = min(x[j] for x in times)
            self._stop_requested = any(x[3] for x in times)  # a stop signal on any rank stops all at this step
            self._stop_at_step_end = self._stop_requested  # what the driver reads: one value on every rank
        if self.roles.is_driver and self.eval_source is not None and step % self.cfg.eval.interval == 0:
            self._rollout_phase()
            t_eval = time.perf_counter()
            metrics.update(self._evaluate(step))
            metrics["time_eval_s"] = time.perf_counter() - t_eval
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> Path:
        """Write ``CKPT_DIR/step_NNNNNN`` (engine + loop state) and prune to ``checkpoint.keep``."""
        # the sampler's position after the trained step's prompts (an asynchronous schedule drew further)
        sampler = self.sampler if self._trained_sampler_state is None else _SamplerState(self._trained_sampler_state)
        return checkpoint.save_checkpoint(self.engine, self.roles, self.ckpt_dir, step, sampler=sampler,
                                          cfg=self.cfg, model_files=self.model_files)

    def _resume_point(self) -> int:
        return checkpoint.resume_point(self.engine, self.sampler, self.cfg, self.ckpt_dir, self._log,
                                       model_files=self.model_files)

class _SamplerState:
    """A recorded :meth:`PromptSampler.state_dict` in the sampler's place (checkpoints read only that)."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return dict(self._state)


def train(cfg: RLConfig, *, check_weight_update_equal: bool = False, stop_after: int | None = None,
          console: Console | None = None) -> RunResult:
    """Build a :class:`GRPOTrainer` for ``cfg`` and run it (see :meth:`GRPOTrainer.run`)."""
    return GRPOTrainer(cfg, check_weight_update_equal=check_weight_update_equal, console=console).run(
        stop_after=stop_after)
