"""Every old public import path of ferrule, in one table, kept working for one release with a warning.

When a module moves or a public name is renamed, the old spelling goes here, not into a re-export
module at the old place: :data:`MOVED_MODULES` maps an old module path to the new one (``import
ferrule.fsutil`` and ``from ferrule import fsutil`` return :mod:`ferrule.fs.util` itself, the same
module object, after a :class:`DeprecationWarning` naming the new path), :data:`RENAMED_NAMES` maps
``(module, old attribute)`` to the new ``"module:attr"`` (a package's ``__getattr__`` calls
:func:`renamed_name`). ferrule's own code never uses these names (``tests/test_layering.py``
checks it); they are for users' code and plugin packages written against the previous release,
and go away in the next one.

:func:`install` (called once by ``ferrule/__init__.py``) puts the finder on ``sys.meta_path``.
Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

__all__ = ["MOVED_MODULES", "PUBLIC_FACADES", "RENAMED_NAMES", "install", "renamed_name"]

#: old module path -> new module path (issue 43: the top of core/ grouped by concept).
MOVED_MODULES: dict[str, str] = {
    # the ferrule app's commands in ferrule.cli, the converters' (convert, check) with the converters they
    # drive, the user-error table in the foundation (every command imports it, wherever it lives)
    "ferrule.cli_chat": "ferrule.cli.chat",
    "ferrule.cli_errors": "ferrule.user_errors",
    "ferrule.cli.errors": "ferrule.user_errors",
    "ferrule.rl.cli_train": "ferrule.cli.train",
    "ferrule.rl.cli_plot": "ferrule.cli.plot",
    "ferrule.serve.cli": "ferrule.cli.serve",
    "ferrule.lora.cli": "ferrule.cli.lora",
    "ferrule.converters.cli": "ferrule.converters.commands",
    "ferrule.converters.cli_check": "ferrule.converters.commands",
    # the live-weight functions, with the train engine since before this release; the module was a re-export
    "ferrule.converters.weights": "ferrule.megatron.weights",
    # checkpoint formats in ferrule.formats
    "ferrule.quantized_weights": "ferrule.formats.quantized_weights",
    "ferrule.nvfp4": "ferrule.formats.nvfp4",
    "ferrule.safetensors_io": "ferrule.formats.safetensors_io",
    "ferrule.converters.safetensors_io": "ferrule.formats.safetensors_io",  # older still: before the core had it
    # file-system helpers in ferrule.fs
    "ferrule.fsutil": "ferrule.fs.util",
    "ferrule.locks": "ferrule.fs.locks",
    "ferrule.integrity": "ferrule.fs.integrity",
    "ferrule.output_dir": "ferrule.fs.output_dir",
    "ferrule.run_layout": "ferrule.fs.run_layout",
    # shared translation rows with the translation vocabulary
    "ferrule.config_layer_types": "ferrule.config_translation.layer_types",
    # the mapping package's table (issue 23's split)
    "ferrule.mapping_table": "ferrule.mapping.table",
    # the conformance kit as one package
    "ferrule.testing": "ferrule.conformance.kit",
    "ferrule.conformance_numeric": "ferrule.conformance.numeric",
    "ferrule.conformance_tp": "ferrule.conformance.tp",
    "ferrule.conformance_media": "ferrule.conformance.media",
    "ferrule.conformance_fields": "ferrule.conformance.fields",
    "ferrule.conformance_build": "ferrule.conformance.build",
    # the plugin contract as one package (issue 43, round 2); plugin_loading merged back into the registry
    # it was split from for its line count
    "ferrule.specs": "ferrule.contract.specs",
    "ferrule.variants": "ferrule.contract.variants",
    "ferrule.hookspecs": "ferrule.contract.hookspecs",
    "ferrule.hook_parts": "ferrule.contract.hook_parts",
    "ferrule.registry": "ferrule.contract.registry",
    "ferrule.plugin_loading": "ferrule.contract.registry",
    # the chat format together: templates (ferrule.chat) and tool-call parsing
    "ferrule.tool_calls": "ferrule.chat.tool_calls",
    # family files named by role (issue 43)
    "ferrule.plugins.inkling.inkling_mm": "ferrule.plugins.inkling.inkling",
    "ferrule.plugins.inkling2.inkling2_mm": "ferrule.plugins.inkling2.inkling2",
    "ferrule.plugins.inkling2.vision": "ferrule.plugins.inkling2.towers",
    # the TMLv0 chat format, shared by Inkling and Inkling-2, in the core (its template:
    # "ferrule.tmlv0:templates/tmlv0.jinja", was "ferrule.plugins.inkling:templates/tmlv0.jinja")
    "ferrule.plugins.inkling.tokenizer": "ferrule.tmlv0.tokenizer",
    "ferrule.plugins.inkling.tool_calls": "ferrule.tmlv0.tool_calls",
    # example asset builders and rewards out of the wheel: the ferrule-examples package of a checkout
    # (examples/ferrule-examples, installed by ./install.sh)
    "ferrule.plugins.inkling.synthetic": "ferrule_examples.inkling_synthetic",
    "ferrule.plugins.inkling.shapes": "ferrule_examples.inkling_shapes",
    "ferrule.plugins.inkling2.synthetic": "ferrule_examples.inkling2_synthetic",
    "ferrule.plugins.inkling2.shapes": "ferrule_examples.inkling2_shapes",
    "ferrule.plugins.builder_cli": "ferrule_examples.builder_cli",
}

#: (module, old attribute) -> "new module:attr".
RENAMED_NAMES: dict[tuple[str, str], str] = {
    # it clashed with collections.abc.Mapping
    ("ferrule.mapping", "Mapping"): "ferrule.mapping.vocabulary:ParamMapping",
    # the convert sub-app shares ferrule.converters.commands with ferrule check (was ferrule.converters.cli:app)
    ("ferrule.converters.commands", "app"): "ferrule.converters.commands:convert_app",
    # the CPU deferral of megatron's torch.compile decorations, installed by `import ferrule` (was by ferrule.megatron)
    **{("ferrule.megatron", n): f"ferrule.lazy_jit:{n}" for n in ("lazy_compile", "defer_jit_fuser")},
    # what Inkling and Inkling-2 share, in the core (issue 43: Inkling-2 imports nothing of Inkling)
    ("ferrule.plugins.inkling.config", "LAYER_TYPES"): "ferrule.config_translation.layer_types:HYBRID_LAYER_TYPES",
    ("ferrule.plugins.inkling.layers", "InklingNormedEmbedding"): "ferrule.megatron.shared_layers:InklingNormedEmbedding",
    # ferrule.converters.checkpoint re-exported what was split out of it (issue 43: no re-export inside ferrule)
    ("ferrule.converters.checkpoint", "hf_side_files"): "ferrule.megatron.checkpoint:hf_side_files",
    **{("ferrule.converters.checkpoint", n): f"ferrule.fs.output_dir:{n}" for n in ("lock_output", "output_lock")},
    # ferrule.megatron.weights re-exported layers 1 and 2 (bind, gather) of ferrule.megatron.param_gather and HFAssembler
    **{("ferrule.megatron.weights", n): f"ferrule.megatron.param_gather:{n}"
       for n in ("BoundParam", "GatherStep", "ParallelRanks", "agreed_errors", "all_gather_objects", "bind_params",
                 "global_param_names", "iter_full", "mapping_context", "agree_padded_vocab", "model_chunks", "plan_gather",
                 "gather_tp", "unwrap")},
    ("ferrule.megatron.weights", "HFAssembler"): "ferrule.mapping:HFAssembler",
    # ferrule.megatron.gpt_builder re-exported the config half it was split from (ferrule.megatron.gpt_config)
    **{("ferrule.megatron.gpt_builder", n): f"ferrule.megatron.gpt_config:{n}"
       for n in ("ACTIVATIONS", "DEFAULT_VOCAB_DIVISIBLE_BY", "check_family_layout", "check_layout_fits", "gelu_tanh",
                 "make_transformer_config", "padded_vocab_size")},
    # ferrule.megatron.towers re-exported the media format's error and check
    **{("ferrule.megatron.towers", n): f"ferrule.media:{n}" for n in ("MediaError", "check_media")},
    # ferrule.megatron.cpu_compat re-exported two names of ferrule.megatron.patching
    **{("ferrule.megatron.cpu_compat", n): f"ferrule.megatron.patching:{n}"
       for n in ("MEGATRON_CORE_VERSION", "is_cuda_device")},
    # the run folder's layout moved to ferrule.fs.run_layout; ferrule.rl.checkpoints re-exported it
    **{("ferrule.rl.checkpoints", n): f"ferrule.fs.run_layout:{n}"
       for n in ("LOOP_STATE_FILE", "RunCheckpointError", "find_run_checkpoint", "list_checkpoints")},
}


#: Public facades: modules that re-export, on purpose and without a warning, names defined in the modules they
#: were split into, because users import them there (documented paths, not compatibility names). ferrule's own
#: code imports each name from the module that defines it.
PUBLIC_FACADES: dict[str, tuple[str, ...]] = {
    # the config API of `ferrule train` (docs/train.md: load_config, RLConfig, ConfigError, the section classes)
    "ferrule.rl.config": ("ferrule.rl.config_schema", "ferrule.rl.config_types", "ferrule.fs.run_layout"),
}

def _warn(message: str, skip: int = 0) -> None:
    # point the warning at the importing code: past this module's frames and ``skip`` more (a
    # package's __getattr__); warnings itself steps over the import machinery's frames
    level, frame = 2, sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
            continue
        if frame.f_code.co_filename != __file__:
            if skip == 0:
                break
            skip -= 1
        level, frame = level + 1, frame.f_back
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def renamed_name(module: str, name: str) -> Any:
    """The object an old attribute ``module.name`` now is, after a :class:`DeprecationWarning`.

    For a package's ``__getattr__`` (PEP 562): ``def __getattr__(name): return renamed_name(__name__, name)``.

    Raises:
        AttributeError: ``name`` is not an old name of ``module`` (the usual message).
    """
    target = RENAMED_NAMES.get((module, name))
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, _, attr = target.partition(":")
    what = f"moved to {new_module}" if attr == name else f"is renamed {attr} ({new_module}.{attr})"
    _warn(f"{module}.{name} {what}; the old name goes away in the next release.", skip=1)
    return getattr(importlib.import_module(new_module), attr)


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as the new module itself (one module object under both names)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self._spec  # the import system set the old path's spec on the shared module
        _warn(f"{self.old} moved to {self.new}; import it from there (the old path goes away in the next release).")


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(fullname, new))


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Put the old-path finder first on ``sys.meta_path`` (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
