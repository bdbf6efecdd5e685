"""ferrule-llama: the Llama model family (Llama-2/3 style, SmolLM2) as an out-of-tree ferrule plugin.

Registered through the ``ferrule`` entry-point group (``llama = "ferrule_llama.plugin"``).
Modules: :mod:`ferrule_llama.plugin` (hookimpls returning specs), :mod:`ferrule_llama.llama`
(config translation, provider, mapping table, update groups, tiny test config),
:mod:`ferrule_llama.tokenizer` (SmolLM2 tokenizer from the GGUF header), ``templates/``.

Importing this package imports neither torch, megatron nor transformers.
"""

__version__ = "0.1.0"
