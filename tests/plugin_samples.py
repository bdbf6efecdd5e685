"""Small plugin objects used by tests/test_registry.py (loaded through fake entry points), and the broken
environment packages of tests/test_agent_envs.py (what a user's first environment gets wrong)."""

from ferrule import hookimpl
from ferrule.contract.specs import (
    ConverterSpec,
    FamilyStatus,
    ModelFamilySpec,
    ProviderSpec,
    UpdateGroup,
    UpdateGroupTable,
)


class GoodPlugin:
    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="demo", model_types=("demo_lm",), status=FamilyStatus.STRUCTURAL,
                                reason="test fixture")]


class ClashingPlugin:
    """Claims model_type ``demo_lm`` again, under another family name."""

    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="demo_two", model_types=("demo_lm",), status=FamilyStatus.STRUCTURAL,
                                reason="test fixture")]


class SameFamilyPlugin:
    """Claims family ``demo`` again."""

    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="demo", model_types=("other_lm",), status=FamilyStatus.STRUCTURAL,
                                reason="test fixture")]


class MisspelledPlugin:
    @hookimpl
    def register_model_familys(self):  # misspelled on purpose
        return []


class RaisingHookPlugin:
    @hookimpl
    def register_model_families(self):
        raise RuntimeError("boom in register_model_families")


class ResolverPlugin:
    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="resolved", model_types=("resolved_lm",), status=FamilyStatus.STRUCTURAL,
                                reason="test fixture")]

    @hookimpl
    def resolve_model_family(self, hf_config):
        if hf_config.get("architectures") == ["LegacyResolvedModel"]:
            return "resolved"
        return None


class WrongTypePlugin:
    @hookimpl
    def register_providers(self):
        return ["not a spec"]


class IncompleteValidatedPlugin:
    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="half", model_types=("half_lm",), status=FamilyStatus.VALIDATED)]

    @hookimpl
    def register_providers(self):
        return [ProviderSpec(family="half", build="os.path:join")]


class CompletePlugin:
    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="full", model_types=("full_lm",), status=FamilyStatus.VALIDATED)]

    @hookimpl
    def register_providers(self):
        return [ProviderSpec(family="full", build="os.path:join")]

    @hookimpl
    def register_converters(self):
        return [ConverterSpec(family="full", mapping="os.path:sep", config_translation="os.path:sep")]

    @hookimpl
    def register_update_groups(self):
        return [UpdateGroupTable(family="full", groups=(UpdateGroup(key="all", suffixes=(".weight",)),))]


good = GoodPlugin()
clashing = ClashingPlugin()
misspelled = MisspelledPlugin()


class FeaturesPlugin:
    """A family declaring lora, chat_template and towers, plus a generic '*' LoRA applier."""

    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="mm", model_types=("mm_lm",), status=FamilyStatus.STRUCTURAL,
                                reason="test fixture", features=("lora", "chat_template", "towers"))]

    @hookimpl
    def register_lora_appliers(self):
        from ferrule.contract.specs import LoRAApplierSpec

        ref = "os.path:join"
        return [LoRAApplierSpec(kind="attention", family="*", apply=ref, export=ref, load=ref),
                LoRAApplierSpec(kind="lm_head", family="*", apply=ref, export=ref, load=ref),
                LoRAApplierSpec(kind="attention", family="mm", apply="os.path:split", export=ref, load=ref)]

    @hookimpl
    def register_chat_templates(self):
        from ferrule.contract.specs import ChatTemplateSpec

        return [ChatTemplateSpec(name="mm_chat", family="mm", template="ferrule.plugins.qwen:templates/x.jinja",
                                 stop_tokens=("<end>",))]

    @hookimpl
    def register_towers(self):
        from ferrule.contract.specs import TowerSpec

        return [TowerSpec(family="mm", modality="vision", build="os.path:join", placeholder_token_id=5),
                TowerSpec(family="mm", modality="audio", build="os.path:join", placeholder_token_id=6)]


class SecondTowerPlugin:
    @hookimpl
    def register_towers(self):
        from ferrule.contract.specs import TowerSpec

        return [TowerSpec(family="mm", modality="vision", build="os.path:join", placeholder_token_id=9)]


def hello_command(name: str = "world") -> None:
    """Say hello (a plugin-contributed command)."""
    print(f"hello {name}")


class CommandPlugin:
    """Contributes `ferrule hello` (a function) through register_commands."""

    @hookimpl
    def register_commands(self):
        from ferrule.contract.specs import CommandSpec

        return [CommandSpec(name="hello", app="plugin_samples:hello_command", help="Say hello.")]


class ShadowingCommandPlugin:
    """Tries to replace the built-in `ferrule convert`."""

    @hookimpl
    def register_commands(self):
        from ferrule.contract.specs import CommandSpec

        return [CommandSpec(name="convert", app="plugin_samples:hello_command")]


class BrokenCommandPlugin:
    @hookimpl
    def register_commands(self):
        from ferrule.contract.specs import CommandSpec

        return [CommandSpec(name="broken", app="no_such_module_xyz:app")]


#: update groups named lazily by LazyFamilyPlugin
LAZY_GROUPS = (UpdateGroup(key="all", suffixes=("weight",)),)


class LazyFamilyPlugin:
    """A family whose provider takes the default build and whose update groups are a reference."""

    @hookimpl
    def register_model_families(self):
        return [ModelFamilySpec(name="lazy", model_types=("lazy_lm",), status=FamilyStatus.VALIDATED)]

    @hookimpl
    def register_providers(self):
        return [ProviderSpec(family="lazy")]

    @hookimpl
    def register_converters(self):
        return [ConverterSpec(family="lazy", mapping="os.path:join", config_translation="plugin_samples:LAZY_GROUPS")]

    @hookimpl
    def register_update_groups(self):
        return [UpdateGroupTable(family="lazy", groups="plugin_samples:LAZY_GROUPS")]


commands = CommandPlugin()
shadowing_commands = ShadowingCommandPlugin()
broken_commands = BrokenCommandPlugin()


# ------------------------------------------------------------------ environments a user gets wrong

class StartFails:
    """An environment whose constructor raises (a missing word list)."""

    def __init__(self, **kwargs):
        raise RuntimeError("word list file missing")


class NoStep:
    """An environment object without ``step`` (and with ``reset`` misspelt)."""

    def dataset(self, size, seed):
        return [{"k": i} for i in range(size)]

    def rest(self, item, seed):
        return None


class DatasetOf:
    """An environment whose ``dataset`` raises (``items=None``) or returns ``items`` as they are."""

    def __init__(self, items=None):
        self.items = items

    def dataset(self, size, seed):
        if self.items is None:
            raise OSError("cannot read words.txt")
        return self.items

    def reset(self, item, seed):
        return None

    def step(self, state, turn):
        return None


class BrokenEnvironmentsPlugin:
    @hookimpl
    def register_environments(self):
        from ferrule.contract.specs import EnvironmentSpec

        return [EnvironmentSpec(name="no_module", factory="plugin_samples_nowhere:Env"),
                EnvironmentSpec(name="no_attr", factory="plugin_samples:Nowhere"),
                EnvironmentSpec(name="start_fails", factory="plugin_samples:StartFails"),
                EnvironmentSpec(name="no_step", factory="plugin_samples:NoStep"),
                EnvironmentSpec(name="dataset_of", factory="plugin_samples:DatasetOf"),
                EnvironmentSpec(name="guess", factory="ferrule.rl.envs.builtin:GuessNumber")]
