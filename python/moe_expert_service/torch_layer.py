"""MoeLayer: a torch.nn.Module that computes one MoE layer through a Session.

    layer = MoeLayer(session, layer_index)
    ids, w = select_experts(router_logits, top_k=8, renormalize=True)
    y = layer(hidden_states, ids, w)           # [..., H] in, [..., H] out, same dtype/device

forward(hidden_states, topk_ids, topk_weights) takes what fused-MoE layers of
engines take after their router (vLLM's FusedMoE / SGLang's: hidden [T,H],
topk_ids [T,k], topk_weights [T,k]); leading dimensions are flattened, other
dtypes are converted to bf16 and back, int64 ids / half weights converted,
calls larger than the session's max_tokens are split. CUDA tensors run on the
current torch CUDA stream (cuda backend); with capturable=True they go through
Session.forward_layer_capturable, so a decode step can be captured in a CUDA graph
(torch.cuda.graph) after one eager warm-up step. On a cpu-backend session, CUDA
inputs are copied to the host and the result back (for machines without the
cuda backend; slow). Under torch.compile the call is one opaque custom op,
moe_expert_service::moe_layer (a fake implementation gives its output's shape),
so the compiler traces the model around it without a graph break, and
mode="reduce-overhead" captures it with the rest of the step (capturable=True).

Thread-safety: like the Session under it.
"""
import threading
import weakref

import torch

from .session import Session

# The sessions the custom op reaches, by id(session): a torch op takes tensors
# and plain values, not a Session (MoeLayer registers its session here; held
# weakly: a closed and dropped session leaves).
_SESSIONS = weakref.WeakValueDictionary()
_SESSIONS_LOCK = threading.Lock()


def _moe_layer_call(hidden, topk_ids, topk_weights, session, layer, capturable):
    """One layer call of a registered session: what MoeLayer.forward runs under torch.compile
    (bf16 [T, H] hidden, int32 ids and float32 weights [T, k], on the session's device)."""
    s = _SESSIONS.get(session)
    if s is None:
        raise RuntimeError("moe_expert_service::moe_layer: the session of this compiled call was closed")
    if capturable:
        return s.forward_layer_capturable(layer, hidden, topk_ids, topk_weights)
    return s.forward_layer(layer, hidden, topk_ids, topk_weights)


# The call as one custom op for the compiler (torch >= 2.4; with an older torch, torch.compile
# breaks the graph at the call instead).
_moe_layer_op = None
if hasattr(torch.library, "custom_op"):
    @torch.library.custom_op("moe_expert_service::moe_layer", mutates_args=())
    def _moe_layer_op(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, session: int,
                      layer: int, capturable: bool) -> torch.Tensor:
        return _moe_layer_call(hidden, topk_ids, topk_weights, session, layer, capturable)

    @_moe_layer_op.register_fake
    def _(hidden, topk_ids, topk_weights, session, layer, capturable):
        return torch.empty_like(hidden)


def select_experts(router_logits, top_k, renormalize=True, scoring="softmax", bias=None, scaling=1.0):
    """Router logits [T,E] -> (topk_ids int32 [T,k], topk_weights float32 [T,k]).

    scoring "softmax" (Qwen-MoE, Mixtral, OLMoE): softmax over all experts in
    float32, top-k, optionally renormalised to sum 1 (Qwen3's norm_topk_prob;
    Mixtral is softmax-top-k-renormalise; the C++ RoutingMode softmax_topk).
    scoring "topk_softmax" (GPT-OSS; the C++ RoutingMode of that name): the k
    largest logits, softmax over those k (already summing to 1). scoring
    "sigmoid" (DeepSeek-V3): sigmoid scores, top-k chosen on scores + bias
    (e_score_correction_bias), weights are the unbiased scores, renormalised,
    times `scaling`. Session.model_info["routing"] names the model's mode."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError("router_logits: expected a 2-D tensor [T, num_experts]")
    if not 1 <= int(top_k) <= router_logits.shape[1]:
        raise ValueError(f"top_k: {top_k} is outside [1, {router_logits.shape[1]}]")
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(scores, int(top_k), dim=-1)
    elif scoring == "topk_softmax":
        top, ids = torch.topk(logits, int(top_k), dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
        choice = scores if bias is None else scores + bias.float()
        _, ids = torch.topk(choice, int(top_k), dim=-1)
        weights = scores.gather(1, ids)
    else:
        raise ValueError(f"scoring: {scoring!r} is not 'softmax', 'topk_softmax' or 'sigmoid'")
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return ids.to(torch.int32).contiguous(), weights.to(torch.float32).contiguous()


class MoeLayer(torch.nn.Module):
    """One MoE layer (the routed experts) of `session`'s model, as a module."""

    def __init__(self, session, layer, capturable=False):
        super().__init__()
        if not isinstance(session, Session):
            raise TypeError(f"session: expected a moe_expert_service.Session, got {type(session).__name__}")
        if layer not in session.served_layers:
            raise ValueError(f"layer: {layer} is not an MoE layer served by the session ({session.served_layers})")
        self.session = session
        with _SESSIONS_LOCK:
            _SESSIONS[id(session)] = session
        self._op_session = id(session)  # the custom op's handle of it (a plain int the compiler sees)
        self.layer = int(layer)
        self.hidden_size = session.model_info["hidden"]
        self.max_tokens = session.options["max_tokens"]
        self.record_stats = False  # True: last_stats holds the counters of the last (eager) call
        self.last_stats = {}
        # capturable: CUDA inputs go through Session.forward_layer_capturable (the
        # decode step can then be captured in a CUDA graph; T <= max_tokens).
        self.capturable = bool(capturable)

    def forward(self, hidden_states, topk_ids, topk_weights):
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states: expected a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: last dimension {hidden_states.shape[-1]}, the model's hidden size is "
                             f"{self.hidden_size}")
        shape, dtype, device = hidden_states.shape, hidden_states.dtype, hidden_states.device
        x = hidden_states.reshape(-1, self.hidden_size)
        if x.dtype is not torch.bfloat16:
            x = x.to(torch.bfloat16)
        if not x.is_contiguous():
            x = x.contiguous()
        T = x.shape[0]
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
            raise ValueError(f"topk_ids: expected a [{T}, k] tensor")
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)}")
        ids, w = topk_ids, topk_weights
        dev = x.get_device()
        if ids.dtype is not torch.int32 or ids.get_device() != dev or not ids.is_contiguous():
            ids = ids.to(device=device, dtype=torch.int32).contiguous()
        if w.dtype is not torch.float32 or w.get_device() != dev or not w.is_contiguous():
            w = w.to(device=device, dtype=torch.float32).contiguous()
        host_only = device.type == "cuda" and self.session.device != "cuda"
        if _moe_layer_op is not None and torch.compiler.is_compiling() and not host_only and T <= self.max_tokens:
            # One opaque op for the compiler; the same call as below when it runs.
            out = _moe_layer_op(x, ids, w, self._op_session, self.layer,
                                self.capturable and device.type == "cuda")
        elif self.capturable and device.type == "cuda" and not host_only:
            if T > self.max_tokens:
                raise ValueError(f"hidden_states: {T} tokens, a capturable call takes at most {self.max_tokens}")
            out = self.session.forward_layer_capturable(self.layer, x, ids, w)
        else:
            if host_only:
                x, ids, w = x.cpu(), ids.cpu(), w.cpu()
            stats = {} if self.record_stats else None
            if T <= self.max_tokens:
                out = self.session.forward_layer(self.layer, x, ids, w, stats=stats)
            else:
                out = torch.empty_like(x)
                for start in range(0, T, self.max_tokens):
                    end = min(T, start + self.max_tokens)
                    self.session.forward_layer(self.layer, x[start:end], ids[start:end], w[start:end], out=out[start:end],
                                         stats=stats)
            if stats is not None:
                self.last_stats = stats
            if host_only:
                out = out.to(device)
        if out.dtype is not dtype:
            out = out.to(dtype)
        return out.reshape(shape)

    def extra_repr(self):
        return f"layer={self.layer}, hidden_size={self.hidden_size}, device={self.session.device}"
