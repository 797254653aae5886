"""deltaflow.parallel: training one sequence across several processes (context parallelism).

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
