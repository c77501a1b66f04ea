"""ctypes bindings of include/moe/moe.h (libmoe.so). Internal: use Session.

libmoe.so is searched, in order: $MOE_LIBRARY (a path), the copy bundled in
this package (pip install with MOE_LIBMOE set), then the dynamic loader's
search path (ctypes.util.find_library("moe"), e.g. an installed prefix).
"""
import ctypes
import ctypes.util
import os
import threading

ABI_VERSION = 6
MEMORY_HOST = 0
MEMORY_DEVICE = 1


class ModelInfo(ctypes.Structure):
    """moe_model_info (include/moe/moe.h), the fields of moe::ModelInfo."""
    _fields_ = [("model_type", ctypes.c_char * 64), ("num_layers", ctypes.c_int32), ("num_moe_layers", ctypes.c_int32),
                ("moe_layers", ctypes.POINTER(ctypes.c_int32))] + [(n, ctypes.c_int32) for n in (
                    "num_experts", "top_k", "hidden", "intermediate")] + [
                ("weight_dtype", ctypes.c_char * 16), ("expert_bytes", ctypes.c_uint64), ("identity", ctypes.c_uint64),
                ("expert_math", ctypes.c_char * 64), ("routing", ctypes.c_char * 16)]


class CallStats(ctypes.Structure):
    """moe_call_stats (include/moe/moe.h), the fields of moe::CallStats."""
    _fields_ = [(n, ctypes.c_int64) for n in (
        "hit_pairs", "cpu_pairs", "cpu_experts", "copied_pairs", "copied_experts", "prefetched_pairs",
        "prefetched_experts", "miss_tokens", "failovers", "bytes_shipped")] + [(n, ctypes.c_double) for n in ("seconds", "submit_seconds", "wait_seconds")]


class SessionTotals(ctypes.Structure):
    """moe_session_totals (include/moe/moe.h), the fields of moe::SessionTotals."""
    _fields_ = [(n, ctypes.c_int64) for n in (
        "calls", "failed_calls", "hit_pairs", "cpu_pairs", "copied_pairs", "miss_tokens", "failovers",
        "bytes_shipped", "cache_copies_started", "cache_copies_pending")] + [("seconds", ctypes.c_double)]


_lock = threading.Lock()
_lib = None


def _candidates():
    env = os.environ.get("MOE_LIBRARY")
    if env:
        yield env
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmoe.so")
    if os.path.exists(here):
        yield here
    found = ctypes.util.find_library("moe")
    if found:
        yield found
    yield "libmoe.so"


def _declare(lib):
    P, I32, VP = ctypes.POINTER, ctypes.c_int32, ctypes.c_void_p
    sig = {
        "moe_abi_version": (ctypes.c_int, []),
        "moe_last_error": (ctypes.c_char_p, []),
        "moe_status_name": (ctypes.c_char_p, [ctypes.c_int]),
        "moe_session_open": (ctypes.c_int, [ctypes.c_char_p, P(VP)]),
        "moe_session_close": (None, [VP]),
        "moe_session_model_info": (ctypes.c_int, [VP, P(ModelInfo)]),
        "moe_session_served_layers": (ctypes.c_int, [VP, P(I32), I32, P(I32)]),
        "moe_session_device": (ctypes.c_char_p, [VP]),
        "moe_session_options": (ctypes.c_char_p, [VP]),
        "moe_forward_layer": (ctypes.c_int, [VP, I32, I32, I32, VP, VP, VP, VP, I32, VP, P(CallStats)]),
        "moe_forward_layer_async": (ctypes.c_int, [VP, I32, I32, I32, VP, VP, VP, VP, I32, VP, P(I32)]),
        "moe_wait": (ctypes.c_int, [VP, I32, P(CallStats)]),
        "moe_apply_assignment": (ctypes.c_int, [VP, I32, P(I32), I32, P(I32), I32]),
        "moe_flush_copies": (ctypes.c_int, [VP]),
        "moe_set_server_enabled": (ctypes.c_int, [VP, ctypes.c_char_p, I32]),
        "moe_cached_experts": (ctypes.c_int, [VP, I32, P(I32), I32, P(I32)]),
        "moe_hit_rate": (ctypes.c_int, [VP, I32, P(ctypes.c_double)]),
        "moe_slots_per_layer": (ctypes.c_int, [VP, P(I32)]),
        "moe_totals": (ctypes.c_int, [VP, P(SessionTotals)]),
        "moe_session_describe": (ctypes.c_char_p, [VP]),
        "moe_new_group_id": (ctypes.c_int, [ctypes.c_char_p, I32]),
        "moe_forward_layer_capturable": (ctypes.c_int, [VP, I32, I32, I32, VP, VP, VP, VP, VP]),
        "moe_take_stream_error": (ctypes.c_int, [VP]),
        "moe_reference_forward": (ctypes.c_int, [ctypes.c_char_p, I32, I32, I32, VP, VP, VP, VP]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def lib():
    """The loaded libmoe.so (loaded once, thread-safe)."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        errors = []
        for path in _candidates():
            try:
                candidate = ctypes.CDLL(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            _declare(candidate)
            version = candidate.moe_abi_version()
            if version != ABI_VERSION:
                raise ImportError(f"{path}: libmoe ABI version {version}, this package needs {ABI_VERSION}")
            _lib = candidate
            return _lib
        raise ImportError("libmoe.so not found (set MOE_LIBRARY to its path): " + "; ".join(errors))
