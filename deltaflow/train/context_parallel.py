"""Moved to :mod:`deltaflow.parallel.data_layout` (parallelism lives in one package); this name
still imports."""

from deltaflow.parallel.data_layout import DataLayout

__all__ = ["DataLayout"]
