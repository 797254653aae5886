import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU, run the Triton kernels on the CPU interpreter. It must be set before any
# kernel is decorated, i.e. before deltaflow.ops.triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
