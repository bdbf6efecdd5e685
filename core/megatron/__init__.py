"""Megatron-Core train-engine runtime: device backend, CPU compatibility, parallel layout,
SDPA core attention and the GPT model builder.

Import-light: submodules are imported on demand (``ferrule.megatron.device``,
``.parallel``, ``.gpt_builder``, ``.attention``, ``.cpu_compat``). ``cpu_compat`` is only ever
imported by :func:`ferrule.megatron.device.get_backend` on a machine without CUDA.

Importing this package installs narrow ``warnings`` filters for megatron-core 0.16.1 warnings that
are known to be harmless for ferrule (:data:`KNOWN_HARMLESS_WARNINGS`: each matches one message,
one category and only warnings raised from ``megatron.*`` modules); every other warning stays
visible. Every ferrule module that uses megatron imports it through this package first.
"""

import warnings

__all__ = ["device", "parallel", "gpt_builder", "attention", "KNOWN_HARMLESS_WARNINGS", "silence_known_warnings"]

#: (message regex, category, why it is harmless). Seen 7 times per process before these filters.
KNOWN_HARMLESS_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"Transformer Engine and Apex are not installed", UserWarning,
     "ferrule runs without TE/Apex by design (torch optimizers and norms, SDPA attention)"),
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, "the same, for layer norms"),
    (r"full scope is deprecated", UserWarning,
     "megatron's own TransformerConfig default (cuda_graph_scope); ferrule captures no megatron graphs"),
    (r"Warning: tp_group is None, using default tp group", DeprecationWarning,
     "raised from megatron's own layer constructors; the default group is the one ferrule initializes"),
    (r"MLP requires ffn_hidden_size, but it was not provided", DeprecationWarning,
     "megatron's layer specs; config.ffn_hidden_size is what ferrule sets"),
    (r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'", DeprecationWarning,
     "an import inside megatron-core itself"),
    (r"The following imports from `dynamic_context\.py` will be removed", DeprecationWarning,
     "an import inside megatron-core itself"),
)



def silence_known_warnings() -> None:
    """Install the :data:`KNOWN_HARMLESS_WARNINGS` filters (done once at import of this package)."""
    for message, category, _why in KNOWN_HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=r"megatron\.")


silence_known_warnings()
