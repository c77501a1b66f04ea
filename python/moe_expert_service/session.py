"""Session: one MoE layer per call over libmoe.so, from numpy arrays or torch tensors.

    from moe_expert_service import Session
    s = Session(model="synthetic:tiny", servers=["unix:///run/moe/expert.sock"], device="cpu",
                cache_experts_per_layer=2)
    out = s.forward_layer(layer, hidden, topk_ids, topk_weights)

The names are those of the C++ MoeSession (include/moe/engine.h) in snake case
and of the C ABI's moe_* functions (scripts/check_api_names.py keeps them so).

Arguments (T tokens, top-k routing, H = s.model_info["hidden"]):
  hidden        [T,H]  torch.bfloat16 tensor, or numpy float32 (converted to bf16) / uint16 (raw bf16 bits)
  topk_ids      [T,k]  int32 (-1 = unused slot)
  topk_weights  [T,k]  float32 (applied as given)
  out           [T,H]  optional, like hidden (allocated when None)
All dense row-major (contiguous), all on one device. torch CUDA tensors use
device pointers and the current torch CUDA stream (stream-ordered: no host
sync of that stream); CPU tensors and numpy arrays use host memory. Wrong
types, shapes, layouts or devices raise TypeError/ValueError naming the
argument; errors from the library raise MoeError (InvalidArgumentError for
bad values, e.g. an expert id out of range).

Thread-safety: a Session may be used from several threads (the library
serialises calls on one session).
"""
import json

from . import _lib


class MoeError(RuntimeError):
    """A call into libmoe.so failed: .code (moe_status value), .status (its name)."""

    def __init__(self, code, status, message):
        super().__init__(message)
        self.code = code
        self.status = status


class InvalidArgumentError(MoeError, ValueError):
    """MOE_INVALID_ARGUMENT: the message names the argument."""


def _check(code):
    if code == 0:
        return
    lib = _lib.lib()
    status = lib.moe_status_name(code).decode()
    message = lib.moe_last_error().decode(errors="replace")
    cls = InvalidArgumentError if code == 3 else MoeError
    raise cls(code, status, message)


# ---- numpy helpers ---------------------------------------------------------

def to_bf16_bits(x):
    """numpy float32 array -> uint16 array of bf16 bits (round to nearest even)."""
    import numpy as np
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    """uint16 array of bf16 bits -> numpy float32 array."""
    import numpy as np
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_raw_stream_fn = None  # looked up once: this runs on every CUDA call


def _current_raw_stream(torch, device_index):
    """The cudaStream_t (an int) of torch's current stream on that device."""
    global _raw_stream_fn
    if _raw_stream_fn is None:
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own Triton glue calls
        _raw_stream_fn = raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)
    return _raw_stream_fn(device_index)


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


def _is_numpy(x):
    return type(x).__module__.split(".")[0] == "numpy" and hasattr(x, "ctypes")


class _Call:
    """The checked arguments of one call: pointers, memory kind, stream, and
    the objects whose memory they point into (kept alive until the call ends)."""

    def __init__(self, session, hidden, topk_ids, topk_weights, out):
        H = session.model_info["hidden"]
        if _is_torch(hidden):
            self._torch(H, hidden, topk_ids, topk_weights, out)
        elif _is_numpy(hidden):
            self._numpy(H, hidden, topk_ids, topk_weights, out)
        else:
            raise TypeError(f"hidden: expected a torch tensor or a numpy array, got {type(hidden).__name__}")

    @staticmethod
    def _shape2(name, x, rows, cols):
        if len(x.shape) != 2:
            raise ValueError(f"{name}: expected 2 dimensions, got shape {tuple(x.shape)}")
        if (rows is not None and x.shape[0] != rows) or (cols is not None and x.shape[1] != cols):
            want = f"[{rows if rows is not None else '*'}, {cols if cols is not None else '*'}]"
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")

    def _shapes(self, H, hidden, ids, weights):
        """Checks hidden [T,H], topk_ids [T,k], topk_weights [T,k]; returns (T, k)."""
        self._shape2("hidden", hidden, None, H)
        T = hidden.shape[0]
        self._shape2("topk_ids", ids, T, None)
        k = ids.shape[1]
        self._shape2("topk_weights", weights, T, k)
        return T, k

    def _torch(self, H, hidden, ids, weights, out):
        # The hot path of every torch call: identity dtype checks, integer
        # device indices, and the raw current stream (torch.cuda.current_stream
        # builds a Stream object per call: most of the Python overhead on CUDA).
        import torch
        for name, x in (("topk_ids", ids), ("topk_weights", weights)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor like hidden, got {type(x).__name__}")
        if out is None:
            out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        elif not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor like hidden, got {type(out).__name__}")
        dev = hidden.get_device()  # -1 on the CPU
        for name, x, want in (("hidden", hidden, torch.bfloat16), ("topk_ids", ids, torch.int32),
                              ("topk_weights", weights, torch.float32), ("out", out, torch.bfloat16)):
            if x.dtype is not want:
                raise TypeError(f"{name}: expected dtype {want}, got {x.dtype}")
            if x.get_device() != dev or x.is_cuda != hidden.is_cuda:
                raise ValueError(f"{name}: on {x.device}, hidden is on {hidden.device}")
        T, k = self._shapes(H, hidden, ids, weights)
        self._shape2("out", out, T, H)
        for name, x in (("hidden", hidden), ("topk_ids", ids), ("topk_weights", weights), ("out", out)):
            if not x.is_contiguous():
                raise ValueError(f"{name}: must be contiguous (call .contiguous())")
        if hidden.is_cuda:
            self.memory = _lib.MEMORY_DEVICE
            self.stream = _current_raw_stream(torch, dev)
        elif hidden.is_cpu:
            self.memory = _lib.MEMORY_HOST
            self.stream = None
        else:
            raise ValueError(f"hidden: device {hidden.device} is neither cpu nor cuda")
        self.T, self.k = T, k
        self.ptrs = [hidden.data_ptr(), ids.data_ptr(), weights.data_ptr(), out.data_ptr()]
        self.keep = (hidden, ids, weights, out)
        self.result = out
        self.convert = None

    def _numpy(self, H, hidden, ids, weights, out):
        import numpy as np
        named = {"hidden": hidden, "topk_ids": ids, "topk_weights": weights}
        for name, x in named.items():
            if not isinstance(x, np.ndarray):
                raise TypeError(f"{name}: expected a numpy array like hidden, got {type(x).__name__}")
        if hidden.dtype == np.float32:
            bits = to_bf16_bits(hidden) if hidden.flags.c_contiguous else None
            self.convert = from_bf16_bits
        elif hidden.dtype == np.uint16:
            bits = hidden
            self.convert = None
        else:
            raise TypeError(f"hidden: expected dtype float32 or uint16 (bf16 bits), got {hidden.dtype}")
        if ids.dtype != np.int32:
            raise TypeError(f"topk_ids: expected dtype int32, got {ids.dtype}")
        if weights.dtype != np.float32:
            raise TypeError(f"topk_weights: expected dtype float32, got {weights.dtype}")
        T, k = self._shapes(H, hidden, ids, weights)
        for name, x in named.items():
            if not x.flags.c_contiguous:
                raise ValueError(f"{name}: must be C-contiguous (np.ascontiguousarray)")
        if out is None:
            out_bits = np.empty((T, H), dtype=np.uint16)
        else:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out: expected a numpy array, got {type(out).__name__}")
            if out.dtype != np.uint16:
                raise TypeError(f"out: expected dtype uint16 (bf16 bits), got {out.dtype}")
            self._shape2("out", out, T, H)
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out: must be C-contiguous and writeable")
            out_bits = out
        self.memory = _lib.MEMORY_HOST
        self.stream = None
        self.T, self.k = T, k
        self.ptrs = [x.ctypes.data for x in (bits, ids, weights, out_bits)]
        self.keep = (bits, ids, weights, out_bits)
        self.result = out_bits

    def output(self):
        return self.convert(self.result) if self.convert is not None else self.result


class Pending:
    """A started call (Session.forward_layer_async); pass it to Session.wait once."""

    def __init__(self, ticket, call):
        self.ticket = ticket
        self._call = call


def _stats_dict(s):
    return {name: getattr(s, name) for name, _ in s._fields_}


def _model_info_dict(info):
    """moe_model_info as the dict Session.model_info: its fields, strings decoded, moe_layers a
    list (which carries its length: no num_moe_layers)."""
    d = {name: getattr(info, name) for name, _ in info._fields_ if name != "num_moe_layers"}
    d.update(model_type=info.model_type.decode(), weight_dtype=info.weight_dtype.decode(),
             expert_math=info.expert_math.decode(), routing=info.routing.decode(),
             moe_layers=list(info.moe_layers[: info.num_moe_layers]) if info.num_moe_layers > 0 else [])
    return d


class Session:
    """An open libmoe session; keyword arguments are the options of moe_session_open
    (include/moe/moe.h has their ranges and defaults): model, servers, device, cuda_device,
    cache_experts_per_layer or cache_gib, policy ("predictive", the default, "static",
    "lru", "lfru"), copy_mode, max_tokens, max_top_k, contexts, layers, host_copy,
    weight_dtype, share_host_copy, fill_cache, deadline_ms, server_deadline_ms, cpu_threads, grpc_streams, tls, and
    group, a dict {"rank", "size", "mode", "id"}: mode "tensor" (the default; tensor
    parallelism: this rank's partial sum; the ranks' outputs summed by the engine's
    all-reduce are the layer's) or "expert" (expert parallelism: each rank its own
    tokens, exchanged over NCCL inside forward_layer; "id" from new_group_id() on one
    rank, e.g. handed over with torch.distributed.broadcast_object_list; every rank
    calls forward_layer for every layer with CUDA tensors). A value out of range
    raises MoeError naming the option.

    Read at open: model_info (a dict of moe_model_info's fields, the C++ ModelInfo;
    moe_layers a list), served_layers (the MoE layers this session serves), device
    ("cuda" or "cpu") and options (the options with their defaults filled in)."""

    def __init__(self, **options):
        self._lib = _lib.lib()
        import ctypes
        handle = ctypes.c_void_p()
        _check(self._lib.moe_session_open(json.dumps(options).encode(), ctypes.byref(handle)))
        self._handle = handle
        info = _lib.ModelInfo()
        _check(self._lib.moe_session_model_info(self._handle, ctypes.byref(info)))
        self.model_info = _model_info_dict(info)
        self.served_layers = self._list(self._lib.moe_session_served_layers, self._handle)
        self.device = self._lib.moe_session_device(self._handle).decode()
        self.options = json.loads(self._lib.moe_session_options(self._handle).decode())

    @staticmethod
    def _list(fn, *args):
        """The int32 list a moe_* function writes with (buffer, capacity, count)."""
        import ctypes
        n = ctypes.c_int32()
        _check(fn(*args, None, 0, ctypes.byref(n)))
        buf = (ctypes.c_int32 * max(n.value, 1))()
        _check(fn(*args, buf, n.value, ctypes.byref(n)))
        return list(buf[: n.value])

    def _h(self):
        if self._handle is None:
            raise ValueError("session: closed")
        return self._handle

    def forward_layer(self, layer, hidden, topk_ids, topk_weights, out=None, stats=None):
        """out[t] = sum_j topk_weights[t,j] * FFN_{topk_ids[t,j]}(hidden[t]); returns out.
        `stats`, if a dict, receives the call's counters."""
        import ctypes
        c = _Call(self, hidden, topk_ids, topk_weights, out)
        cs = _lib.CallStats() if stats is not None else None
        _check(self._lib.moe_forward_layer(self._h(), int(layer), c.T, c.k, *c.ptrs, c.memory, c.stream,
                                     ctypes.byref(cs) if cs is not None else None))
        if cs is not None:
            stats.update(_stats_dict(cs))
        return c.output()

    def forward_layer_async(self, layer, hidden, topk_ids, topk_weights, out=None):
        """Starts a call; returns a Pending for wait(). The arrays are kept alive until then."""
        import ctypes
        c = _Call(self, hidden, topk_ids, topk_weights, out)
        ticket = ctypes.c_int32(-1)
        _check(self._lib.moe_forward_layer_async(self._h(), int(layer), c.T, c.k, *c.ptrs, c.memory, c.stream,
                                                 ctypes.byref(ticket)))
        return Pending(ticket.value, c)

    def wait(self, pending, stats=None):
        """Finishes a started call; returns its output."""
        import ctypes
        if not isinstance(pending, Pending) or pending._call is None:
            raise ValueError("pending: not a started call (or already waited for)")
        cs = _lib.CallStats()
        call, pending._call = pending._call, None
        _check(self._lib.moe_wait(self._h(), pending.ticket, ctypes.byref(cs)))
        if stats is not None:
            stats.update(_stats_dict(cs))
        return call.output()

    def forward_layer_capturable(self, layer, hidden, topk_ids, topk_weights, out=None):
        """A CUDA-graph-capturable call (torch CUDA tensors, cuda backend): enqueued on the
        current torch CUDA stream, returns `out` at once (filled in stream order). Run each
        layer once outside a capture first; replays read the cache placement as it is then.
        Errors found at replay time write NaN and are raised by take_stream_error()."""
        c = _Call(self, hidden, topk_ids, topk_weights, out)
        if c.memory != _lib.MEMORY_DEVICE:
            raise ValueError("hidden: capturable calls take CUDA tensors")
        _check(self._lib.moe_forward_layer_capturable(self._h(), int(layer), c.T, c.k, *c.ptrs, c.stream))
        return c.output()

    def take_stream_error(self):
        """Raises the first run-time error of capturable calls since the last call. Also hands
        the expert accesses the GPU counted to the cache (popularity) and reconnects a server
        that went away: call it every few decode steps, outside a capture."""
        _check(self._lib.moe_take_stream_error(self._h()))

    def apply_assignment(self, layer, experts, pinned=()):
        """The cached set of `layer` becomes `experts` (copies start now); `pinned`, a subset
        of them, are never evicted by the session's own admissions (predictive policy)."""
        import ctypes
        experts = [int(e) for e in experts]
        pinned = [int(e) for e in pinned]
        arr = (ctypes.c_int32 * max(len(experts), 1))(*experts)
        pin = (ctypes.c_int32 * max(len(pinned), 1))(*pinned)
        _check(self._lib.moe_apply_assignment(self._h(), int(layer), arr, len(experts), pin, len(pinned)))

    def flush_copies(self):
        """Waits until every cache copy in flight has completed."""
        _check(self._lib.moe_flush_copies(self._h()))

    def set_server_enabled(self, address, enabled):
        """Stops (False) or resumes (True) sending misses to the expert server at `address`
        (as given in servers): a drain, a server taken down."""
        _check(self._lib.moe_set_server_enabled(self._h(), str(address).encode(), 1 if enabled else 0))

    def cached_experts(self, layer):
        """The experts in `layer`'s cache slots (resident or loading), by slot: -1 = empty."""
        return self._list(self._lib.moe_cached_experts, self._h(), int(layer))

    def hit_rate(self, layer):
        """The fraction of `layer`'s routed pairs served from the cache so far."""
        import ctypes
        rate = ctypes.c_double()
        _check(self._lib.moe_hit_rate(self._h(), int(layer), ctypes.byref(rate)))
        return rate.value

    def slots_per_layer(self):
        """The cache's slots per layer (experts cached per layer)."""
        import ctypes
        n = ctypes.c_int32()
        _check(self._lib.moe_slots_per_layer(self._h(), ctypes.byref(n)))
        return n.value

    def totals(self):
        """The forward calls' totals since the session opened (dict of moe_session_totals)."""
        import ctypes
        s = _lib.SessionTotals()
        _check(self._lib.moe_totals(self._h(), ctypes.byref(s)))
        return _stats_dict(s)

    def describe(self):
        """One line: model, device, cache, servers."""
        return self._lib.moe_session_describe(self._h()).decode()

    def close(self):
        if getattr(self, "_handle", None) is not None:
            self._lib.moe_session_close(self._handle)
            self._handle = None

    def __deepcopy__(self, memo):  # a handle: a copied model shares it (and closes it once)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def new_group_id():
    """A new expert-parallel group id (str): Session(group={"mode": "expert", "id": ...})."""
    import ctypes
    buf = ctypes.create_string_buffer(257)
    _check(_lib.lib().moe_new_group_id(buf, 257))
    return buf.value.decode()


def reference_forward(model, layer, hidden, topk_ids, topk_weights):
    """The library's reference MoE (f32) for numpy inputs: float32 [T,H]. Slow; for tests."""
    import numpy as np
    bits = to_bf16_bits(hidden) if hidden.dtype == np.float32 else np.ascontiguousarray(hidden, dtype=np.uint16)
    ids = np.ascontiguousarray(topk_ids, dtype=np.int32)
    w = np.ascontiguousarray(topk_weights, dtype=np.float32)
    out = np.empty(bits.shape, dtype=np.float32)
    lib = _lib.lib()
    _check(lib.moe_reference_forward(model.encode(), int(layer), ids.shape[0], ids.shape[1], bits.ctypes.data,
                                     ids.ctypes.data, w.ctypes.data, out.ctypes.data))
    return out
