"""CPU patches of megatron-core 0.16.1 for hard-coded CUDA: ``device="cuda"`` literals (a
module-local ``torch`` proxy), ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks (a scoped
``TorchFunctionMode``) and ``Tensor.cuda()`` in the tied-embedding setup. Part of the table of
:mod:`ferrule.megatron.cpu_compat` (its docstring has the rules; it applies these patches).
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from .patching import MEGATRON_CORE_VERSION, is_cuda_device
from .patching import set_attr as _set

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
