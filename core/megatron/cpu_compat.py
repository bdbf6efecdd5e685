"""Runtime patches that let megatron-core 0.16.1 train on CPU with gloo.

Imported and applied only by :func:`ferrule.megatron.device.get_backend` when CUDA is absent
(never on a GPU machine). Fixes for TransformerEngine / Apex being absent, on any device, are
not here: they are in :mod:`ferrule.megatron.te_compat`, applied on CUDA machines too. Every patch is a named function with the upstream site it works
around and the error upstream raises without it; :data:`PATCHES` lists them in the order
:func:`apply` installs them. ``tests/test_megatron_cpu_compat.py`` checks, for each patch, that
upstream 0.16.1 *still* fails the documented way without it (so the test fails, and the patch
can be retired, once upstream is fixed) and that the patched path works.

The measurements behind each patch are in ``shared/reference/megatron_cpu_lab.md``. Narrowest
fix first: device literals are rewritten only inside the megatron modules that hard-code
``device="cuda"`` (a module-local ``torch`` proxy, zero cost elsewhere), and the
``Tensor.type() == 'torch.cuda.FloatTensor'`` checks are satisfied only inside the few
optimizer functions that make them (a scoped ``TorchFunctionMode``), not by a global
``TorchFunctionMode`` over every op (the lab measured +80 % step time for that).

Patches are process-global monkeypatches; :func:`revert` undoes them (used by tests).
"""

from __future__ import annotations

import functools
import importlib
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Patch", "PATCHES", "MEGATRON_CORE_VERSION", "apply", "revert", "applied", "is_cuda_device"]

#: The megatron-core release these patches were written and tested against.
MEGATRON_CORE_VERSION = "0.16.1"

_LOCK = threading.RLock()
_APPLIED: dict[str, list[tuple[Any, str, Any]]] = {}  # patch name -> [(owner, attr, original)]
_MISSING = object()


def _set(record: list, owner: Any, attr: str, value: Any) -> None:
    """setattr that remembers the original (or its absence) for :func:`revert`."""
    original = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
    record.append((owner, attr, original))
    setattr(owner, attr, value)


def is_cuda_device(device: Any) -> bool:
    """True for ``'cuda'``, ``'cuda:N'``, ``torch.device('cuda', N)`` and bare ints (CUDA ordinals)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


# ----------------------------------------------------------------------------------------
# P-dev, P-sync, P-stream: the torch.cuda entry points megatron calls unconditionally.
# ----------------------------------------------------------------------------------------

def patch_current_device(record: list) -> None:
    """``torch.cuda.current_device()`` returns ``"cpu"``.

    Upstream: megatron allocates at ``torch.cuda.current_device()`` in many places, e.g.
    ``megatron/core/utils.py`` ``GlobalMemoryBuffer.get_tensor`` (attention matmul buffer),
    RoPE ``inv_freq`` placement, DDP grad buffers (``distributed/param_and_grad_buffer.py``).
    Without the patch: ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    _set(record, torch.cuda, "current_device", lambda: "cpu")


def patch_synchronize(record: list) -> None:
    """``torch.cuda.synchronize()`` is a no-op (CPU ops are synchronous).

    Upstream: ``dist_checkpointing/strategies/filesystem_async.py`` (torch_dist save) and
    ``distributed_data_parallel.py`` call it unconditionally.
    Without the patch: ``AssertionError: Torch not compiled with CUDA enabled``.
    """
    _set(record, torch.cuda, "synchronize", lambda device=None: None)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``/``Event`` on CPU: every wait/record is a no-op."""

    device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuStream":
        return self

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuStreamClass(_CpuStream):
    """Replaces the class ``torch.cuda.Stream``: constructing it returns the one CPU stream.

    A class, not a function, so that annotations such as ``torch.cuda.Stream | None``
    (evaluated at import time by transformers) and ``isinstance`` checks keep working.
    ``Stream()``, ``current_stream()`` and ``default_stream()`` must be the *same* object, or
    the MoE dispatcher believes it runs on a side stream and calls ``Tensor.record_stream``
    (which fails on CPU tensors).
    """

    _instance: "_CpuStreamClass | None" = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "_CpuStreamClass":
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _CpuEventClass(_CpuStream):
    """Replaces the class ``torch.cuda.Event``: a no-op event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


_THE_STREAM = _CpuStreamClass()


def patch_streams(record: list) -> None:
    """``torch.cuda.Stream/Event/stream/current_stream/default_stream`` become no-op stubs.

    Upstream: ``transformer/moe/token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher`` builds a
    ``torch.cuda.Stream``), ``distributed_data_parallel.py`` (``overlap_grad_reduce``
    communication stream). Without the patch: ``RuntimeError: torch.cuda.Stream requires CUDA
    support`` (or the "not compiled with CUDA" assertion).
    """
    _set(record, torch.cuda, "Stream", _CpuStreamClass)
    _set(record, torch.cuda, "Event", _CpuEventClass)
    _set(record, torch.cuda, "current_stream", lambda device=None: _THE_STREAM)
    _set(record, torch.cuda, "default_stream", lambda device=None: _THE_STREAM)
    _set(record, torch.cuda, "stream", lambda stream=None: _THE_STREAM)


# ----------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------

def patch_moe_split_sizes(record: list) -> None:
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns a numpy array for CPU tensors too.

    Upstream: ``transformer/moe/moe_utils.py`` converts only CUDA tensors; on CPU the alltoall
    dispatcher (``token_dispatcher.py``, ``MoEAlltoAllTokenDispatcher.preprocess``) passes
    torch tensors as ``input_split_sizes`` to ``torch.distributed.all_to_all_single``, which
    raises ``TypeError: ... incompatible function arguments`` (expects ``list[int]``). Applied
    at both the definition and the dispatcher's imported name.
    """
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _set(record, moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    _set(record, dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


# ----------------------------------------------------------------------------------------
# gloo
# ----------------------------------------------------------------------------------------

def patch_gloo_scatter_contiguous(record: list) -> None:
    """``torch.distributed.scatter`` makes every tensor of ``scatter_list`` contiguous.

    Upstream (torch's gloo backend, not megatron): scattering non-contiguous views (e.g.
    ``weight.chunk(tp, dim=1)``, the row-parallel split) sends the wrong elements **without an
    error**; NCCL code paths usually get contiguous copies from ``.to('cuda')``, which is a
    no-op on CPU. Found with megatron-bridge TP=2 loads (o_proj/down_proj off by ~0.1).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.scatter

    @functools.wraps(original)
    def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, **kwargs):
        if scatter_list is not None:
            scatter_list = [t.contiguous() for t in scatter_list]
        return original(tensor, scatter_list, src, group, async_op, **kwargs)

    _set(record, dist, "scatter", scatter)
    _set(record, c10d, "scatter", scatter)


# ----------------------------------------------------------------------------------------
# Hard-coded device="cuda" literals: a module-local torch proxy
# ----------------------------------------------------------------------------------------

_FACTORIES = frozenset({
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "zeros_like", "ones_like", "empty_like", "full_like",
})


class _CpuLiteralTorch(types.ModuleType):
    """A stand-in for the name ``torch`` inside one megatron module.

    Every attribute is the real ``torch`` attribute, except the tensor factories, whose
    ``device=`` is rewritten from a CUDA device (``'cuda'``, ``'cuda:N'``, an int) to ``'cpu'``.
    """

    def __init__(self) -> None:
        super().__init__("torch", "ferrule CPU proxy for torch (see ferrule.megatron.cpu_compat)")
        self.__dict__["_wrapped"] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr
        wrapped = self.__dict__["_wrapped"].get(name)
        if wrapped is None:
            @functools.wraps(attr)
            def wrapped(*args: Any, __f: Callable = attr, **kwargs: Any) -> Any:
                if is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                return __f(*args, **kwargs)

            self.__dict__["_wrapped"][name] = wrapped
        return wrapped


_PROXY = _CpuLiteralTorch()


def _proxy_torch_in(record: list, module_names: Iterable[str]) -> None:
    for module_name in module_names:
        module = importlib.import_module(module_name)
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(
                f"ferrule cpu_compat: {module_name} does not bind the name 'torch' to the torch "
                f"module; megatron-core changed (expected {MEGATRON_CORE_VERSION})."
            )
        _set(record, module, "torch", _PROXY)


#: Modules of the optimizer path with ``device='cuda'`` literals (megatron-core 0.16.1).
OPTIMIZER_LITERAL_MODULES = (
    "megatron.core.optimizer.optimizer",        # MixedPrecisionOptimizer/FP32Optimizer: found_inf, _scale
    "megatron.core.optimizer.clip_grads",       # get_grad_norm_fp32, clip_grad_by_total_norm_fp32, count_zeros_fp32
    "megatron.core.optimizer.grad_scaler",      # ConstantGradScaler / DynamicGradScaler
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",                      # local_multi_tensor_l2_norm (no-Apex fallback of clip_grads)
)


def patch_optimizer_device_literals(record: list) -> None:
    """Rewrite ``device='cuda'`` literals to CPU inside the optimizer modules only.

    Upstream: ``optimizer/optimizer.py`` (``FP32Optimizer.__init__``: ``self._scale =
    torch.tensor([1.0], ..., device='cuda')``; ``MixedPrecisionOptimizer.__init__``),
    ``optimizer/clip_grads.py`` (``total_norm_cuda``, ``dummy_overflow_buf``),
    ``optimizer/grad_scaler.py``, ``utils.py`` ``local_multi_tensor_l2_norm`` (the grad-norm
    fallback used without Apex/TE). Without the patch, ``get_megatron_optimizer`` raises
    ``AssertionError: Torch not compiled with CUDA enabled`` (or ``RuntimeError`` on a CUDA
    build without a device). The proxy touches only the name ``torch`` in
    :data:`OPTIMIZER_LITERAL_MODULES`, so no other torch call pays for it.
    """
    _proxy_torch_in(record, OPTIMIZER_LITERAL_MODULES)


def patch_schedules_device_literal(record: list) -> None:
    """Rewrite ``device="cuda"`` to CPU inside ``pipeline_parallel/schedules.py``.

    Upstream: ``forward_backward_no_pipelining`` and both 1F1B schedules allocate
    ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``. Without the patch,
    ``get_forward_backward_func()(...)`` raises ``AssertionError: Torch not compiled with CUDA
    enabled``.
    """
    _proxy_torch_in(record, ("megatron.core.pipeline_parallel.schedules",))


def patch_causal_mask_device_literal(record: list) -> None:
    """Rewrite ``device="cuda"`` to CPU inside ``transformer/utils.py``.

    Upstream: ``get_default_causal_mask`` / ``get_sliding_window_causal_mask`` build masks with
    ``device="cuda"``; megatron's ``DotProductAttention`` (via ``FusedScaleMaskSoftmax``) calls
    them when ``attention_mask is None``. Without the patch: ``AssertionError: Torch not
    compiled with CUDA enabled``. (ferrule's SDPA core attention never calls them.)
    """
    utils = importlib.import_module("megatron.core.transformer.utils")
    _proxy_torch_in(record, ("megatron.core.transformer.utils",))
    cached = getattr(utils.get_default_causal_mask, "cache_clear", None)
    if cached is not None:
        cached()


# ----------------------------------------------------------------------------------------
# Tensor.type() == 'torch.cuda.FloatTensor' checks: a scoped TorchFunctionMode
# ----------------------------------------------------------------------------------------

class _CudaTypeNameMode(TorchFunctionMode):
    """Inside this mode, ``cpu_tensor.type()`` (no arguments) reports ``'torch.cuda.<X>Tensor'``.

    Only entered by the optimizer functions listed in :data:`OPTIMIZER_TYPE_CHECK_SITES`.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return func(*args, **kwargs)


#: (module, qualified attribute) of every optimizer function that asserts on
#: ``Tensor.type()`` strings in megatron-core 0.16.1, plus the modules that import it by name.
OPTIMIZER_TYPE_CHECK_SITES = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
)


def _scoped(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaTypeNameMode():
            return fn(*args, **kwargs)

    wrapper.__ferrule_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


def patch_optimizer_type_checks(record: list) -> None:
    """Make the optimizer's ``param.type() == 'torch.cuda.FloatTensor'`` checks pass on CPU.

    Upstream: ``optimizer/distrib_optimizer.py`` ``_build_model_and_main_param_groups``
    raises ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...
    Received torch.FloatTensor``; ``optimizer/optimizer.py``
    ``Float16OptimizerWithFloat16Params.__init__`` raises the same; ``optimizer/clip_grads.py``
    ``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
    Each listed function runs inside :class:`_CudaTypeNameMode`; nothing else sees the lie.
    """
    for module_name, qualname in OPTIMIZER_TYPE_CHECK_SITES:
        module = importlib.import_module(module_name)
        owner: Any = module
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(raw, staticmethod):
            _set(record, owner, attr, staticmethod(_scoped(raw.__func__)))
        elif isinstance(raw, classmethod):
            _set(record, owner, attr, classmethod(_scoped(raw.__func__)))
        else:
            _set(record, owner, attr, _scoped(raw))


# ----------------------------------------------------------------------------------------
# Tied embeddings at PP > 1: ``weight.data.cuda()`` before the embedding-group all-reduce
# ----------------------------------------------------------------------------------------

class _CudaIsIdentityMode(TorchFunctionMode):
    """Inside this mode ``Tensor.cuda()`` returns the CPU tensor itself (only entered by
    ``LanguageModule.setup_embeddings_and_output_layer``, see :func:`patch_embedding_group_cuda`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def patch_embedding_group_cuda(record: list) -> None:
    """Tied word embeddings at pipeline size > 1: the first/last-stage all-reduce runs on CPU.

    Upstream: ``models/common/language_module/language_module.py``
    ``LanguageModule.setup_embeddings_and_output_layer`` moves the shared embedding weight with
    ``weight.data = weight.data.cuda()`` before ``all_reduce(weight.data, group=embd_group)``
    (the last stage's zeroed copy receives the first stage's values). Without the patch:
    ``AssertionError: Torch not compiled with CUDA enabled`` when a model with
    ``share_embeddings_and_output_weights`` is built at PP > 1. The method runs inside a
    scoped mode where ``Tensor.cuda()`` is the identity; the gloo all-reduce then runs on the
    CPU tensor. The gradient all-reduce of the tied weights
    (``distributed/finalize_model_grads.py`` ``_allreduce_embedding_grad``) has no device literal.
    """
    module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    owner = module.LanguageModule
    raw = owner.__dict__["setup_embeddings_and_output_layer"]

    @functools.wraps(raw)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _CudaIsIdentityMode():
            return raw(*args, **kwargs)

    wrapper.__ferrule_cpu_compat__ = True  # type: ignore[attr-defined]
    _set(record, owner, "setup_embeddings_and_output_layer", wrapper)


# ----------------------------------------------------------------------------------------
# Table, apply, revert
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Patch:
    """One CPU patch: its name, the function that installs it and the upstream site it covers."""

    name: str
    install: Callable[[list], None]
    upstream_site: str

    @property
    def reason(self) -> str:
        """The patch function's docstring (the upstream error and why)."""
        return (self.install.__doc__ or "").strip()


#: Every patch, in installation order.
PATCHES: tuple[Patch, ...] = (
    Patch("current_device", patch_current_device, "megatron/core/utils.py:GlobalMemoryBuffer.get_tensor"),
    Patch("synchronize", patch_synchronize, "megatron/core/dist_checkpointing/strategies/filesystem_async.py"),
    Patch("streams", patch_streams, "megatron/core/transformer/moe/token_dispatcher.py:MoEAlltoAllTokenDispatcher"),
    Patch("moe_split_sizes", patch_moe_split_sizes, "megatron/core/transformer/moe/moe_utils.py:maybe_move_tensor_to_cpu"),
    Patch("gloo_scatter_contiguous", patch_gloo_scatter_contiguous, "torch/distributed/distributed_c10d.py:scatter (gloo)"),
    Patch("optimizer_device_literals", patch_optimizer_device_literals, "megatron/core/optimizer/{optimizer,clip_grads,grad_scaler}.py"),
    Patch("optimizer_type_checks", patch_optimizer_type_checks, "megatron/core/optimizer/{distrib_optimizer,optimizer,clip_grads}.py"),
    Patch("schedules_device_literal", patch_schedules_device_literal, "megatron/core/pipeline_parallel/schedules.py"),
    Patch("causal_mask_device_literal", patch_causal_mask_device_literal, "megatron/core/transformer/utils.py:get_default_causal_mask"),
    Patch("embedding_group_cuda", patch_embedding_group_cuda,
          "megatron/core/models/common/language_module/language_module.py:setup_embeddings_and_output_layer"),
)

PATCH_NAMES = tuple(p.name for p in PATCHES)


def apply(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Install every patch not already installed (idempotent); returns the installed names.

    Args:
        exclude: patch names to leave out (tests use it to show upstream still needs a patch).

    Raises:
        RuntimeError: CUDA is available (the patches are for CUDA-less machines only).
        ValueError: ``exclude`` names an unknown patch.
    """
    exclude = set(exclude)
    unknown = exclude - set(PATCH_NAMES)
    if unknown:
        raise ValueError(f"cpu_compat.apply: unknown patch names {sorted(unknown)}; known: {list(PATCH_NAMES)}.")
    if torch.cuda.is_available():
        raise RuntimeError("ferrule cpu_compat must not be applied on a machine with CUDA; use DeviceBackend('cuda').")
    with _LOCK:
        for patch in PATCHES:
            if patch.name in exclude or patch.name in _APPLIED:
                continue
            record: list = []
            try:
                patch.install(record)
            except BaseException:
                _undo(record)
                raise
            _APPLIED[patch.name] = record
        return applied()


def applied() -> tuple[str, ...]:
    """Names of the patches currently installed, in table order."""
    return tuple(n for n in PATCH_NAMES if n in _APPLIED)


def _undo(record: list) -> None:
    for owner, attr, original in reversed(record):
        if original is _MISSING:
            try:
                delattr(owner, attr)
            except AttributeError:
                pass
        else:
            setattr(owner, attr, original)


def revert(names: Iterable[str] | None = None) -> None:
    """Undo installed patches (all by default), restoring the original attributes."""
    with _LOCK:
        for name in reversed(PATCH_NAMES):
            if name in _APPLIED and (names is None or name in set(names)):
                _undo(_APPLIED.pop(name))
