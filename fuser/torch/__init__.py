"""fuser.torch: PyTorch modules and functions on fuser's kernels.

    import fuser.torch
    norm = fuser.torch.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)  # torch.nn.RMSNorm's
    replaced = fuser.torch.patch(model)   # a model's RMSNorm / LayerNorm / HF RMSNorms swapped
    with fuser.torch.recorded() as calls:  # each fusion call, to print or .explain()
        model(x)
    loss = fuser.torch.cross_entropy(logits, target)  # [N, C] logits, class indices

Forward and backward run as torch.library custom ops (torch.ops.fuser.*) with fake
implementations and autograd formulas, so torch.compile(fullgraph=True) and CUDA graphs take
them; outputs come from torch's allocator, on torch's current stream. `import fuser` does not
import torch; this package needs it.
"""

try:
    import torch  # noqa: F401 (only to fail early, with the way out)
except ImportError as exc:
    raise ImportError(
        "fuser.torch needs PyTorch, which is not installed: pip install torch, or install "
        "fuser with its torch extra (pip install 'fuser-kernels[torch]')"
    ) from exc

from fuser.torch._record import FusionCall, recorded
from fuser.torch.functional import (
    cross_entropy,
    dropout_add_layer_norm,
    dropout_add_rms_norm,
    gemma_rms_norm,
    hf_rms_norm,
    layer_norm,
    log_softmax,
    rms_norm,
    softmax,
)
from fuser.torch.modules import (
    CrossEntropyLoss,
    DropoutAddLayerNorm,
    DropoutAddRMSNorm,
    GemmaRMSNorm,
    HFRMSNorm,
    LayerNorm,
    LogSoftmax,
    RMSNorm,
    Softmax,
)
from fuser.torch.patch import Replacement, patch

__all__ = [
    "CrossEntropyLoss",
    "DropoutAddLayerNorm",
    "DropoutAddRMSNorm",
    "FusionCall",
    "GemmaRMSNorm",
    "HFRMSNorm",
    "LayerNorm",
    "LogSoftmax",
    "RMSNorm",
    "Replacement",
    "Softmax",
    "cross_entropy",
    "dropout_add_layer_norm",
    "dropout_add_rms_norm",
    "gemma_rms_norm",
    "hf_rms_norm",
    "layer_norm",
    "log_softmax",
    "patch",
    "recorded",
    "rms_norm",
    "softmax",
]
