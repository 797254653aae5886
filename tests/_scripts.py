"""Load one of the repository's scripts (experiments/, benchmarks/) as a module: they are not in
the deltaflow package, and tests call their functions directly."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> types.ModuleType:
    """``relative_path`` from the repository root, e.g. ``experiments/collect_device.py``."""
    path = REPO / relative_path
    # as `python benchmarks/X.py` does: the script's folder first on sys.path (`from _common ...`)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
