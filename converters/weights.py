"""Old import path of the live-weight functions, which moved to :mod:`ferrule.megatron.weights`.

Loading, export and weight sync share one implementation there (the train engine uses it and
no ``core`` module imports the converters); the converters use it for checkpoint conversion.
Kept so that ``from ferrule.converters.weights import ...`` keeps working.
"""

from ferrule.megatron.weights import (  # noqa: F401
    ParallelRanks,
    export_mcore_to_hf,
    global_param_names,
    load_hf_into_mcore,
    unwrap,
)

__all__ = ["ParallelRanks", "global_param_names", "load_hf_into_mcore", "export_mcore_to_hf", "unwrap"]
