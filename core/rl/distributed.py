"""``ferrule train`` on several ranks: layout checks, rollout shards, fan-out of rollout weights.

Launch: ``torchrun --nproc-per-node N -m ferrule train CONFIG`` (or ``ferrule train --nproc N
CONFIG``, which runs that). Every rank runs :class:`ferrule.rl.loop.GRPOTrainer`; the ranks
differ only in these roles:

- **driver** (global rank 0): samples the prompts, plans the rollout shards, scores rewards,
  computes advantages, writes metrics / samples / loop state, runs evaluation. It sends the
  scored rollout (prompt ids, responses, rewards) to every rank, so every rank builds the same
  train batch and calls the train engine with it (the engine plans each rank's share itself).
- **rollout ranks**: the first rank of every data-parallel replica (``tp_rank == pp_rank ==
  0``), listed by DP rank; each holds an embedded rollout engine. The driver is the first.
  With ``rollout.engine: sglang`` the driver is the only rollout rank (it drives the server;
  :mod:`ferrule.rl.rollout_engine`), so every shard runs there and nothing is fanned out.
- the other ranks only train.

Rollout shards (:func:`plan_shards`): the step's prompts, in sampler order, are cut into shards
of ``rollout.prompts_per_shard`` consecutive prompts (0: ``ceil(prompts_per_step / replicas)``).
Shard ``k`` is one ``generate`` call with sampling seed :func:`shard_seed` and runs on rollout
rank ``k % replicas``. A shard's samples depend only on its prompts, its seed and the weights,
so the same ``prompts_per_shard`` gives the same rollout at any world size (bit-identical while
the weights are; the CPU tests compare DP=2, TP=2, PP=2 with one process).

Weights: :func:`ferrule.sync.sync_weights` updates the driver's rollout engine (gathered once
over the driver's replica: TP all-gather, PP broadcast), then :func:`fan_out_rollout_weights`
broadcasts the driver engine's tensors to the other rollout ranks over a group of the rollout
ranks only (one broadcast per tensor, received in byte-bounded ``update_weights`` buckets).
With LoRA (``lora.rank > 0``) only the adapter travels: :func:`ferrule.sync.sync_lora_adapter`
serves it on the driver's engine, then :func:`fan_out_lora_adapter` broadcasts the adapter the
driver's engine serves (PEFT tensors + ``adapter_config``) over the same group, and each other
rollout rank serves it with ``update_lora_adapter`` (base untouched, never merged).

Failures: a rank that raises exits non-zero and ``torchrun`` stops the other ranks at once (its
monitor polls every 0.1 s); under a launcher that does not, a rank left waiting in a collective
raises after ``parallel.timeout_s`` seconds (the process-group timeout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ferrule import envs
from ferrule.rl.config_schema import RLConfig
from ferrule.rl.config_types import ConfigError
from ferrule.rl.seeds import rollout_seed
from ferrule.contract import registry
from ferrule.megatron.parallel import ParallelLayout, ParallelLayoutError
from ferrule.sync import WeightSyncError, check_lora_adapter_equal

__all__ = ["RankRoles", "Shard", "check_layout", "layout_of", "launch_world_size", "plan_shards", "shard_seed",
           "fan_out_rollout_weights", "fan_out_lora_adapter", "rank_roles", "broadcast_object", "gather_objects", "all_gather_objects"]

#: bytes of received tensors per ``update_weights`` call on a rollout rank (fan-out)
FAN_OUT_BUCKET_BYTES = 256 * 2**20


def launch_world_size() -> int:
    """World size of this launch: ``WORLD_SIZE`` under torchrun, else 1."""
    try:
        return envs.world_size()
    except ValueError:
        return 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = hf_config.get("text_config")
    return text if isinstance(text, Mapping) and "num_hidden_layers" not in hf_config else hf_config


def layout_of(cfg: RLConfig) -> Any:
    """The train engine's ``ParallelLayout`` from ``parallel.*`` (``etp`` 0: megatron's default, ``tp``)."""
    par = cfg.parallel
    return ParallelLayout(tp=par.tp, pp=par.pp, ep=par.ep, etp=par.etp or None)


def _family_layout_problem(cfg: RLConfig, hf_config: Mapping[str, Any]) -> str | None:
    """The one-line refusal of :func:`ferrule.megatron.gpt_config.check_family_layout` for ``parallel.*`` (the
    family's declared ``layouts``, MoE biases at expert TP > 1), or None; a config the family cannot translate
    is reported elsewhere."""
    try:
        family = cfg.model.family or registry.family_for_hf_config(dict(hf_config)).name
        tc_kwargs, _ = registry.get_converter(family).resolved_config_translation().to_mcore(dict(hf_config))
    except Exception:  # noqa: BLE001 - an unknown family / untranslatable config has its own error
        return None
    from ferrule.megatron.gpt_config import check_family_layout

    try:
        check_family_layout(family, tc_kwargs, layout_of(cfg))
    except ParallelLayoutError as exc:
        return f"parallel: {exc}"
    return None


def check_layout(cfg: RLConfig, hf_config: Mapping[str, Any], world_size: int) -> None:
    """Check ``parallel.*`` against the world size and the model before anything is built.

    Rules (megatron-core 0.16.1): ``tp * pp`` divides the world size (DP = world / (tp*pp));
    ``ep`` divides ``world / pp`` and the number of routed experts; ``tp`` divides the attention
    heads, the KV heads and the FFN width; ``pp`` divides the layer count (even split);
    ``vpp`` must be 1 (see the message); ``train.colocate: true`` needs one rank; then the family's own
    layout check (``ModelFamilySpec.layouts``; MoE biases need ``etp`` 1).

    Raises:
        ConfigError: every problem at once, each naming the valid sizes.
    """
    par = cfg.parallel
    p: list[str] = []
    if par.vpp != 1:
        p.append(f"parallel.vpp: {par.vpp} virtual pipeline stages are not supported: the train engine runs "
                 "megatron's non-interleaved pipeline schedule with one model chunk per rank (interleaving "
                 "needs the model built as vpp chunks and the interleaved 1F1B schedule, not implemented); "
                 "set parallel.vpp=1")
    tp, pp, ep = par.tp, par.pp, par.ep
    if world_size % (tp * pp):
        options = ", ".join(f"tp={t} pp={q}" for t in _divisors(world_size) for q in _divisors(world_size // t))
        p.append(f"parallel: tp*pp = {tp}*{pp} = {tp * pp} does not divide the world size {world_size} (launched "
                 f"ranks); valid for {world_size} ranks: {options} (DP = world / (tp*pp)), or launch a multiple "
                 f"of {tp * pp} ranks")
    elif (world_size // pp) % ep:
        p.append(f"parallel.ep: {ep} does not divide world / pp = {world_size // pp}; valid: "
                 f"{_divisors(world_size // pp)}")
    m = _text_config(hf_config)
    heads = m.get("num_attention_heads")
    kv = m.get("num_key_value_heads") or heads
    ffn = m.get("intermediate_size")
    if isinstance(heads, int) and isinstance(kv, int):
        g = math.gcd(heads, kv) if not isinstance(ffn, int) else math.gcd(math.gcd(heads, kv), ffn)
        if g % tp:
            p.append(f"parallel.tp: {tp} does not divide the model's attention heads {heads}, KV heads {kv}"
                     + (f" and FFN width {ffn}" if isinstance(ffn, int) else "") + f"; valid tp: {_divisors(g)}")
    layers = m.get("num_hidden_layers")
    if isinstance(layers, int) and layers % pp:
        p.append(f"parallel.pp: {pp} does not divide the model's {layers} layers (stages hold equal layer "
                 f"counts); valid pp: {_divisors(layers)}")
    experts = next((m[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if isinstance(m.get(k), int)),
                   None)
    if ep > 1 and experts is None:
        p.append(f"parallel.ep: {ep} > 1 but the model has no routed experts; set parallel.ep=1")
    elif experts is not None and experts % ep:
        p.append(f"parallel.ep: {ep} does not divide the model's {experts} routed experts; valid ep: "
                 f"{_divisors(experts)}")
    if not p and par.etp >= 0:
        problem = _family_layout_problem(cfg, hf_config)
        if problem:
            p.append(problem)
    if cfg.train.colocate is True and world_size > 1:
        p.append(f"train.colocate: true runs train and rollout in one process, this launch has {world_size} ranks "
                 "(torchrun / --nproc); set train.colocate: false or auto (auto is off with several ranks)")
    if p:
        raise ConfigError(p)


@dataclass(frozen=True)
class Shard:
    """One rollout call: prompts ``[start, stop)`` of the step, sampling ``seed``, on ``replica``."""

    index: int
    start: int
    stop: int
    seed: int
    replica: int


def shard_seed(train_seed: int, step: int, index: int, round_: int = 0) -> int:
    """Sampling seed of rollout shard ``index`` at ``step``.

    Shard 0: ``rollout_seed(train_seed, step)`` = ``sha256("ferrule-rollout:{seed}:{step}")``
    (the one-shard seed of earlier single-process runs); shard k > 0:
    ``sha256("ferrule-rollout.{k}:{seed}:{step}")``. ``round_`` r > 0 (the r-th refill of
    ``algorithm.dynamic_sampling``): ``sha256("ferrule-rollout.r{r}.{k}:{seed}:{step}")``. First 8
    bytes, mod 2**63.
    """
    if round_:
        return rollout_seed(train_seed, step, f"rollout.r{round_}.{index}")
    return rollout_seed(train_seed, step, "rollout" if index == 0 else f"rollout.{index}")


def plan_shards(n_prompts: int, prompts_per_shard: int, replicas: int, train_seed: int, step: int,
                round_: int = 0) -> list[Shard]:
    """Cut ``n_prompts`` into shards of ``prompts_per_shard`` (0: ``ceil(n_prompts / replicas)``),
    shard ``k`` on replica ``k % replicas`` (module docstring); ``round_``: see :func:`shard_seed`."""
    size = prompts_per_shard or max(1, -(-n_prompts // replicas))
    return [Shard(k, a, min(a + size, n_prompts), shard_seed(train_seed, step, k, round_), k % replicas)
            for k, a in enumerate(range(0, n_prompts, size))]


# ---------------------------------------------------------------------------------------
# roles and object collectives
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankRoles:
    """This rank's part in the loop (module docstring).

    Attributes:
        rank / world_size: global rank and size (0 / 1 without a process group).
        rollout_ranks: the first rank of every DP replica, by DP rank (``(0,)`` at DP=1).
        rollout_group: process group of ``rollout_ranks`` (None with one replica).
    """

    rank: int
    world_size: int
    rollout_ranks: tuple[int, ...]
    rollout_group: Any = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def replica(self) -> int | None:
        """This rank's index in :attr:`rollout_ranks` (None: no rollout engine here)."""
        return self.rollout_ranks.index(self.rank) if self.rank in self.rollout_ranks else None


def rank_roles(*, driver_only_rollout: bool = False) -> RankRoles:
    """Roles from megatron's parallel state (collective: call on every rank after the engine is built).

    ``driver_only_rollout`` (``rollout.engine: sglang``): the driver is the only rollout rank and
    no rollout group is created (pass the same value on every rank).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return RankRoles(0, 1, (0,))
    coords = all_gather_objects((dist.get_rank(), ps.get_tensor_model_parallel_rank(),
                                 ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()))
    firsts = tuple(r for r, _, _, _ in sorted((c for c in coords if c[1] == 0 and c[2] == 0), key=lambda c: c[3]))
    if driver_only_rollout:
        firsts = firsts[:1]
    group = dist.new_group(list(firsts)) if len(firsts) > 1 else None  # collective: every rank creates it
    return RankRoles(dist.get_rank(), dist.get_world_size(), firsts, group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (pickled; CPU tensors inside are fine)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj: Any, dst: int = 0) -> list | None:
    """Every rank's ``obj`` on global rank ``dst`` (rank order), None elsewhere."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def all_gather_objects(obj: Any) -> list:
    """Every rank's ``obj`` on every rank (rank order)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------
# weights: driver's rollout engine -> the other rollout ranks
# ---------------------------------------------------------------------------------------

def fan_out_rollout_weights(roles: RankRoles, rollout: Any, version: int, *,
                            bucket_bytes: int = FAN_OUT_BUCKET_BYTES) -> int:
    """Copy the driver's rollout-engine weights into every other rollout rank's engine.

    Collective over :attr:`RankRoles.rollout_group` (call on the rollout ranks after
    :func:`ferrule.sync.sync_weights`; other ranks return at once). The driver broadcasts the
    name/shape/dtype list, then each tensor of ``rollout.get_hf_state_dict()`` (HF checkpoint
    names; tied aliases sent once); receivers apply them with ``update_weights(bucket, version)``
    in buckets of at most ``bucket_bytes``. Tensors travel on the engine's device (NCCL: GPU).

    Returns:
        Bytes sent (driver) or received (other rollout ranks); 0 elsewhere.
    """
    if roles.rollout_group is None or roles.replica is None:
        return 0
    src = roles.rollout_ranks[0]
    if roles.is_driver:
        state = rollout.get_hf_state_dict()
        seen: dict[int, str] = {}
        meta = []
        for name in sorted(state):
            t = state[name]
            key = t.data_ptr()
            other = state[seen[key]] if key in seen else None
            if other is not None and other.shape == t.shape and other.stride() == t.stride():  # tied alias
                continue
            seen[key] = name
            meta.append((name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    else:
        state, meta = None, None
    meta = broadcast_object(meta, src=src, group=roles.rollout_group)
    total, bucket, used = 0, [], 0
    for name, t in _broadcast_entries(roles, rollout, state, meta, src):
        size = t.numel() * t.element_size()
        total += size
        if not roles.is_driver:
            bucket.append((name, t))
            used += size
            if used >= bucket_bytes:
                rollout.update_weights(bucket, version)
                bucket, used = [], 0
    if bucket:
        rollout.update_weights(bucket, version)
    return total



def _broadcast_entries(roles: RankRoles, rollout: Any, state: Any, entries: Sequence[tuple[str, tuple, str]],
                       src: int) -> Any:
    """Yield ``(name, tensor)`` for each ``(name, shape, dtype name)`` entry, broadcast from ``src``
    over the rollout group: the driver sends ``state[name]``, the others receive into fresh
    tensors on their engine's device (collective: iterate to the end on every rollout rank)."""
    import torch
    import torch.distributed as dist

    device = rollout.device if hasattr(rollout, "device") else torch.device("cpu")
    for name, shape, dtype in entries:
        if roles.is_driver:
            t = state[name].detach().contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src=src, group=roles.rollout_group)
        yield name, t


def _driver_adapter(rollout: Any) -> tuple[dict, Any]:
    """The driver engine's adapter tensors and what :func:`fan_out_lora_adapter` broadcasts first:
    ``(lora_config dict, [(name, shape, dtype name)])``, or the error message when it serves none."""
    getter = getattr(rollout, "get_lora_state_dict", None)
    state = dict(getter()) if callable(getter) else {}
    config = getattr(rollout, "lora_config", None)
    if not state or not config:
        return state, (f"fan_out_lora_adapter: the driver's rollout engine ({type(rollout).__name__}) serves no LoRA "
                       "adapter to fan out (get_lora_state_dict() / lora_config empty or missing); run "
                       "ferrule.sync.sync_lora_adapter on every rank first, with an engine that serves adapters")
    return state, (dict(config), [(n, tuple(state[n].shape), str(state[n].dtype).removeprefix("torch."))
                                  for n in sorted(state)])


def fan_out_lora_adapter(roles: RankRoles, rollout: Any, version: int, *, check_equal: bool = False) -> int:
    """Serve the driver's LoRA adapter on every other rollout rank's engine (adapter only, unmerged).

    Collective over :attr:`RankRoles.rollout_group`, like :func:`fan_out_rollout_weights` (call on
    the rollout ranks after :func:`ferrule.sync.sync_lora_adapter` put the adapter on the driver's
    engine; other ranks, and runs with one replica, return 0 at once). The driver broadcasts its
    engine's ``lora_config`` (the ``adapter_config.json`` dict) and the name/shape/dtype list, then
    each tensor of ``rollout.get_lora_state_dict()`` (PEFT saved names, ``lora_A`` ``[r, in]``,
    ``lora_B`` ``[out, r]``, in the dtype the driver serves them), so every replica serves the
    driver's adapter bit for bit. Each receiver calls ``update_lora_adapter(tensors, config,
    version)`` once with the whole adapter (the embedded engine refuses a partial one). Tensors
    travel on the engine's device (NCCL: GPU). The base weights never travel and are never merged.

    Args:
        roles: this rank's :class:`RankRoles`.
        rollout: this rank's rollout engine (``get_lora_state_dict`` / ``lora_config`` on the
            driver, ``update_lora_adapter`` on the others); None off the rollout ranks.
        version: the weight version (the train engine's optimizer step).
        check_equal: receivers then verify their engine's adapter against the received tensors
            (:func:`ferrule.sync.check_lora_adapter_equal`, exact).

    Returns:
        Bytes sent (driver) or received (other rollout ranks); 0 elsewhere.

    Raises:
        WeightSyncError: on every rollout rank when the driver's engine serves no adapter (the
            sync did not run, or the engine cannot report its adapter), and on a receiver whose
            check fails. The receiving engine's own errors pass through. As with the weight
            fan-out, a rank that raises stops the job through torchrun (``parallel.timeout_s``
            bounds the wait of ranks left in a collective).
    """
    if roles.rollout_group is None or roles.replica is None:
        return 0
    src = roles.rollout_ranks[0]
    state: dict = {}
    meta: Any = None
    if roles.is_driver:
        state, meta = _driver_adapter(rollout)
    meta = broadcast_object(meta, src=src, group=roles.rollout_group)
    if isinstance(meta, str):
        raise WeightSyncError(meta)
    config, entries = meta
    received, total = {}, 0
    for name, t in _broadcast_entries(roles, rollout, state, entries, src):
        total += t.numel() * t.element_size()
        received[name] = t
    if not roles.is_driver:
        rollout.update_lora_adapter(received, config, version)
        if check_equal:
            check_lora_adapter_equal(received, rollout)
    return total
