"""deltaflow.parallel: everything about training on several processes, in one package.

- :mod:`~deltaflow.parallel.context`: one sequence across several processes (context
  parallelism): the segmented op and the layers' halo and state exchange.
- :mod:`~deltaflow.parallel.data_layout`: which rows and tokens of the global batch a rank
  trains on (data-parallel groups x context-parallel ranks): the trainer's side.
- :mod:`~deltaflow.parallel.fsdp`: FSDP2 sharding and the full weights of a sharded model
  (imported on use: DDP and single-process runs never load it).

from deltaflow.parallel import enable_context_parallel
cp = enable_context_parallel(model, group)   # then feed each rank its segment of every row
"""

from deltaflow.parallel.context import (
    ContextParallel,
    context_parallel_delta_rule,
    disable_context_parallel,
    enable_context_parallel,
    exchange_halo,
)

__all__ = [
    "ContextParallel",
    "context_parallel_delta_rule",
    "disable_context_parallel",
    "enable_context_parallel",
    "exchange_halo",
]
