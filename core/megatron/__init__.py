"""Megatron-Core train-engine runtime: device backend, CPU compatibility, parallel layout,
SDPA core attention, the GPT model builder, and the one module that moves live weights
(:mod:`ferrule.megatron.weights`: bind, TP/EP/PP gather, HF load and export).

Import-light: submodules are imported on demand (``ferrule.megatron.device``,
``.parallel``, ``.gpt_builder``, ``.attention``, ``.cpu_compat``). ``cpu_compat`` is only ever
imported by :func:`ferrule.megatron.device.get_backend` on a machine without CUDA.

Importing this package installs narrow ``warnings`` filters for megatron-core 0.16.1 warnings that
are known to be harmless for ferrule (:data:`KNOWN_HARMLESS_WARNINGS`: each matches one message,
one category and only warnings attributed to megatron modules or to the torch modules that warn
about megatron's calls); every other warning stays visible. Every ferrule module that uses megatron imports it through this package first.

On a machine without CUDA it also defers megatron's ``torch.compile`` decorations (:func:`defer_jit_fuser`):
megatron-core 0.16.1 decorates ~38 fused elementwise functions with ``megatron.core.jit.jit_fuser``
(``torch.compile``) at import, and the first ``torch.compile`` call imports torch's inductor
(``torch._inductor.compile_fx``): 2-5 s of every interpreter that imports megatron, for kernels that a
CPU run never calls (ferrule turns megatron's fusions on only on CUDA: :mod:`ferrule.megatron.gpu_fusions`).
"""

import functools
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["device", "parallel", "gpt_builder", "attention", "KNOWN_HARMLESS_WARNINGS", "silence_known_warnings",
           "defer_jit_fuser"]

#: (message regex, category, module regex, why it is harmless). Each matches one message, one
#: category and only warnings attributed to the given modules (megatron-core, or the torch modules
#: that warn when megatron-core 0.16.1 calls a torch API torch 2.13 deprecates; ferrule itself
#: calls none of those APIs). Seen 7 times per process (more on checkpoint loads) before these filters.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\.",
     "ferrule runs without TE/Apex by design (torch optimizers and norms, SDPA attention)"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\.", "the same, for layer norms"),
    (r"full scope is deprecated", UserWarning, r"megatron\.",
     "megatron's own TransformerConfig default (cuda_graph_scope); ferrule captures no megatron graphs"),
    (r"Warning: tp_group is None, using default tp group", DeprecationWarning, r"megatron\.",
     "raised from megatron's own layer constructors; the default group is the one ferrule initializes"),
    (r"MLP requires ffn_hidden_size, but it was not provided", DeprecationWarning, r"megatron\.",
     "megatron's layer specs; config.ffn_hidden_size is what ferrule sets"),
    (r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'", DeprecationWarning, r"megatron\.",
     "an import inside megatron-core itself"),
    (r"The following imports from `dynamic_context\.py` will be removed", DeprecationWarning, r"megatron\.",
     "an import inside megatron-core itself"),
    (r"`load_state_dict` is deprecated", FutureWarning, r"megatron\.core\.dist_checkpointing\.",
     "megatron's torch_dist load strategy calls torch.distributed.checkpoint.load_state_dict"),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
     r"torch\.distributed\.checkpoint\.", "megatron's torch_dist format is built on ShardedTensor"),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger", "megatron's DDP / distributed optimizer collectives"),
)


def silence_known_warnings() -> None:
    """Install the :data:`KNOWN_HARMLESS_WARNINGS` filters (done once at import of this package)."""
    for message, category, module, _why in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


silence_known_warnings()


def lazy_compile(fn=None, **options):
    """``torch.compile(fn, **options)`` made on ``fn``'s first call instead of at decoration (``fn`` runs
    compiled from its first call on, exactly as under ``torch.compile``, which compiles at the first call
    too); usable bare (``@lazy_compile``) or with options, as ``torch.compile`` is."""
    if fn is None:
        return functools.partial(lazy_compile, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def defer_jit_fuser(jit_module) -> bool:
    """Replace ``megatron.core.jit.jit_fuser`` (``torch.compile``) by :func:`lazy_compile` on a machine
    without CUDA, before megatron's fused functions are decorated with it. True if replaced."""
    import torch

    if torch.cuda.is_available() or getattr(jit_module, "jit_fuser", None) is not torch.compile:
        return False
    jit_module.jit_fuser = lazy_compile
    return True


class _DeferJitFuser(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finder does and runs :func:`defer_jit_fuser` right after it
    executes (megatron's modules take ``jit_fuser`` from it as they are imported, after it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            defer_jit_fuser(module)

        spec.loader.exec_module = exec_module
        return spec


if "megatron.core.jit" not in sys.modules and not any(isinstance(f, _DeferJitFuser) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeferJitFuser())
