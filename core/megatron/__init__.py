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

megatron's ``torch.compile`` decorations are deferred on a machine without CUDA by the import hook
that ``import ferrule`` installs (:mod:`ferrule.lazy_jit`), before any of this package is imported.
"""

import warnings

from ferrule.compat import renamed_name

__all__ = ["device", "parallel", "gpt_builder", "attention", "KNOWN_HARMLESS_WARNINGS", "silence_known_warnings"]

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


def __getattr__(name: str):  # lazy_compile, defer_jit_fuser: moved to ferrule.lazy_jit (ferrule.compat)
    return renamed_name(__name__, name)
