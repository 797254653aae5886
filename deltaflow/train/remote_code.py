"""The files that let an export load without deltaflow installed (``trust_remote_code``).

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` reads ``auto_map`` in
``config.json`` and imports ``modeling_deltaflow.py`` from the folder. That file imports
deltaflow when it is installed; otherwise the package's source, bundled beside it as one
module (``deltaflow_source.py``: a base64 zip of every ``deltaflow/*.py``, ~0.4 MB), is
unpacked next to transformers' copy of the module and imported from there. The bundle is the
source of the deltaflow that wrote the export, so the weights always meet the code that
trained them.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import zipfile
from pathlib import Path

MODELING = "modeling_deltaflow"
BUNDLE = "deltaflow_source"
AUTO_MAP = {
    "AutoConfig": f"{MODELING}.DeltaFlowConfig",
    "AutoModel": f"{MODELING}.DeltaFlowModel",
    "AutoModelForCausalLM": f"{MODELING}.DeltaFlowForCausalLM",
}

_MODELING_SOURCE = '''"""DeltaFlow for transformers' trust_remote_code (from `deltaflow export`).

Uses the installed deltaflow, else the source bundled in deltaflow_source.py.
"""

try:
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM, DeltaFlowModel
except ImportError:  # deltaflow is not installed: the source of the deltaflow that wrote this
    from .deltaflow_source import unpack

    unpack()
    from deltaflow.models import DeltaFlowConfig, DeltaFlowForCausalLM, DeltaFlowModel

__all__ = ["DeltaFlowConfig", "DeltaFlowForCausalLM", "DeltaFlowModel"]
'''

_BUNDLE_SOURCE = '''"""The source of deltaflow {version} (a base64 zip), unpacked on first use."""

import base64
import io
import os
import sys
import zipfile
from pathlib import Path

DIGEST = "{digest}"
DATA = (
{data}
)


def unpack() -> None:
    """Unpack beside this file (once) and put it first on sys.path."""
    target = Path(__file__).with_name("deltaflow_src_" + DIGEST)
    if not (target / "deltaflow" / "__init__.py").is_file():
        tmp = target.with_name(target.name + ".tmp-" + str(os.getpid()))
        zipfile.ZipFile(io.BytesIO(base64.b64decode("".join(DATA)))).extractall(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process unpacked it first
            pass
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
'''


def _source_zip() -> bytes:
    """Every ``.py`` of the deltaflow package, with fixed timestamps (same source, same
    bytes)."""
    import deltaflow

    root = Path(deltaflow.__file__).parent
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            info = zipfile.ZipInfo(str(Path("deltaflow") / path.relative_to(root)))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    return buf.getvalue()


def write_remote_code(folder: Path) -> None:
    """``modeling_deltaflow.py``, ``deltaflow_source.py`` and ``auto_map`` in config.json."""
    import deltaflow

    data = _source_zip()
    text = base64.b64encode(data).decode()
    lines = "\n".join(f'    "{text[i : i + 96]}"' for i in range(0, len(text), 96))
    digest = hashlib.sha256(data).hexdigest()[:16]
    bundle = _BUNDLE_SOURCE.format(version=deltaflow.__version__, digest=digest, data=lines)
    (folder / f"{BUNDLE}.py").write_text(bundle)
    (folder / f"{MODELING}.py").write_text(_MODELING_SOURCE)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = AUTO_MAP
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
