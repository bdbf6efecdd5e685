"""Old import path of :mod:`ferrule.mapping.table` (kept so that existing imports keep working)."""

from ferrule.mapping.table import HFAssembler, MappingTable

__all__ = ["HFAssembler", "MappingTable"]
