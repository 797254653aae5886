"""deltaflow.models: DeltaFlowConfig and DeltaFlowForCausalLM (transformers PreTrainedModels).

Importing this package registers ``model_type="deltaflow"`` with AutoConfig, AutoModel and
AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(path)`` works afterwards.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from deltaflow.layers.cache import DeltaFlowCache
from deltaflow.models.config import MIXER_TYPES, DeltaFlowConfig
from deltaflow.models.modeling import (
    DeltaFlowBlock,
    DeltaFlowForCausalLM,
    DeltaFlowModel,
    DeltaFlowPreTrainedModel,
    SwiGLU,
)


def _register() -> None:
    # exist_ok keeps re-imports (e.g. importlib.reload in notebooks) from failing.
    AutoConfig.register("deltaflow", DeltaFlowConfig, exist_ok=True)
    AutoModel.register(DeltaFlowConfig, DeltaFlowModel, exist_ok=True)
    AutoModelForCausalLM.register(DeltaFlowConfig, DeltaFlowForCausalLM, exist_ok=True)


_register()

__all__ = [
    "DeltaFlowConfig",
    "DeltaFlowModel",
    "DeltaFlowForCausalLM",
    "DeltaFlowPreTrainedModel",
    "DeltaFlowBlock",
    "DeltaFlowCache",
    "SwiGLU",
    "MIXER_TYPES",
]
