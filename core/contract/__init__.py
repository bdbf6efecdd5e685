"""The plugin contract: what a family plugin hands ferrule, and how ferrule finds and asks it.

Bottom to top (each imports only those above it in this list):

- :mod:`ferrule.contract.specs`: the frozen spec dataclasses a plugin returns (families,
  providers, converters, update groups, chat templates, towers, LoRA appliers, commands,
  environments, tool parsers) and ``"module:attr"`` references;
- :mod:`ferrule.contract.variants`: a family's variants declared as data, and the hook bodies
  every family plugin shares;
- :mod:`ferrule.contract.hookspecs`: the pluggy hook specifications, and
  :mod:`ferrule.contract.hook_parts`: their one table (hook, spec type, registry lookup);
- :mod:`ferrule.contract.registry`: plugin loading (entry points of group ``ferrule``, each in
  isolation) and the typed lookups everything else asks.

Importing this package imports none of them, and none imports torch or megatron.
"""
