"""The sections of the ``ferrule train`` config as frozen dataclasses (:class:`RLConfig`), each key
with its default, unit and description in its field metadata.

Loading, overrides and validation are in :mod:`ferrule.rl.config` (which re-exports every name
here) and :mod:`ferrule.rl.config_checks`; both import this module downward.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ferrule.engine_settings import RolloutEngineSettings, TrainEngineSettings, WeightSyncSettings
from ferrule.fs.util import apply_default_mode
from ferrule.lora.settings import MAX_LORA_RANK
from ferrule.rl.config_types import ConfigError
from ferrule.fs.run_layout import CONFIG_FILE_NAME

def _f(default: Any, doc: str, unit: str = "") -> Any:
    md = {"doc": doc, "unit": unit}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy checkpoint."""

    hf_dir: str = _f("", "HF checkpoint folder (config.json, safetensors, tokenizer). Required.", "path")
    torch_dist_dir: str = _f("", "Megatron torch_dist checkpoint with the same weights (weights only "
                                 "are loaded); empty: the train engine loads hf_dir directly.", "path")
    family: str = _f("", "Model family override; empty: resolved from config.json model_type by the "
                         "plugin registry.")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "Parameter dtype of the train and rollout engines (bfloat16 recommended on GPU).")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Megatron parallel layout of the train engine."""

    tp: int = _f(1, "Tensor-model-parallel size (Megatron tensor_model_parallel_size).", "ranks")
    pp: int = _f(1, "Pipeline-model-parallel size (Megatron pipeline_model_parallel_size).", "ranks")
    ep: int = _f(1, "Expert-model-parallel size for MoE families (Megatron expert_model_parallel_size).",
                 "ranks")
    etp: int = _f(0, "Expert-tensor-parallel size for MoE families (Megatron expert_tensor_parallel_size); "
                     "0: megatron's default, = tp. MoE families with biases (gpt-oss) need 1.", "ranks")
    vpp: int = _f(1, "Virtual pipeline stages per pipeline rank (Megatron "
                     "virtual_pipeline_model_parallel_size); only 1 (no interleaving) is supported.", "stages")
    timeout_s: float = _f(600.0, "Collective timeout: a rank that waits this long in a collective (another "
                                 "rank hung or died) raises and the job stops; covers the longest rank-0-only "
                                 "phase (evaluation, checkpoint pruning).", "seconds")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling of responses by the rollout engine."""

    engine: Literal["embedded", "sglang"] = _f(
        "embedded", "Rollout engine: in-process transformers model, or an SGLang server.")
    temperature: float = _f(1.0, "Sampling temperature; GRPO needs > 0 so that a group's samples differ.")
    top_p: float = _f(1.0, "Nucleus sampling mass, in (0, 1]; 1 disables.")
    top_k: int = _f(-1, "Top-k sampling; -1 disables.", "tokens")
    max_new_tokens: int = _f(256, "Response length cap; longer responses are truncated.", "tokens")
    n_samples_per_prompt: int = _f(8, "Group size: responses sampled per prompt (GRPO group).", "samples")
    extra_stop_tokens: list[str] = _f([], "Stop tokens added to the chat template's own stop tokens.")
    prompts_per_shard: int = _f(0, "Prompts per rollout shard: one generate call with its own sampling seed, "
                                   "run by one data-parallel replica; the same value gives the same samples at "
                                   "any world size. 0: ceil(prompts_per_step / data-parallel replicas).",
                                "prompts")
    sglang_url: str = _f("", "URL of a running SGLang server (engine=sglang); empty: launch one.", "URL")
    sglang_args: dict[str, Any] = _f({}, "Extra flags of a server the loop launches (engine=sglang, no sglang_url): "
                                         "key -> --key-with-dashes value; true: a bare switch, false: left out, a "
                                         "list: several values, a dict: JSON; e.g. {mem_fraction_static: 0.7, "
                                         "tp_size: 2}. model_path / host / port are the loop's.")
    sglang_weight_transport: Literal["tensor", "disk"] = _f(
        "tensor", "How the weight sync reaches the SGLang server: tensor (/update_weights_from_tensor with CUDA IPC "
                  "handles: the server on the driver's host, sglang importable in the trainer, the train engine on "
                  "a GPU) or disk (each bucket written as safetensors under RUN_DIR/sglang_weights and loaded with "
                  "/update_weights_from_disk; the server must read that folder).")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt source and prompt rendering (see ferrule.rl.tasks)."""

    task: str = _f("", "reasoning-gym dataset name (e.g. basic_arithmetic, countdown). Set exactly one "
                       "of task / jsonl_path.")
    task_kwargs: dict[str, Any] = _f({}, "Keyword arguments of the reasoning-gym dataset config "
                                         "(e.g. {max_terms: 2, max_digits: 1}).")
    size: int = _f(10000, "Number of generated reasoning-gym items (one epoch).", "prompts")
    seed: int = _f(1, "reasoning-gym generation seed (which items exist).")
    jsonl_path: str = _f("", "JSONL prompt file (one {prompt|messages, answer, id?, metadata?} object "
                             "per line).", "path")
    shuffle: bool = _f(True, "Shuffle prompt order every epoch (permutation from train.seed and epoch).")
    system_prompt_preset: str = _f("direct", "reasoning-gym system prompt name (default, direct, simple, "
                                             "DeepSeekZero, chain_of_draft) or none.")
    system_prompt: str = _f("", "Literal system prompt; when non-empty it replaces the preset.")
    prompt_template: str = _f("{question}", "Python format string for the user message; the only "
                                            "field is {question}.")
    chat_template: str = _f("", "Chat template name from the plugin registry; empty: the family's default.")
    chat_template_kwargs: dict[str, Any] = _f({}, "Extra chat-template variables, passed as "
                                                  "tokenizer.apply_chat_template(**kwargs) would (e.g. "
                                                  "{enable_thinking: false} turns Qwen3 thinking off).")
    answer_extraction: Literal["answer_tag", "last_number", "last_line", "full"] = _f(
        "answer_tag", "How the answer is taken from a response: last <answer>...</answer> block, last "
                      "number, last non-empty line, or the whole stripped text.")
    max_prompt_tokens: int = _f(512, "Longest rendered prompt accepted; longer prompts are errors.", "tokens")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Reward function (see ferrule.rl.rewards)."""

    function: str = _f("task", "Builtin 'task' (the task's own verifier), 'exact_match', or a custom "
                               "'module:attr' callable(response, prompt, **kwargs).")
    kwargs: dict[str, Any] = _f({}, "Keyword arguments passed to a custom reward function.")
    format_reward: float = _f(0.0, "Added to the reward when the answer could be extracted "
                                   "(e.g. an <answer> block is present).", "reward")
    mode: Literal["task_score", "exact"] = _f(
        "task_score", "task_score: the reward is the task's own score, which may give partial credit "
                      "(basic_arithmetic scores a sign error 0.5); exact: 1 only when that score is 1, "
                      "else 0. Both the score and accuracy are logged either way.")
    failure_reward: float = _f(0.0, "Reward of a sample whose reward function raised (e.g. a verifier "
                                    "that cannot parse a junk answer); the run goes on, counting "
                                    "reward_errors, with a warning for each step where half the samples "
                                    "or more failed.", "reward")
    check_reference: bool = _f(True, "Before training, score the first prompts' reference answers (and a few "
                                     "malformed strings): a function that raises on or does not give full "
                                     "score to a reference answer, or gives it to junk, is refused. false: for "
                                     "functions that do not score against the prompt's answer.")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """Advantage estimator and policy loss (see ferrule.rl.advantages and ferrule.losses)."""

    advantage_estimator: Literal["grpo"] = _f("grpo", "Group-relative advantages (Shao et al. 2024, "
                                                      "arXiv 2402.03300).")
    grpo_std_normalization: bool = _f(True, "Divide by the group's reward std (GRPO); false: mean only "
                                            "(Dr. GRPO, arXiv 2503.20783).")
    advantage_eps: float = _f(1e-6, "Added to the group std before dividing.", "reward")
    loss_aggregation: Literal["token_mean", "sample_mean", "constant"] = _f(
        "token_mean", "Per-token weights: mean over all response tokens of the batch; mean of per-sample "
                      "token means; or 1/(samples*max_new_tokens) (Dr. GRPO).")
    loss: str = _f("ppo", "Policy loss name in ferrule.losses: ppo, cispo, importance_sampling, dro, gspo.")
    eps_clip: float = _f(0.2, "PPO ratio clip below: ratio >= 1 - eps_clip.")
    eps_clip_high: float = _f(0.28, "PPO ratio clip above: ratio <= 1 + eps_clip_high (DAPO clip-higher, "
                                    "arXiv 2503.14476).")
    use_tis: bool = _f(True, "Truncated importance sampling against the rollout engine's logprobs "
                             "(train/rollout mismatch correction).")
    tis_cap: float = _f(2.0, "Upper clamp of exp(old_logprob - rollout_logprob) when use_tis.")
    tis_behaviour: Literal["untempered", "sampled"] = _f(
        "sampled", "The rollout logprob TIS divides by (use_tis). sampled (default): the logprobs of the "
                   "distribution the tokens were drawn from (at rollout.temperature != 1 the tempered policy pi_T), "
                   "so the weight pi / pi_T corrects both the rollout/train numerics and the temperature (exactly "
                   "in expectation while no weight passes tis_cap). untempered: the rollout engine's temperature-1 "
                   "logprobs, which correct only the numerics: at temperature != 1 the tokens come from pi_T while "
                   "the loss trains pi, and per position the update's expectation carries a term A_bar * (pi_T - "
                   "pi) (A_bar the token-weighted mean advantage) that flattens the policy when failing samples "
                   "carry more tokens and sharpens it when succeeding ones do. The two are the same at temperature "
                   "1. Measured (H100, 2026-12-07, docs/results.md): guess_number at temperature 0.8, 50-60 steps: "
                   "untempered peaked at reward 0.45 (step 26) and fell to 0.28 as entropy rose 1.3 -> 4.2 nats; "
                   "sampled kept rising to 0.52 (steps 51-57, entropy 1.0 -> 1.6); temperature 1 reached 0.75.")
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the frozen reference policy; 0 loads no "
                             "reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = _f(
        "k3", "KL estimator (Schulman 2020, 'Approximating KL divergence'): k1 = log r, "
              "k2 = (log r)^2 / 2, k3 = r - 1 - log r with r = p_ref / p. The loss implements k3 only.")
    entropy_coef: float = _f(0.0, "Weight c of the entropy bonus: each response token's loss gets -c * H, H the "
                                  "policy's exact entropy (nats) from the train engine's logits (this disables "
                                  "the fused logprob path on GPU: full logits are formed). 0: off.")
    overlong: Literal["keep", "mask", "penalty"] = _f(
        "keep", "Truncated responses (stopped by rollout.max_new_tokens): keep (trained like the others); mask "
                "(DAPO overlong filtering: no loss on them, and left out of their group's mean and std); penalty "
                "(DAPO soft overlong punishment: -overlong_penalty * min(1, (length - (max_new_tokens - "
                "overlong_buffer_tokens)) / overlong_buffer_tokens) added to the reward, -overlong_penalty "
                "for a truncated one).")
    overlong_buffer_tokens: int = _f(0, "overlong=penalty: the last tokens before max_new_tokens over which the "
                                        "penalty ramps from 0 to overlong_penalty (DAPO's L_cache); 0: only "
                                        "truncated responses are penalised.", "tokens")
    overlong_penalty: float = _f(1.0, "overlong=penalty: the largest penalty (DAPO: 1).", "reward")
    routing_replay: bool = _f(False, "MoE routing replay (R3, arXiv 2510.11370): the rollout engine records the "
                                     "experts each MoE layer picked per token, and the train forward routes every "
                                     "token to those (gating weights recomputed from the train router). Embedded "
                                     "rollout on its eager decode path (no CUDA graphs), tp = pp = ep = 1, MoE "
                                     "families without looped layers. Off by default for MoE families too: it "
                                     "turns the decode fast paths off (docs/train.md, \"MoE routing replay\").")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: groups whose rewards are all equal (no gradient) "
                                       "are dropped and more prompts are generated, up to "
                                       "dynamic_sampling_max_rounds rollouts per step, until prompts_per_step "
                                       "groups with a reward spread are kept.")
    dynamic_sampling_max_rounds: int = _f(3, "dynamic_sampling: rollouts (of prompts_per_step prompts each) per "
                                             "step at most, the first included; a step still short after them "
                                             "fills up with dropped groups (advantage 0, counted in "
                                             "dynamic_sampling_filled_groups).", "rollouts")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam optimizer and learning-rate schedule (Megatron names)."""

    optimizer: Literal["adam"] = _f("adam", "Optimizer (Megatron's Adam with decoupled weight decay).")
    lr: float = _f(1e-6, "Peak learning rate.", "1/step")
    min_lr: float = _f(0.0, "Final learning rate of a decaying schedule.", "1/step")
    lr_warmup_steps: int = _f(0, "Linear warmup from 0 to lr.", "steps")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f("constant", "Schedule after warmup.")
    lr_decay_steps: int = _f(0, "Steps over which lr decays to min_lr; 0: train.steps.", "steps")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.98, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    weight_decay: float = _f(0.0, "Decoupled weight decay.")
    clip_grad: float = _f(1.0, "Global gradient-norm clip; 0 disables.", "L2 norm")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA: train an HF PEFT-compatible adapter on the frozen base; only the adapter is synced (docs/lora.md)."""

    rank: int = _f(0, "LoRA rank r; 0: full-parameter training (no adapter). > 0 trains lora_A [r, in] / "
                      "lora_B [out, r] on the frozen base and syncs only the adapter to the rollout engine; at most "
                      f"{MAX_LORA_RANK} (ferrule.lora.MAX_LORA_RANK).")
    alpha: float = _f(32.0, "lora_alpha; the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) "
                            "with use_rslora).")
    dropout: float = _f(0.0, "Dropout on the adapter's input during training, in [0, 1); rollout never drops.")
    target_modules: Any = _f("all", "'all' (every linear a registered applier handles, lm_head excepted) or a "
                                    "list of module names, Megatron (linear_qkv, linear_proj, linear_fc1, "
                                    "linear_fc2, output_layer: experts included) or HF modules as PEFT names them "
                                    "(q_proj, ..., down_proj, lm_head: not the experts' 3-D parameters).")
    target_parameters: Any = _f([], "HF parameter paths, PEFT's target_parameters: the routed experts "
                                    "(mlp.experts.gate_up_proj, mlp.experts.down_proj) and Inkling's shared experts "
                                    "(mlp.shared_experts.gate_proj + up_proj, down_proj); empty with 'all'.")
    use_rslora: bool = _f(False, "Rank-stabilized scaling alpha / sqrt(rank) (Kalajdzievski 2023).")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Loop size and batching."""

    steps: int = _f(100, "RL steps (one rollout batch each).", "steps")
    prompts_per_step: int = _f(8, "Prompts per step; the rollout batch is prompts_per_step * "
                                  "n_samples_per_prompt sequences.", "prompts")
    optim_steps_per_rollout: int = _f(1, "Optimizer steps per rollout batch (the batch is split into this "
                                         "many mini-batches of whole groups).", "steps")
    micro_batch_tokens: int = _f(4096, "Token budget of one forward_backward micro-batch (prompt + "
                                       "response tokens).", "tokens")
    seed: int = _f(42, "Seed of data order, sampling and initialization.")
    colocate: Any = _f("auto", "Train and rollout take turns on the device (docs/train.md \"Colocation\"): each "
                               "step wakes the rollout engine, generates, puts it to sleep, onloads the train "
                               "engine, trains, syncs and offloads it. true, false, or auto: on with CUDA when "
                               "both engines would not fit at once, off on CPU. Bit-identical to false.")
    schedule: Literal["sync", "one_step_off", "async"] = _f(
        "sync", "sync: rollout, train and sync alternate (on-policy). one_step_off: step k+1's rollout is "
                "generated (by a rollout thread, on the weights of step k-1) while step k trains. async: the "
                "rollout runs up to max_staleness steps ahead of the trained weights (0: equals sync bit for "
                "bit). docs/train.md \"Asynchronous schedules\".")
    max_staleness: int = _f(1, "schedule=async: the most train steps between the weights that sampled a sample and "
                               "the weights it trains; older samples are dropped (stale_dropped_samples).", "steps")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Periodic checkpoints and resume."""

    enabled: bool = _f(True, "Save checkpoints.")
    dir: str = _f("", "Checkpoint folder; empty: RUN_DIR/checkpoints.", "path")
    interval: int = _f(50, "Save every this many steps (and at the last step).", "steps")
    keep: int = _f(2, "Checkpoints kept (oldest deleted first); 0 keeps all.", "checkpoints")
    save_on_interrupt: bool = _f(True, "Ctrl-C, SIGTERM and SIGUSR1 save a checkpoint before exiting.")
    resume: bool = _f(False, "Continue from the latest checkpoint in dir (data order and RNG included).")
    allow_model_change: bool = _f(False, "Resume even though the weights or tokenizer files of model.hf_dir "
                                         "changed since the checkpoint (each named in the log); false refuses "
                                         "such a resume naming the files.")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Periodic evaluation on held-out prompts."""

    interval: int = _f(0, "Evaluate every this many steps; 0 disables.", "steps")
    n_prompts: int = _f(64, "Held-out prompts per evaluation.", "prompts")
    seed: int = _f(1000003, "reasoning-gym generation seed of the held-out set; must differ from data.seed.")
    jsonl_path: str = _f("", "Held-out JSONL prompts (required with data.jsonl_path).", "path")
    temperature: float = _f(0.0, "Evaluation sampling temperature; 0 is greedy.")
    max_new_tokens: int = _f(0, "Response length cap; 0: rollout.max_new_tokens.", "tokens")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Run folder, metrics and progress display (see ferrule.rl.metrics)."""

    run_dir: str = _f("runs/ferrule", "Run folder: config.yaml, metrics.jsonl, samples.jsonl, "
                                      "reward_curve.png, checkpoints/.", "path")
    progress: bool = _f(True, "Show a rich progress bar with ETA.")
    log_samples: int = _f(2, "Responses per step written to samples.jsonl; 0 disables.", "samples")
    tensorboard: bool = _f(False, "Also write TensorBoard events to RUN_DIR/tensorboard (the metrics extra).")
    wandb: bool = _f(False, "Also log to Weights & Biases, files in RUN_DIR/wandb (the metrics extra; "
                            "WANDB_MODE=offline: no network).")
    wandb_project: str = _f("ferrule", "W&B project name.")
    plot_at_end: bool = _f(True, "Write RUN_DIR/reward_curve.png when the run ends.")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Multi-turn episodes against an environment plugin (docs/agents.md); off while environment is empty."""

    environment: str = _f("", "Environment name (register_environments: tool_arithmetic, guess_number, "
                              "textarena, verifiers, a plugin's; `ferrule plugins` lists them); empty: "
                              "single-turn prompts from data.task / data.jsonl_path.")
    environment_kwargs: dict[str, Any] = _f({}, "Keyword arguments of the environment's factory.")
    max_turns: int = _f(8, "Model turns per episode; an episode still running after them is truncated.", "turns")
    max_episode_tokens: int = _f(1024, "Tokens after the prompt per episode (model and environment turns); "
                                       "rollout.max_new_tokens bounds each model turn.", "tokens")
    step_timeout_s: float = _f(30.0, "Wall-clock bound of one round of environment reset / step calls; an "
                                     "episode whose call raises, hangs or returns a malformed result ends with "
                                     "failure_reward and its error is reported.", "s")
    failure_reward: float = _f(0.0, "Reward of an episode whose environment failed.", "reward")
    max_failed_steps: int = _f(3, "Consecutive steps in which every episode ended by an environment error before "
                                  "the run stops with an error naming the environment and the last failure (its "
                                  "last checkpoint stays: fix the environment and resume); such steps carry no "
                                  "learning signal. 0: never stop.", "steps")
    max_hung_env_calls: int = _f(64, "Environment calls that timed out and still run in the background (Python "
                                     "cannot stop a thread) allowed at once; at this many, further reset / step "
                                     "calls are not started and their episodes fail with an error naming this "
                                     "limit, until some return. Bounds the threads a hanging environment piles "
                                     "up.", "calls")


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The whole ``ferrule train`` config; one attribute per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    train_engine: TrainEngineSettings = field(default_factory=TrainEngineSettings)
    rollout_engine: RolloutEngineSettings = field(default_factory=RolloutEngineSettings)
    weight_sync: WeightSyncSettings = field(default_factory=WeightSyncSettings)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict (sections -> keys -> values), reloadable with :func:`config_from_dict`."""
        return dataclasses.asdict(self)

    def get(self, dotted: str) -> Any:
        """Value of ``"section.key"``."""
        section, _, key = dotted.partition(".")
        return getattr(getattr(self, section), key)

    def dump(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write the resolved config to ``run_dir/config.yaml`` atomically; return the path."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        text = ("# Resolved ferrule train config (defaults + file + overrides). Reload with\n"
                "# `ferrule train --config THIS_FILE`.\n"
                + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False))
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        path = run_dir / CONFIG_FILE_NAME
        apply_default_mode(tmp)
        os.replace(tmp, path)
        return path

    def check_paths(self) -> None:
        """Raise :class:`ConfigError` listing every configured input path that does not exist."""
        problems = []
        required = [("model.hf_dir", self.model.hf_dir), ("model.torch_dist_dir", self.model.torch_dist_dir),
                    ("data.jsonl_path", self.data.jsonl_path), ("eval.jsonl_path", self.eval.jsonl_path)]
        for key, value in required:
            if value and not Path(value).expanduser().exists():
                rel = "" if Path(value).expanduser().is_absolute() else f" (relative to the current folder {os.getcwd()})"
                hint = ("; build it first (an example config's header comment gives the command: `ferrule assets "
                        "smollm2 assets/smollm2` for smollm2_*.yaml, `python -m ferrule_examples.inkling2_synthetic "
                        "runs/inkling2_tiny/assets` for inkling2_tiny.yaml), or set model.hf_dir"
                        if key == "model.hf_dir" and not self.checkpoint.resume else
                        "; if the model folder moved, give its new path: ferrule train --resume --run-dir RUN_DIR "
                        "model.hf_dir=NEW_PATH (the resume checks that its files are the checkpoint's)"
                        if key == "model.hf_dir" else "")
                problems.append(f"{key}: {value!r} does not exist{rel}{hint}")
        hf = Path(self.model.hf_dir).expanduser()
        if self.model.hf_dir and hf.exists() and not (hf / "config.json").is_file():
            problems.append(f"model.hf_dir: {self.model.hf_dir!r} has no config.json; point it at an HF "
                            "checkpoint folder (e.g. `ferrule assets smollm2 assets/smollm2` -> assets/smollm2/hf)")
        if problems:
            raise ConfigError(problems)


#: Section name -> section dataclass, in declaration order.
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(RLConfig)[f.name] for f in dataclasses.fields(RLConfig)}
