"""Moved to :mod:`deltaflow.parallel.fsdp` (parallelism lives in one package); this name still
imports."""

from deltaflow.parallel.fsdp import full_state_dict, shard_model, shard_units, tied_aliases

__all__ = ["full_state_dict", "shard_model", "shard_units", "tied_aliases"]
