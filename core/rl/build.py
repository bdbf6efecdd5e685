"""What :meth:`ferrule.rl.loop.GRPOTrainer.setup` builds from an :class:`~ferrule.rl.config.RLConfig`:
the optimizer settings, the train engine, the chat template and its stop tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferrule.rl.config_schema import RLConfig
from ferrule.rl.config_types import ConfigError
from ferrule.rl.run_checks import lora_settings
from ferrule.chat import stop_token_ids
from ferrule.contract import registry


if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from ferrule.megatron.engine import OptimizerSettings, TrainEngine
    from ferrule.megatron.parallel import ParallelLayout
    from ferrule.rl.distributed import RankRoles
    from ferrule.rl.reference import ReferencePolicy
    from ferrule.rollout import RolloutEngine
    from ferrule.contract.specs import ChatTemplateSpec

__all__ = ["optimizer_settings", "build_train_engine", "engine_settings_report", "chat_template", "stop_tokens", "check_media_support",
           "layout_note"]


def optimizer_settings(cfg: RLConfig) -> OptimizerSettings:
    """:class:`~ferrule.megatron.optim.OptimizerSettings` of ``cfg.optimizer``; warmup and decay
    steps count optimizer steps (``train.optim_steps_per_rollout`` per RL step)."""
    from ferrule.megatron.engine import OptimizerSettings

    o, t = cfg.optimizer, cfg.train
    return OptimizerSettings(
        lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.lr_warmup_steps * t.optim_steps_per_rollout,
        lr_decay_steps=(None if o.lr_decay_style == "constant"
                        else (o.lr_decay_steps or t.steps) * t.optim_steps_per_rollout),
        lr_decay_style=o.lr_decay_style, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad)


def build_train_engine(cfg: RLConfig, layout: ParallelLayout, dtype: torch.dtype) -> TrainEngine:
    """The policy's :class:`~ferrule.megatron.engine.TrainEngine`: from ``model.torch_dist_dir``
    (weights only) when set, else from ``model.hf_dir``; LoRA adapters on the frozen base when
    ``lora.rank > 0`` (the sync then sends only the adapter); its fast paths are ``cfg.train_engine``.

    Raises:
        ConfigError: ``algorithm.routing_replay`` on a model without MoE routers."""
    from ferrule.megatron.engine import TrainEngine

    t = cfg.train
    kwargs = dict(optimizer=optimizer_settings(cfg), params_dtype=dtype, seed=t.seed,
                  max_tokens_per_microbatch=t.micro_batch_tokens, settings=cfg.train_engine)
    lora = lora_settings(cfg)
    if lora is not None:
        kwargs["lora"] = lora
    if cfg.model.torch_dist_dir:
        engine = TrainEngine.from_torch_dist(cfg.model.torch_dist_dir, layout, load_optimizer=False, **kwargs)
    else:
        engine = TrainEngine.from_hf(cfg.model.hf_dir, layout, **kwargs)
    if cfg.algorithm.routing_replay and not engine.moe_routers:
        raise ConfigError([f"algorithm.routing_replay: family {engine.family!r} has no MoE router (a dense model "
                           "routes nothing); set algorithm.routing_replay=false"])
    return engine


def chat_template(cfg: RLConfig, family: str, tokenizer: PreTrainedTokenizerBase | None) -> ChatTemplateSpec:
    """The :class:`~ferrule.contract.specs.ChatTemplateSpec` that renders prompts: ``data.chat_template``,
    else the family's first.

    Raises:
        ConfigError: no tokenizer in ``model.hf_dir``, or the family registers no template.
    """
    if tokenizer is None:
        raise ConfigError([f"model.hf_dir: {cfg.model.hf_dir!r} has no tokenizer files (tokenizer.json / "
                           "tokenizer_config.json); the loop renders prompts with the checkpoint's tokenizer"])
    if cfg.data.chat_template:
        return registry.get_chat_template(cfg.data.chat_template)
    templates = registry.chat_templates_for(family)
    if not templates:
        raise ConfigError([f"data.chat_template: family {family!r} registers no chat template; "
                           "name one with data.chat_template (see `ferrule chat-template list`)"])
    return templates[0]


def stop_tokens(cfg: RLConfig, template: ChatTemplateSpec, tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(stop token ids, stop strings)``: the template's stop tokens plus ``rollout.extra_stop_tokens``
    (a single-token text becomes an id, a longer one a stop string)."""
    stop_ids = list(stop_token_ids(template, tokenizer))
    stop_strings = []
    for tok in cfg.rollout.extra_stop_tokens:
        ids = tokenizer.encode(tok, add_special_tokens=False)
        (stop_ids.extend(ids) if len(ids) == 1 else stop_strings.append(tok))
    return tuple(dict.fromkeys(stop_ids)), tuple(stop_strings)


def check_media_support(cfg: RLConfig, any_media: bool, reference: ReferencePolicy | None) -> None:
    """Refuse prompts with media where the run cannot take them (SGLang client, reference policy).

    Raises:
        ConfigError: naming the key to change.
    """
    if any_media and cfg.rollout.engine == "sglang":
        raise ConfigError(["rollout.engine: sglang cannot take the prompts' images or audio (the SGLang "
                           "client sends no media yet); use rollout.engine=embedded for multimodal prompts"])
    if any_media and reference is not None:
        raise ConfigError(["algorithm.kl_coef: the reference policy does not take media yet; use kl_coef 0 "
                           "with prompts that carry images or audio"])


def layout_note(cfg: RLConfig, roles: RankRoles) -> str:
    """``", N ranks (tp .., pp .., ep .., dp ..; rollout on ranks [..])"``, or ``""`` for one process."""
    if not roles.distributed:
        return ""
    p = cfg.parallel
    return (f", {roles.world_size} ranks (tp {p.tp}, pp {p.pp}, ep {p.ep}{f', etp {p.etp}' if p.etp else ''}, dp {roles.world_size // (p.tp * p.pp)}; "
            f"rollout on ranks {list(roles.rollout_ranks)})")


def engine_settings_report(engine: TrainEngine, rollout: RolloutEngine | None, cfg: RLConfig) -> str:
    """The start-up lines of the engine settings: each section as configured, then what its switches
    resolved to on this device (``auto`` -> on / off)."""
    lines = [f"{s}: {getattr(cfg, s).describe()}" for s in ("train_engine", "rollout_engine", "weight_sync")]
    on = [k for k in ("fused_logprobs", "packed_sequences", "grad_accum_fusion", "logprob_one_pass", "fused_adam")
          if getattr(engine, k, False)]
    on += [f"cuda_fusions {'+'.join(engine.cuda_fusions)}"] if getattr(engine, "cuda_fusions", None) else []
    on += [f"lean_activations {'+'.join(engine.lean_activations)}"] if getattr(engine, "lean_activations", None) else []
    lines.append("train engine paths on: " + (", ".join(on) or "none (plain path)"))
    if rollout is not None and getattr(rollout, "kind", None) == "embedded":
        ro = [k for k in ("cuda_graph", "compile_decode", "fast_decode") if getattr(rollout, k, False)]
        lines.append("rollout engine paths on: " + (", ".join(ro) or "none (eager path)"))
    return "\n".join(lines)
