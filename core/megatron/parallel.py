"""Parallel layout and process-group lifecycle for the train engine.

``ParallelLayout`` is what a user asks for (TP/PP/EP/...); :func:`init_distributed` creates the
process group (torchrun env, or a single local process) and megatron's model-parallel groups,
then seeds every RNG through :class:`ferrule.megatron.device.DeviceBackend`. A layout is never
changed silently: a world size it does not divide is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from ferrule import envs

__all__ = [
    "ParallelLayout",
    "ParallelLayoutError",
    "init_distributed",
    "destroy_distributed",
    "clear_rotary_caches",
    "is_initialized",
    "world_size",
    "rank",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
    "ep_rank",
    "ep_size",
    "dp_rank",
    "dp_size",
]


class ParallelLayoutError(ValueError):
    """The requested parallel layout is invalid or does not fit the world size."""


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron parallel sizes (all >= 1).

    Attributes:
        tp: tensor-model-parallel size (splits attention heads / FFN columns; vocab padding).
        pp: pipeline-model-parallel size (splits layers).
        ep: expert-model-parallel size (splits routed experts; MoE only).
        etp: expert-tensor-parallel size; None means megatron's default (= ``tp``).
        cp: context-parallel size (only 1 is supported without TransformerEngine).
        vpp: virtual pipeline stages per pipeline rank; None for no interleaving.

    The data-parallel size is derived: ``world_size / (tp * pp * cp)`` for dense parameters;
    megatron requires ``ep * etp`` to divide ``world_size / pp`` for experts.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    vpp: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelLayoutError(f"ParallelLayout.{name}={value!r}; expected an integer >= 1.")
        for name in ("etp", "vpp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ParallelLayoutError(f"ParallelLayout.{name}={value!r}; expected None or an integer >= 1.")
        if self.cp != 1:
            raise ParallelLayoutError(
                f"ParallelLayout.cp={self.cp}: context parallelism needs TransformerEngine attention, "
                f"which ferrule does not use; set cp=1."
            )
        if self.vpp is not None and self.pp == 1:
            raise ParallelLayoutError(f"ParallelLayout.vpp={self.vpp} needs pp > 1 (interleaving splits pipeline stages).")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the dense model: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks, after :meth:`validate`."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def validate(self, world_size: int) -> None:
        """Check that the layout fits ``world_size`` ranks.

        Raises:
            ParallelLayoutError: ``tp*pp*cp`` does not divide the world size, or the expert
                layout ``ep*etp`` does not divide ``world_size/pp`` (names the numbers and the fix).
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ParallelLayoutError(f"world_size={world_size!r}; expected an integer >= 1.")
        mp = self.model_parallel_size
        if world_size % mp:
            raise ParallelLayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {mp}; "
                f"launch a multiple of {mp} processes or change the layout (ferrule never changes it for you)."
            )
        etp = self.etp if self.etp is not None else self.tp
        per_stage = world_size // self.pp
        if per_stage % (self.ep * etp):
            raise ParallelLayoutError(
                f"world size {world_size} / pp {self.pp} = {per_stage} ranks per stage is not divisible by "
                f"ep*etp = {self.ep}*{etp}; launch a multiple of {self.pp * self.ep * etp} processes or change ep/etp."
            )


#: a rendezvous other than ``env://`` for launcher-set ranks (``RANK`` / ``WORLD_SIZE`` in the
#: environment): e.g. ``file:///tmp/x/rendezvous``, which needs no TCP port
#: (``ferrule convert``'s spawned ranks use it)
INIT_METHOD_ENV = "FERRULE_DIST_INIT_METHOD"


def init_distributed(layout: ParallelLayout, seed: int = 1234, *, timeout_s: float = 600.0) -> None:
    """Create the process group, megatron's model-parallel groups, and seed every RNG.

    Under ``torchrun`` the rank/world size come from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
    ``MASTER_ADDR``/``MASTER_PORT`` (or the rendezvous in ``$FERRULE_DIST_INIT_METHOD``);
    otherwise a single process (rank 0 of 1) with an in-process ``HashStore``: no TCP port, so no
    race for one (``EADDRINUSE`` on a busy machine). The backend (nccl+cuda or gloo+cpu) comes from :func:`ferrule.megatron.device.get_backend`.

    Args:
        layout: the requested parallel layout (validated against the world size).
        seed: RNG seed passed to :meth:`DeviceBackend.seed_all` (same on every rank).
        timeout_s: process-group timeout in seconds.

    Raises:
        ParallelLayoutError: the layout does not fit the world size.
        RuntimeError: megatron's model-parallel state is already initialized with a different
            layout (call :func:`destroy_distributed` first).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .device import get_backend

    backend = get_backend()
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if envs.get("RANK") is not None:  # torchrun (or another launcher that sets the env protocol)
            world = envs.world_size()
            layout.validate(world)
            backend.set_device(envs.local_rank())
            method = envs.get(INIT_METHOD_ENV)
            if method:
                dist.init_process_group(backend=backend.dist_backend, init_method=method,
                                        rank=envs.rank(), world_size=world, timeout=timeout)
            else:
                dist.init_process_group(backend=backend.dist_backend, timeout=timeout)
        else:  # a single local process: an in-process store, no TCP port (nothing to race for)
            layout.validate(1)
            backend.set_device(0)
            dist.init_process_group(backend=backend.dist_backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
    world = dist.get_world_size()
    layout.validate(world)
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
        wanted = (layout.tp, layout.pp, layout.ep, layout.etp if layout.etp is not None else layout.tp)
        if current != wanted:  # etp too: a process that kept etp=tp must not build an etp=1 model on it
            raise RuntimeError(
                f"megatron model parallel is already initialized as tp,pp,ep,etp={current}, not "
                f"{wanted}; call destroy_distributed() first."
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    backend.seed_all(seed)


#: megatron-core 0.16.1's ``parallel_state`` globals holding process groups that its ``destroy_model_parallel``
#: does not reset
_GROUPS_DESTROY_FORGETS = ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")


def destroy_distributed(*, keep_process_group: bool = False) -> None:
    """Tear down megatron's model-parallel groups and the default process group (idempotent).

    Args:
        keep_process_group: keep the default process group, so that :func:`init_distributed`
            can set up another layout on the same ranks (used to compare layouts in one launch).
            Every other process group is destroyed: megatron's ``destroy_model_parallel`` only
            forgets its groups, and torch keeps each one registered with its gloo threads (measured:
            +51 threads per layout on one CPU rank, 212 after four, where a full teardown leaves 8).

    Also empties megatron's per-class rotary caches (:func:`clear_rotary_caches`), which keep every
    model's rotary module, and the process group it holds, alive after the model is gone, the two
    ``parallel_state`` globals megatron's ``destroy_model_parallel`` leaves set (``_GROUPS_DESTROY_FORGETS``),
    and megatron's MoE aux-loss logging tracker, which keeps its last reduce group.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    clear_rotary_caches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name in _GROUPS_DESTROY_FORGETS:  # kept alive by megatron's module, with their gloo threads, until the next init
        setattr(parallel_state, name, None)
    _clear_moe_logging_tracker()
    if not dist.is_initialized():
        return
    if keep_process_group:
        _destroy_subgroups()
    else:
        dist.destroy_process_group()


def _clear_moe_logging_tracker() -> None:
    """Empty megatron-core's MoE aux-loss logging tracker (``moe_utils._MOE_LAYER_WISE_LOGGING_TRACKER``, 0.16.1): a
    module-level dict that keeps the last MoE run's per-layer loss values and its ``reduce_group``, a process
    group that then outlives the teardown with its gloo threads (measured on a 2-rank pool after
    tests/test_lora.py's TP=2 job: one of the 2 groups left alive)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover - megatron layout changed
        return
    tracker = getattr(moe_utils, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)
    if isinstance(tracker, dict):
        tracker.clear()


def clear_rotary_caches() -> None:
    """Empty the ``functools.lru_cache`` on ``RotaryEmbedding.forward`` and ``YarnRotaryEmbedding.forward``
    (megatron-core 0.16.1, ``models/common/embeddings``): a cache on the class, keyed by the module
    (``self``) and its ``cp_group``, so up to 32 entries keep built models' rotary modules, their tables
    and their process groups alive after the models and the groups are dropped. A destroyed gloo group
    that is still referenced keeps its threads: measured on one CPU rank, +3 OS threads per tiny model
    built and dropped (+12 after four), none with the caches emptied."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        forward = cls.__dict__.get("forward")
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()


def _destroy_subgroups() -> None:
    """Destroy every registered process group except the default one (torch keeps the registry in
    ``distributed_c10d._world.pg_map``; there is no public list of groups)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.GroupMember.WORLD
    for group in [g for g in list(getattr(getattr(c10d, "_world", None), "pg_map", {})) if g is not world]:
        dist.destroy_process_group(group)


def is_initialized() -> bool:
    """True once :func:`init_distributed` has set up megatron's model-parallel groups."""
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def tp_rank() -> int:
    return _ps().get_tensor_model_parallel_rank()


def tp_size() -> int:
    return _ps().get_tensor_model_parallel_world_size()


def pp_rank() -> int:
    return _ps().get_pipeline_model_parallel_rank()


def pp_size() -> int:
    return _ps().get_pipeline_model_parallel_world_size()


def ep_rank() -> int:
    return _ps().get_expert_model_parallel_rank()


def ep_size() -> int:
    return _ps().get_expert_model_parallel_world_size()


def dp_rank() -> int:
    return _ps().get_data_parallel_rank()


def dp_size() -> int:
    return _ps().get_data_parallel_world_size()
