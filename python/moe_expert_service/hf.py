"""The `moe_expert_service` experts backend of Hugging Face transformers (5.x ExpertsInterface).

    import moe_expert_service.hf as moe_hf
    model = moe_hf.from_pretrained("path/to/checkpoint", cache=0.25)      # starts a server on it
    model.generate(...)

or, in transformers' own words plus one call:

    moe_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_expert_service",
                                                 dtype=torch.bfloat16, device_map="cuda")
    moe_hf.attach(model, servers=["unix:///run/moe/expert.sock"], cache=0.25)

transformers 5 routes every MoE model class whose experts module carries
`@use_experts_implementation` through `ExpertsInterface`: the block computes
its router in torch and calls `experts(hidden [T,H], top_k_index [T,k],
top_k_weights [T,k])` (GPT-OSS's GptOssMLP too: `experts(hidden, router_indices,
routing_weights)`). register() adds our function under the name
`moe_expert_service`; it hands the call to a MoeLayer (GPU cache of hot experts
+ CPU expert servers over shared memory). from_pretrained() passes no unknown
keyword arguments to a model's __init__, so our options travel through
attach() (which from_pretrained() of this module calls for you).

A model built with experts_implementation="moe_expert_service" has no expert
weights: register() hooks PreTrainedModel.post_init so that such a model's
experts modules drop gate_up_proj / down_proj (and GPT-OSS's biases) before
loading, the checkpoint's expert tensors (MXFP4 blocks and scales too) become
unexpected keys and are never read; the expert server
reads the checkpoint itself and the session maps its host copy (one copy in
host memory, none on the GPU beyond the cache). A family whose experts math is
not ours is refused there, with one line naming the family and why.

Which families are ours is read from the installed transformers (families()):
an experts class written as one of EXPERT_MATHS, the expert maths the server
computes:
  silu: the decorator's defaults (gated, concatenated [gate; up], [E, out, in]
    weights, no bias), no _apply_gate of its own, the shared eager forward
    (sum_j w_j * down(act(gate x) * up x)), and at load SiLU as act_fn
    (Qwen-MoE, Mixtral, DeepSeek, OLMoE, GLM-4.5, ...);
  clamped_swiglu: GPT-OSS's experts (interleaved gate/up, x @ W weights,
    biases, its clamped SwiGLU _apply_gate and eager forward), alpha 1.702 at
    load. The model's GptOssMLP keeps its router (linear with bias, top-k, softmax
    over the k) and hands those indices and weights to the experts, so to us.
The server reads the math from the checkpoint (config.json's model_type, its
swiglu_limit); attach() refuses a checkpoint whose expert math
(Session.model_info["expert_math"]) is not the model's.

Thread-safety: register() and attach() once per process / model, from one
thread; the forward is as thread-safe as the Session under it.
"""
import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref

BACKEND = "moe_expert_service"

# The expert maths the service computes, each as transformers 5 writes it in an experts class:
# the @use_experts_implementation layout flags, the parameters, the gate (_apply_gate; None: the
# decorator's default act_fn(gate) * up over [gate; up]) and the eager forward. Gate and forward
# are compared as ASTs (formatting and comments do not count; a change of the math or of its
# names makes a family "its own gate / forward"). A family is ours when its experts class is one
# of these; which families those are is read from the installed transformers (families()).
_LAYOUT_DEFAULTS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
# (flag, the class's value) -> what the class has that the math it is compared with has not.
_LAYOUT_PHRASES = {("has_gate", False): "no gate projection (up, act, down)", ("has_gate", True): "a gate projection",
                   ("has_bias", True): "biases", ("has_bias", False): "no biases",
                   ("is_transposed", True): "transposed weights (x @ W)",
                   ("is_transposed", False): "untransposed weights (W x)",
                   ("is_concatenated", False): "interleaved gate/up",
                   ("is_concatenated", True): "concatenated [gate; up]"}

# SiLU-gated experts (Qwen-MoE, Mixtral, DeepSeek, OLMoE, GLM, ...): out[t] = sum_j w[t,j] *
# down_e(act(gate_e x_t) * up_e x_t), gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
_SILU_FORWARD = """
def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states
"""

# GPT-OSS's experts (transformers' GptOssExperts): gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]
# ([E, H, 2I], gate the even columns, up the odd), gate clamped above at `limit`, up to +-limit,
# (up + 1) * gate * sigmoid(alpha * gate), then @ down_proj[e] ([E, I, H]) + down_proj_bias[e].
# The server computes it for a gpt_oss checkpoint (core/expert_activation.h: ClampedSwiglu).
_CLAMPED_SWIGLU_GATE = """
def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    glu = gate * torch.sigmoid(gate * self.alpha)
    gated_output = (up + 1) * glu
    return gated_output
"""
_CLAMPED_SWIGLU_FORWARD = """
def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
    next_states = torch.zeros_like(hidden_states, dtype=hidden_states.dtype, device=hidden_states.device)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=self.num_experts)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate_up = current_state @ self.gate_up_proj[expert_idx] + self.gate_up_proj_bias[expert_idx]
        gated_output = self._apply_gate(gate_up)
        out = gated_output @ self.down_proj[expert_idx] + self.down_proj_bias[expert_idx]
        weighted_output = out * routing_weights[token_idx, top_k_pos, None]
        next_states.index_add_(0, token_idx, weighted_output.to(hidden_states.dtype))
    return next_states
"""
# The one alpha the server's clamped SwiGLU has (core/expert_activation.h kGptOssAlpha); its
# limit is config.json's swiglu_limit (default 7), compared with the model's at attach().
_CLAMPED_SWIGLU_ALPHA = 1.702


def _body_dump(fn_node):
    body = fn_node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # a docstring does not count
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _source_dump(src):
    return _body_dump(ast.parse(src).body[0])


def _silu_reason(experts):
    import torch
    act = getattr(experts, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")
            or act is torch.nn.functional.silu):
        return f"activation {getattr(act, '__name__', type(act).__name__)} (ours: SiLU)"
    return None


def _clamped_swiglu_reason(experts):
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, (int, float)) or abs(float(alpha) - _CLAMPED_SWIGLU_ALPHA) > 1e-6:
        return f"clamped SwiGLU alpha {alpha} (the server's: {_CLAMPED_SWIGLU_ALPHA})"
    if not isinstance(limit, (int, float)) or not 0 < float(limit) < float("inf"):
        return f"clamped SwiGLU limit {limit} (not a positive number)"
    return None


class ExpertMath:
    """One expert math the service computes, as transformers writes an experts class of it.
    name: what the server's model_info["expert_math"] starts with; weights: the experts
    module's parameters (the server's, dropped from the model); server_math(experts): the
    expert_math a server must report to serve `experts`."""

    def __init__(self, name, layout, weights, gate, forward, instance_reason, server_math):
        self.name = name
        self.layout = {**_LAYOUT_DEFAULTS, **layout}
        self.weights = tuple(weights)
        self._gate = None if gate is None else _source_dump(gate)
        self._forward = _source_dump(forward)
        self._instance_reason = instance_reason
        self.server_math = server_math

    def class_reasons(self, node):
        """What the experts class `node` (an ast.ClassDef) has that this math has not ([] : none)."""
        reasons = []
        flags = dict(_LAYOUT_DEFAULTS)
        for dec in node.decorator_list:
            if isinstance(dec, ast.Call):
                for kw in dec.keywords:
                    if kw.arg in flags:
                        try:
                            flags[kw.arg] = ast.literal_eval(kw.value)
                        except ValueError:
                            flags[kw.arg] = None
        for flag, value in flags.items():
            if value != self.layout[flag]:
                reasons.append(_LAYOUT_PHRASES.get((flag, value), f"{flag}={value}"))
        methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
        gate = methods.get("_apply_gate")
        if self._gate is None and gate is not None:
            reasons.append("its own gate (_apply_gate, e.g. a clamped SwiGLU)")
        elif self._gate is not None and gate is None:
            reasons.append("the default gate (act(gate) * up)")
        elif gate is not None and _body_dump(gate) != self._gate:
            reasons.append("its own gate (_apply_gate)")
        if "forward" not in methods or _body_dump(methods["forward"]) != self._forward:
            reasons.append("its own experts forward")
        init = methods.get("__init__")
        params = set()
        if init is not None:
            for n in ast.walk(init):
                if isinstance(n, ast.Assign) and "Parameter(" in ast.unparse(n.value):
                    params |= {t.attr for t in n.targets if isinstance(t, ast.Attribute)}
        if params != set(self.weights):
            reasons.append(f"parameters {sorted(params)}, not {list(self.weights)}")
        return list(dict.fromkeys(reasons))

    def instance_reason(self, experts):
        """Why the module `experts` of a class of this math is not ours after all, or None."""
        return self._instance_reason(experts)


EXPERT_MATHS = (
    ExpertMath("silu", {}, ("gate_up_proj", "down_proj"), None, _SILU_FORWARD, _silu_reason, lambda m: "silu"),
    ExpertMath("clamped_swiglu", {"is_concatenated": False, "is_transposed": True, "has_bias": True},
               ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), _CLAMPED_SWIGLU_GATE,
               _CLAMPED_SWIGLU_FORWARD, _clamped_swiglu_reason,
               lambda m: f"clamped_swiglu(alpha={float(m.alpha):g}, limit={float(m.limit):g})+bias"),
)


def _class_math(node):
    """(the ExpertMath of the experts class `node`, None) when it is one of ours, else
    (None, why not: what it has that the nearest math we serve has not)."""
    scored = [(m, m.class_reasons(node)) for m in EXPERT_MATHS]
    for m, reasons in scored:
        if not reasons:
            return m, None
    nearest, reasons = min(scored, key=lambda mr: len(mr[1]))
    return None, f"{', '.join(reasons)} (against the {nearest.name} experts we serve)"


def _is_decorated(node):
    return any("use_experts_implementation" in ast.unparse(d) for d in node.decorator_list)


def families():
    """{family (transformers' models/ directory name): None if we serve it, else why not},
    read from the installed transformers' sources: every modeling module that uses
    @use_experts_implementation, its experts classes matched against EXPERT_MATHS (SiLU-gated
    [gate; up]; GPT-OSS's clamped SwiGLU with biases). Serving also needs what only a built
    module shows (SiLU as act_fn; the clamped SwiGLU's alpha), checked at load."""
    import transformers
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out = {}
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family, f"modeling_{family}.py")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if "@use_experts_implementation" not in src:
            continue
        reasons = [f"{n.name}: {r}" for n in ast.parse(src).body
                   if isinstance(n, ast.ClassDef) and _is_decorated(n) and (r := _class_math(n)[1]) is not None]
        out[family] = "; ".join(reasons) or None
    return out


_class_maths = {}  # experts class -> (ExpertMath or None, reason or None), its source read once


def _math_of_class(cls):
    if cls not in _class_maths:
        try:
            src = inspect.getsource(sys.modules[cls.__module__])
            node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
            _class_maths[cls] = _class_math(node)
        except (OSError, TypeError, KeyError, StopIteration) as e:
            _class_maths[cls] = (None, f"its source cannot be read ({type(e).__name__})")
    return _class_maths[cls]


def expert_math(experts):
    """The ExpertMath of the experts module `experts`, or None when it is not ours."""
    math, _ = _math_of_class(type(experts))
    return math if math is not None and math.instance_reason(experts) is None else None


def unservable_reason(experts):
    """Why the experts module `experts` cannot be served by us, or None."""
    math, reason = _math_of_class(type(experts))
    return reason if math is None else math.instance_reason(experts)


def experts_dims(experts):
    """(experts, hidden, intermediate) of an experts module (families name the last two
    hidden_dim / intermediate_dim or, as GPT-OSS, hidden_size / intermediate_size)."""
    hidden = getattr(experts, "hidden_dim", None) or getattr(experts, "hidden_size")
    intermediate = getattr(experts, "intermediate_dim", None) or getattr(experts, "intermediate_size")
    return int(experts.num_experts), int(hidden), int(intermediate)


_MATH_NUMBER = re.compile(r"(?<==)(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


def _canonical_math(text):
    """An expert_math text with its numbers written one way ("limit=7.0" == "limit=7")."""
    return _MATH_NUMBER.sub(lambda m: f"{float(m.group(1)):g}", text.replace(" ", ""))


def _is_experts(module):
    return all(hasattr(module, a) for a in _LAYOUT_DEFAULTS) and hasattr(type(module).forward, "__wrapped__") \
        and hasattr(module, "config")


def _family(module):
    return getattr(module.config, "model_type", None) or type(module).__name__


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def experts_modules(model):
    """[(name, layer index, experts module)] of `model`, in order."""
    out = []
    for name, m in model.named_modules():
        if _is_experts(m):
            found = _LAYER.findall(name + ".")
            out.append((name, int(found[-1]) if found else None, m))
    return out


def _drop_expert_weights(model):
    """PreTrainedModel.post_init, after transformers' own: a model built for this backend
    gives its experts' weights up (they are never loaded) or is refused."""
    mods = [(n, i, m) for n, i, m in experts_modules(model) if m.config._experts_implementation == BACKEND]
    for name, layer, m in mods:
        if m.__dict__.get("_moe_dropped"):
            continue
        reason = unservable_reason(m)
        if reason is not None:
            raise ValueError(f"{BACKEND}: cannot serve the experts of {_family(m)} ({type(m).__name__}): {reason}")
        if layer is None:
            raise ValueError(f"{BACKEND}: {_family(m)}: experts module {name!r} is not under a 'layers.N' list")
        for w in expert_math(m).weights:
            m.register_parameter(w, None)
        m._is_hf_initialized = True  # nothing left for transformers' weight initialisation
        m.__dict__["_moe_dropped"] = True
    if mods:
        ignore = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
        ignore = set(ignore or ())
        # the checkpoint's expert tensors: per expert, or fused with their biases / MXFP4 blocks and scales
        ignore.add(r"\.experts\.(\d+\.|gate_up_proj|down_proj)")
        model._keys_to_ignore_on_load_unexpected = ignore


def _experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *, router_indices=None,
                     routing_weights=None):
    """The experts of every family we serve: (hidden [T,H], top-k ids [T,k], top-k weights [T,k])
    as the block's router made them (GPT-OSS names them router_indices / routing_weights)."""
    top_k_index = router_indices if top_k_index is None else top_k_index
    top_k_weights = routing_weights if top_k_weights is None else top_k_weights
    layer = self.__dict__.get("_moe_layer")
    if layer is None:
        raise RuntimeError(f"{BACKEND}: the experts of {_family(self)} have no session: call "
                           "moe_expert_service.hf.attach(model, ...) after from_pretrained, or load with "
                           "moe_expert_service.hf.from_pretrained")
    return layer(hidden_states, top_k_index, top_k_weights)


_registered = False
_register_lock = threading.Lock()


def register():
    """Adds the `moe_expert_service` backend to transformers' ExpertsInterface (and the
    post_init hook that keeps expert weights out of models built for it). Idempotent."""
    global _registered
    with _register_lock:
        if _registered:
            return
        try:
            from transformers.integrations.moe import ExpertsInterface
            from transformers.modeling_utils import PreTrainedModel
        except ImportError as e:
            raise ImportError(f"{BACKEND}: transformers with ExpertsInterface (5.x) is needed: {e}") from e
        if hasattr(ExpertsInterface, "register"):
            ExpertsInterface.register(BACKEND, _experts_forward)
        else:
            ExpertsInterface._global_mapping[BACKEND] = _experts_forward
        original = PreTrainedModel.post_init

        def post_init(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _drop_expert_weights(self)
            return result

        post_init.__wrapped__ = original
        PreTrainedModel.post_init = post_init
        _registered = True


def _server_binary(server_bin):
    if server_bin:
        return server_bin
    if os.environ.get("MOE_SERVER"):
        return os.environ["MOE_SERVER"]
    found = shutil.which("moe-expert-server")
    if found:
        return found
    from . import _lib
    lib = getattr(_lib.lib(), "_name", "")
    beside = os.path.join(os.path.dirname(os.path.abspath(lib)), "moe-expert-server") if lib else ""
    if beside and os.path.exists(beside):
        return beside
    raise FileNotFoundError(f"{BACKEND}: moe-expert-server not found: pass server_bin=, set MOE_SERVER or put it on "
                            "PATH (or pass servers=[...] of running servers)")


class ExpertServer:
    """moe-expert-server started on a checkpoint, serving this host over shared memory
    (`socket`, a unix socket) and loopback gRPC; its log goes to `log` (a file). close()
    stops it."""

    def __init__(self, checkpoint, server_bin=None, threads=0, weight_dtype="auto", family=None):
        self.dir = tempfile.mkdtemp(prefix="moe_hf_")
        self.socket = os.path.join(self.dir, "expert.sock")
        self.log = os.path.join(self.dir, "server.log")
        args = [_server_binary(server_bin), "--insecure", f"--model={checkpoint}", "--listen=127.0.0.1:0",
                f"--shm-socket={self.socket}"]
        if threads:
            args.append(f"--threads={int(threads)}")
        if weight_dtype and weight_dtype != "auto":
            args.append(f"--weight-dtype={weight_dtype}")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = False
        for line in self.proc.stdout:
            if "ready on " in line:
                ready = True
                break
        if not ready:
            with open(self.log, errors="replace") as f:
                lines = [x.strip() for x in f if x.strip()]
            why = next((x for x in reversed(lines) if " E " in x or "rror" in x), lines[-1] if lines else "no log")
            self.close()
            raise RuntimeError(f"{BACKEND}: {family or 'model'}: moe-expert-server cannot serve {checkpoint}: {why}")
        threading.Thread(target=self._drain, daemon=True).start()  # its later output must not block it

    def __deepcopy__(self, memo):
        return self

    def _drain(self):
        try:
            for _ in self.proc.stdout:
                pass
        except (ValueError, OSError, AttributeError):  # closed by close()
            pass

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class Offload:
    """What attach() put on a model (model.moe_expert_service): the session, the server it
    started (if any) and the layers. close() ends both."""

    def __init__(self, session, server, layers):
        self.session, self.server, self.layers = session, server, layers

    def __deepcopy__(self, memo):  # a copied model shares the session and the server
        return self

    def take_stream_error(self):
        """Raises the first replay-time error of CUDA-graph steps (call between replays)."""
        self.session.take_stream_error()

    def close(self):
        if self.session is not None:
            self.session.close()
            self.session = None
        if self.server is not None:
            self.server.close()
            self.server = None


def _close_quietly(offload):
    try:
        offload.close()
    except Exception:  # at interpreter exit: nothing left to report to
        pass


# The names families give the number of experts a token is routed to (Hunyuan's moe_topk may be
# a list, one per layer). "top_k" is left out: older configs carry it as a sampling default.
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "experts_per_token")


def _top_k(config, model=None):
    """The most experts any layer of `config` routes a token to (8 when no key names it), and
    at least the `top_k` any module of `model` (its routers, MoE blocks) holds: a family's config
    may name it under more than one key (Hunyuan's moe_topk, num_experts_per_tok an alias of it),
    or its router may hold its own. An upper bound: the session sizes its buffers by it."""
    ks = []
    if model is not None:
        for m in model.modules():
            v = getattr(m, "top_k", None)
            if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 4096:
                ks.append(v)
    for key in _TOP_K_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and not isinstance(v, bool):
            ks.append(v)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
            ks.append(max(v))
    return max(ks) if ks else 8


def attach(model, servers=None, cache=0.25, cache_experts_per_layer=None, cache_gib=None, policy="predictive",
           weight_dtype="auto", capturable=False, max_tokens=1024, checkpoint=None, server_bin=None, server_threads=0,
           device=None, **session_options):
    """Serves `model`'s experts through moe-expert-service; returns the Offload (also
    model.moe_expert_service). servers: addresses of running expert servers on the
    checkpoint ("unix:///...sock", "host:port"), or None to start one on `checkpoint`
    (default: the directory the model was loaded from). cache: fraction of each layer's
    experts cached on the GPU (or cache_experts_per_layer / cache_gib). policy, weight_dtype,
    max_tokens and other keyword arguments: Session options. capturable: the decode step
    may be captured in a CUDA graph (warm up once eagerly first). A model loaded with
    another experts backend gives its expert weights up here."""
    import torch
    from .session import Session
    from .torch_layer import MoeLayer
    register()
    mods = experts_modules(model)
    if not mods:
        raise ValueError(f"{BACKEND}: {type(model).__name__} has no experts module of transformers' ExpertsInterface")
    for name, layer, m in mods:
        reason = unservable_reason(m)
        if reason is not None:
            raise ValueError(f"{BACKEND}: cannot serve the experts of {_family(m)} ({type(m).__name__}): {reason}")
        if layer is None:
            raise ValueError(f"{BACKEND}: {_family(m)}: experts module {name!r} is not under a 'layers.N' list")
    layers = [layer for _, layer, _ in mods]
    if len(set(layers)) != len(layers):
        raise ValueError(f"{BACKEND}: {_family(mods[0][2])}: experts in more than one layer stack (layers {layers}); "
                         "one stack per model is served")
    checkpoint = checkpoint or getattr(model.config, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(f"checkpoint: {checkpoint!r} is not a local checkpoint directory (pass checkpoint=)")
    first = mods[0][2]
    E = experts_dims(first)[0]
    k = _top_k(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config, model)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    options = dict(model=checkpoint, device=device, policy=policy, weight_dtype=weight_dtype,
                   max_tokens=int(max_tokens), max_top_k=min(max(k, 1), E), **session_options)
    if cache_experts_per_layer is not None:
        options["cache_experts_per_layer"] = int(cache_experts_per_layer)
    elif cache_gib is not None:
        options["cache_gib"] = float(cache_gib)
    else:
        if not 0.0 <= float(cache) <= 1.0:
            raise ValueError(f"cache: {cache} is outside [0, 1] (a fraction of each layer's experts)")
        options["cache_experts_per_layer"] = int(round(float(cache) * E))
    server = None
    if servers is None:
        server = ExpertServer(checkpoint, server_bin=server_bin, threads=server_threads, weight_dtype=weight_dtype,
                              family=_family(first))
        servers = [f"unix://{server.socket}"]
    options["servers"] = list(servers)
    try:
        session = Session(**options)
        info = session.model_info
        want = experts_dims(first)
        got = (info["num_experts"], info["hidden"], info["intermediate"])
        if got != want:
            raise ValueError(f"{BACKEND}: checkpoint {checkpoint}: experts, hidden, intermediate {got}, the model's "
                             f"are {want}")
        # The session's expert math (read from the checkpoint, the servers' checked equal to it)
        # must be what the model's experts compute: a SiLU model on a GPT-OSS checkpoint, or
        # GPT-OSS experts of another swiglu_limit than config.json's, are refused here.
        wanted = sorted({expert_math(m).server_math(m) for _, _, m in mods})
        if [_canonical_math(w) for w in wanted] != [_canonical_math(info["expert_math"])]:
            raise ValueError(f"{BACKEND}: checkpoint {checkpoint}: its experts compute {info['expert_math']}, the "
                             f"model's {_family(first)} experts compute {' and '.join(wanted)}")
        missing = sorted(set(layers) - set(session.served_layers))
        if missing:
            raise ValueError(f"{BACKEND}: checkpoint {checkpoint}: MoE layers {session.served_layers}, the model has "
                             f"experts in layers {missing} too")
    except BaseException:
        if server is not None:
            server.close()
        raise
    if policy == "static":  # a static cache serves what it is given: the first slots
        for layer in layers:
            session.apply_assignment(layer, list(range(session.slots_per_layer())))
        session.flush_copies()
    for _, layer, m in mods:
        m.__dict__["_moe_layer"] = MoeLayer(session, layer, capturable=capturable)
        for w in expert_math(m).weights:
            if isinstance(getattr(m, w, None), torch.nn.Parameter):
                m.register_parameter(w, None)  # a model loaded another way: its copy goes
        m.__dict__["_moe_dropped"] = True
    if model.config._experts_implementation != BACKEND:
        model.set_experts_implementation(BACKEND)
    offload = Offload(session, server, layers)
    old = model.__dict__.get("moe_expert_service")
    if isinstance(old, Offload):
        old.close()
    model.__dict__["moe_expert_service"] = offload
    weakref.finalize(model, _close_quietly, offload)
    return offload


# Tensor-name endings of quantized weights (compressed-tensors, fp8 block scales, MXFP4, GPTQ/AWQ).
_QUANTIZED_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_scale_inv",
                    "_blocks", "_scales", "qweight", "qzeros", "scales")


def _checkpoint_tensor_names(path):
    """Every tensor name of a safetensors checkpoint directory (read from the files' headers)."""
    import json
    import struct
    names = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                names += [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
    return names


def _config_without_expert_quantization(path, trust_remote_code=False):
    """The checkpoint's config without its quantization_config when only expert tensors are
    quantized (Kimi-K2's int4, an MXFP4 GPT-OSS, a checkpoint written by moe-make-model): the
    experts are the server's, so transformers has nothing to dequantize and must not need the
    quantization's package. None when there is nothing to strip (no quantization, or tensors
    outside the experts are quantized too: transformers' own quantizer handles those)."""
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(str(path), "config.json")):
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is None:
        return None
    quantized = [n for n in _checkpoint_tensor_names(path) if n.endswith(_QUANTIZED_PARTS)]
    if not quantized or any(".experts." not in n for n in quantized):
        return None
    delattr(config, "quantization_config")
    return config


def from_pretrained(path, model_class=None, servers=None, cache=0.25, policy="predictive", weight_dtype="auto",
                    capturable=False, max_tokens=1024, server_bin=None, server_threads=0, session_options=None,
                    **hf_kwargs):
    """model_class (default AutoModelForCausalLM).from_pretrained(path, experts_implementation=
    "moe_expert_service", **hf_kwargs) (device_map defaults to "cuda" when there is a GPU),
    then attach() with our options (servers=None: start a server on `path`). A checkpoint
    whose only quantized tensors are experts (e.g. Kimi-K2's int4) loads without transformers'
    quantizer: the server reads the experts in their own format."""
    import torch
    register()
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    hf_kwargs.setdefault("device_map", "cuda" if torch.cuda.is_available() else "cpu")
    hf_kwargs["experts_implementation"] = BACKEND
    if "config" not in hf_kwargs:
        config = _config_without_expert_quantization(path, hf_kwargs.get("trust_remote_code", False))
        if config is not None:
            hf_kwargs["config"] = config
    model = model_class.from_pretrained(path, **hf_kwargs)
    attach(model, servers=servers, cache=cache, policy=policy, weight_dtype=weight_dtype, capturable=capturable,
           max_tokens=max_tokens, checkpoint=path, server_bin=server_bin, server_threads=server_threads,
           **(session_options or {}))
    return model


def teacher_forced_logits(model, seq, prompt_len):
    """f32 logits ([vocab] each) of every generated step of `seq` ([1, n]): the prompt's
    prefill, then one token per step taken from `seq` with the KV cache — to compare an
    offloaded model's outputs with a reference on the same tokens."""
    out = model(input_ids=seq[:, :prompt_len], use_cache=True)
    cache, logits = out.past_key_values, [out.logits[0, -1].float()]
    for p in range(prompt_len, seq.shape[1] - 1):
        out = model(input_ids=seq[:, p:p + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return logits
