"""moe-expert-service from Python: ctypes over libmoe.so (include/moe/moe.h).

Session (numpy arrays or torch tensors), MoeLayer + select_experts (torch;
imported only when torch is installed), MoeError; moe_expert_service.hf: the
transformers experts backend. See python/README.md.
"""
from .session import (InvalidArgumentError, MoeError, Pending, Session, from_bf16_bits, new_group_id,
                      reference_forward, to_bf16_bits)

__version__ = "0.1.0"
__all__ = ["Session", "Pending", "MoeError", "InvalidArgumentError", "reference_forward", "new_group_id", "to_bf16_bits",
           "from_bf16_bits", "MoeLayer", "select_experts"]


def __getattr__(name):
    # torch is optional: MoeLayer / select_experts import it on first use.
    if name in ("MoeLayer", "select_experts"):
        from . import torch_layer
        return getattr(torch_layer, name)
    raise AttributeError(f"module 'moe_expert_service' has no attribute {name!r}")
