/* moe.h: the C ABI of moe-expert-service (libmoe.so).
 *
 * A session computes MoE layers of one model for one engine: it keeps the hot
 * experts in a device (or host) cache and ships the other (token, expert)
 * pairs to CPU expert servers. This header is plain C (C99), has no C++ types
 * and is the only interface engines written in C, Python (ctypes), Rust, ...
 * need:
 *
 *   moe_session* s;
 *   if (moe_session_open("{\"model\":\"synthetic:tiny\",\"servers\":[\"unix:///run/moe.sock\"]}", &s))
 *     fprintf(stderr, "%s\n", moe_last_error());
 *   moe_forward_layer(s, layer, T, k, hidden, topk_ids, topk_weights, out, MOE_MEMORY_HOST, NULL, NULL);
 *   moe_session_close(s);
 *
 * Tensors: hidden [T,H] bf16 (raw uint16 bits), topk_ids [T,k] int32 (-1 =
 * unused slot), topk_weights [T,k] float32 (applied as given), out [T,H]
 * bf16 = sum_j w[t,j] * FFN_{ids[t,j]}(hidden[t]), all row-major and dense.
 * `memory` says where the four pointers live: MOE_MEMORY_HOST or
 * MOE_MEMORY_DEVICE (CUDA device memory; cuda backend only).
 *
 * Stream order: `cuda_stream` (a cudaStream_t, or NULL) is the engine's
 * stream. The call's device work starts after everything the engine enqueued
 * on it before the call, and work the engine enqueues on it after the call
 * returns sees the output. The library orders itself with CUDA events; it
 * never calls cudaDeviceSynchronize nor synchronizes `cuda_stream` on the
 * host. (It does wait on the host for its own stream: the routing must reach
 * the host to decide hits and misses.)
 *
 * Errors: every function returns a moe_status (0 = MOE_OK); the numeric codes
 * are those of gRPC / absl::StatusCode. The text of the calling thread's last
 * error is moe_last_error(). Nothing aborts the host process: bad arguments
 * are MOE_INVALID_ARGUMENT naming the argument, C++ exceptions and allocation
 * failures are caught at this boundary (MOE_INTERNAL / MOE_RESOURCE_EXHAUSTED).
 *
 * Thread-safety: every function may be called from any thread. Calls on one
 * session are serialised by the session (a mutex); use one session per engine
 * thread / GPU for parallelism. moe_session_close must not race with other
 * calls on the same session.
 *
 * Names: every operation has the name of its C++ counterpart (moe/engine.h
 * MoeSession and MoeSession::Admin) in snake case with a moe_ or moe_session_
 * prefix, and the Python Session's method of the same name
 * (scripts/check_api_names.py checks the three surfaces alike).
 *
 * Versioning: MOE_ABI_VERSION changes when a signature or struct changes
 * incompatibly; moe_abi_version() returns the library's. Structs are only
 * ever extended at the end. Version 5 gave the functions their C++ names
 * (moe_forward -> moe_forward_layer, moe_forward_async ->
 * moe_forward_layer_async, moe_forward_capturable ->
 * moe_forward_layer_capturable, moe_stream_error -> moe_take_stream_error,
 * moe_session_info -> moe_session_model_info, moe_session_moe_layers ->
 * moe_session_served_layers, moe_session_stats_get -> moe_totals),
 * moe_model_info the fields of moe::ModelInfo (the session's own facts are
 * moe_session_device, moe_slots_per_layer and moe_session_options), the
 * "group" option in place of tp_* / ep_* / group_id, `pinned` in
 * moe_apply_assignment, and added moe_set_server_enabled,
 * moe_cached_experts and moe_hit_rate. Version 6 added moe_model_info's
 * expert_math and routing.
 */
#ifndef MOE_MOE_H_
#define MOE_MOE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_ABI_VERSION 6

#if defined(__GNUC__)
#define MOE_API __attribute__((visibility("default")))
#else
#define MOE_API
#endif

/* Status codes (the values of absl::StatusCode / grpc::StatusCode). */
typedef enum moe_status {
  MOE_OK = 0,
  MOE_CANCELLED = 1,
  MOE_UNKNOWN = 2,
  MOE_INVALID_ARGUMENT = 3,
  MOE_DEADLINE_EXCEEDED = 4,
  MOE_NOT_FOUND = 5,
  MOE_ALREADY_EXISTS = 6,
  MOE_PERMISSION_DENIED = 7,
  MOE_RESOURCE_EXHAUSTED = 8,
  MOE_FAILED_PRECONDITION = 9,
  MOE_ABORTED = 10,
  MOE_OUT_OF_RANGE = 11,
  MOE_UNIMPLEMENTED = 12,
  MOE_INTERNAL = 13,
  MOE_UNAVAILABLE = 14,
  MOE_DATA_LOSS = 15,
  MOE_UNAUTHENTICATED = 16
} moe_status;

/* Where the tensors of a call live. */
enum { MOE_MEMORY_HOST = 0, MOE_MEMORY_DEVICE = 1 };

typedef struct moe_session moe_session;

/* The model a session serves: the fields of the C++ moe::ModelInfo
 * (moe/engine.h), which says what each one holds. Strings are NUL-terminated
 * (longer ones cut). */
typedef struct moe_model_info {
  char model_type[64];      /* config.json "model_type", or the synthetic preset's */
  int32_t num_layers;       /* decoder layers, dense ones included */
  int32_t num_moe_layers;   /* entries of moe_layers */
  const int32_t* moe_layers; /* ascending; the model's layers with routed experts (owned by the
                              * session, valid until moe_session_close) */
  int32_t num_experts;      /* routed experts per MoE layer */
  int32_t top_k;            /* the model's k (calls may use any k <= the "max_top_k" option) */
  int32_t hidden;           /* H */
  int32_t intermediate;     /* I of one expert */
  char weight_dtype[16];    /* the checkpoint's expert weights, as safetensors names them (BF16, ...) */
  uint64_t expert_bytes;    /* what one expert copy moves (packed as the host copy keeps it) */
  uint64_t identity;        /* the experts' content identity; every expert server reports the same
                             * one or the session refuses it */
  char expert_math[64];     /* what each expert computes: "silu", or
                             * "clamped_swiglu(alpha=1.702, limit=7)+bias" (GPT-OSS) */
  char routing[16];         /* the family's router: "softmax_topk", or "topk_softmax" (GPT-OSS) */
} moe_model_info;

/* What one call did (pairs = (token, expert) pairs): the fields of the C++
 * moe::CallStats (moe/types.h), which says what each one counts. */
typedef struct moe_call_stats {
  int64_t hit_pairs;      /* computed from the cache */
  int64_t cpu_pairs;      /* computed by CPU expert servers */
  int64_t cpu_experts;    /* distinct experts sent to them */
  int64_t copied_pairs;   /* computed on the device after copying the expert */
  int64_t copied_experts;
  int64_t prefetched_pairs;   /* of copied_pairs: experts copied during the previous layer's call */
  int64_t prefetched_experts;
  int64_t miss_tokens;    /* tokens shipped to servers */
  int64_t failovers;
  int64_t bytes_shipped;
  double seconds;         /* host time of the call (an async call: start + wait) */
  double submit_seconds;  /* of which: starting it (host path) */
  double wait_seconds;    /* of which: waiting for the servers' answers */
} moe_call_stats;

/* Totals since the session opened: the fields of the C++ moe::SessionTotals,
 * and the cache copies of MoeSession::Admin copies_started / PendingCopies. */
typedef struct moe_session_totals {
  int64_t calls;
  int64_t failed_calls;
  int64_t hit_pairs;
  int64_t cpu_pairs;
  int64_t copied_pairs;
  int64_t miss_tokens;
  int64_t failovers;
  int64_t bytes_shipped;
  int64_t cache_copies_started; /* expert copies into cache slots */
  int64_t cache_copies_pending; /* of those, still in flight */
  double seconds;
} moe_session_totals;

/* MOE_ABI_VERSION of the loaded library. */
MOE_API int moe_abi_version(void);

/* Text of the calling thread's last failed call ("" if none). Valid until the
 * thread's next call into the library. */
MOE_API const char* moe_last_error(void);

/* Name of a status code, e.g. "INVALID_ARGUMENT". Never NULL. */
MOE_API const char* moe_status_name(int status);

/* Opens a session. `options_json` is a JSON object:
 *   "model"       (string, required) checkpoint directory, FILE.gguf or "synthetic:PRESET[:layers=N][:seed=S]"
 *   "servers"     (array of strings) "unix:///path.sock" or "host:port", optional "#experts=0-63"
 *   "device"      "auto" | "cuda" | "cpu"                          (default "auto")
 *   "cuda_device" (int: -1, the default, for the opening thread's current GPU,
 *                 or a visible device index)
 *   "cache_experts_per_layer" (int, <= the model's experts) or "cache_gib"
 *                 (number in [0, 1048576])                         (default 0)
 *   "policy"      "predictive" | "static" | "lru" | "lfru"         (default "predictive")
 *   "copy_mode"   "auto" | "never" | "always"                      (default "auto")
 *   "max_tokens"  (int in [1, 65536], default 1024) largest T of one call
 *   "max_top_k"   (int in [1, 1024], default 8)
 *   "contexts"    (int in [1, 64], default 2) calls in flight
 *   "cpu_threads" (int)
 *   "grpc_streams" (int in [1, 64], default 8) ForwardStreams per host:port server, a TCP
 *                 connection each: a batch goes to the first idle one, a batch of 96 KB or
 *                 more is striped over them (docs/transports.md)
 *   "weight_dtype" "auto" | "bf16" | "int8" | "int4" | "fp8" | "mxfp4" (default "auto": the
 *                 same-host servers' when shared, else the checkpoint's class)
 *   "share_host_copy" (bool, default true) map the same-host servers' stores
 *                 instead of keeping an own copy
 *   "fill_cache"  (bool, default true) fill the cache's empty slots at open with each
 *                 layer's first experts (hits from the first call; not under "static")
 *   "group"       {"rank": int, "size": int, "mode": "tensor" | "expert", "id": string}
 *                 (moe/types.h ParallelGroup; default rank 0 of size 1, mode tensor;
 *                 0 <= rank < size <= the model's experts): this
 *                 session is rank `rank` of `size` GPUs holding one cache; it
 *                 computes and caches only the experts its rank owns
 *                 (moe/types.h ExpertOwner). "tensor" (tensor parallelism):
 *                 every rank sees every token and returns its partial sum;
 *                 the ranks' outputs summed (the engine's all-reduce) are the
 *                 layer's output. "expert" (expert parallelism): each rank its
 *                 own tokens; "id" (moe_new_group_id on one rank, handed to
 *                 the others) names the NCCL communicator. The ranks open
 *                 together; every rank calls moe_forward_layer (device memory)
 *                 for every layer, T = 0 included, and gets its tokens' whole
 *                 output; the sessions exchange tokens within the call. A peer
 *                 silent past deadline_ms is left: its experts become CPU
 *                 misses.
 *   "layers"      (array of int) MoE layers served (default all)
 *   "host_copy"   (bool, default true) keep a host copy of the experts
 *   "deadline_ms" (int, default 30000)
 *   "server_deadline_ms" (int, default 10000) a server silent this long on
 *                 one of a call's batches has failed: the batch goes to
 *                 another holder of its experts (or the device) within what
 *                 is left of deadline_ms; it gets batches again once it has
 *                 answered a probe
 *   "tls"         {"cert_file","key_file","ca_file","server_name_override": string, "insecure": bool}
 * Unknown keys and wrong types are MOE_INVALID_ARGUMENT naming the key. On
 * success *out is the session; on failure *out is NULL. */
MOE_API moe_status moe_session_open(const char* options_json, moe_session** out);

/* Closes a session (waits for nothing in flight: wait for started calls
 * first). NULL is ignored. */
MOE_API void moe_session_close(moe_session* session);

/* The model the session serves (MoeSession::model_info). */
MOE_API moe_status moe_session_model_info(moe_session* session, moe_model_info* out);

/* Writes up to `capacity` indexes of the MoE layers this session serves into
 * `layers`, ascending; *count gets their number (may exceed capacity). */
MOE_API moe_status moe_session_served_layers(moe_session* session, int32_t* layers, int32_t capacity,
                                             int32_t* count);

/* The device backend: "cuda" or "cpu" ("" for a NULL session). Static text. */
MOE_API const char* moe_session_device(moe_session* session);

/* The session's options as a JSON object with the keys of moe_session_open,
 * defaults filled in (e.g. "max_tokens", "max_top_k"); the text stays valid
 * until the next call on this session ("" on error, see moe_last_error). */
MOE_API const char* moe_session_options(moe_session* session);

/* One MoE layer, synchronous for the host when memory is MOE_MEMORY_HOST;
 * stream-ordered on `cuda_stream` otherwise (see above). `stats` may be NULL. */
MOE_API moe_status moe_forward_layer(moe_session* session, int32_t layer, int32_t tokens, int32_t top_k,
                                     const void* hidden, const int32_t* topk_ids,
                                     const float* topk_weights, void* out, int32_t memory,
                                     void* cuda_stream, moe_call_stats* stats);

/* Starts a call and returns at once with its ticket; moe_wait finishes it
 * (exactly once per ticket). Up to "contexts" calls may be in flight, so the
 * engine can run another micro-batch's attention while this one's misses are
 * computed on the CPU. Buffers must stay valid until moe_wait returned. */
MOE_API moe_status moe_forward_layer_async(moe_session* session, int32_t layer, int32_t tokens,
                                           int32_t top_k, const void* hidden, const int32_t* topk_ids,
                                           const float* topk_weights, void* out, int32_t memory,
                                           void* cuda_stream, int32_t* ticket);
MOE_API moe_status moe_wait(moe_session* session, int32_t ticket, moe_call_stats* stats);

/* A CUDA-graph-capturable forward (cuda backend; device pointers; a NULL
 * `cuda_stream` is the legacy default stream, as in CUDA, which runs but
 * cannot be captured): the whole call is enqueued on `cuda_stream` and
 * this returns at once, so it may be captured (cudaStreamBeginCapture /
 * torch.cuda.graph) and replayed with new contents of the same buffers. At
 * run/replay time the GPU itself splits hits from misses with the cache
 * placement as it is then (moe_apply_assignment between replays is safe),
 * writes the misses into the CPU servers' shared-memory request slots, runs
 * the hits in one grouped launch and adds the servers' answers — no host
 * function, no host synchronisation. Rules: run each layer once outside a
 * capture first (it allocates), keep the capturable calls of a session in
 * one stream order (cache copies wait for the latest stream used; closing
 * the session waits for the device to finish them, so the stream may be
 * destroyed first), call moe_flush_copies between replays to make new placements serve. A call
 * larger than one request slot (256 tokens) runs as a stream-ordered eager
 * call outside a capture and is refused inside one. A failure at replay time
 * (bad routing, no server for an expert the device cannot take, a server's
 * error) writes NaN into the affected tokens of `out` and is reported by
 * moe_take_stream_error; a request nobody answered (a server silent past the
 * deadline, draining, or unreachable over gRPC) is computed on the device
 * from the host copy (logged; NaN and an error without a host copy). */
MOE_API moe_status moe_forward_layer_capturable(moe_session* session, int32_t layer, int32_t tokens,
                                                int32_t top_k, const void* hidden, const int32_t* topk_ids,
                                                const float* topk_weights, void* out, void* cuda_stream);
/* The first run-time error of capturable calls since the last check (MOE_OK
 * if none). Also reports the expert accesses the GPU counted since the last
 * check to the cache (and a coordinator), and reconnects a server that went
 * away: call it every few decode steps, outside a capture. */
MOE_API moe_status moe_take_stream_error(moe_session* session);

/* The cached set of `layer` becomes experts[0..n) (copies start now; each
 * slot serves once its copy completed). pinned[0..n_pinned), a subset of
 * `experts` (NULL when n_pinned is 0), are never evicted by the session's own
 * admissions (predictive policy). Between calls. */
MOE_API moe_status moe_apply_assignment(moe_session* session, int32_t layer, const int32_t* experts,
                                        int32_t n, const int32_t* pinned, int32_t n_pinned);
/* Waits until every cache copy in flight has completed. */
MOE_API moe_status moe_flush_copies(moe_session* session);

/* Stops (enabled = 0) or resumes sending misses to the expert server at
 * `address` (as given in "servers"): a drain, a server taken down. */
MOE_API moe_status moe_set_server_enabled(moe_session* session, const char* address, int32_t enabled);

/* Writes the experts in `layer`'s cache slots (resident or loading), by slot
 * (-1 = an empty slot), into `experts`, up to `capacity`; *count gets the
 * number of slots (may exceed capacity). */
MOE_API moe_status moe_cached_experts(moe_session* session, int32_t layer, int32_t* experts, int32_t capacity,
                                      int32_t* count);
/* The fraction of `layer`'s routed pairs served from the cache so far. */
MOE_API moe_status moe_hit_rate(moe_session* session, int32_t layer, double* out);
/* The cache's slots per layer (experts cached per layer). */
MOE_API moe_status moe_slots_per_layer(moe_session* session, int32_t* out);

/* Totals since the session opened (MoeSession::totals). */
MOE_API moe_status moe_totals(moe_session* session, moe_session_totals* out);

/* A new expert-parallel group id (the "group" option's "id"): 256 hex
 * characters and a NUL into `out` (capacity >= 257). MOE_FAILED_PRECONDITION
 * in a build without NCCL. */
MOE_API moe_status moe_new_group_id(char* out, int32_t capacity);

/* One-line description of the session (model, device, cache, servers); the
 * text stays valid until the next call on this session. */
MOE_API const char* moe_session_describe(moe_session* session);

/* The reference MoE (plain loops, f32 accumulate) over the weights of
 * `model` (the syntax of the "model" option), for an engine's own tests: the
 * oracle every backend is checked against (MoeSession::ReferenceForward).
 * Host memory; out is [T,H] float32. Slow (meant for small checks); the last
 * model opened is kept. */
MOE_API moe_status moe_reference_forward(const char* model, int32_t layer, int32_t tokens, int32_t top_k,
                                         const void* hidden, const int32_t* topk_ids,
                                         const float* topk_weights, float* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_MOE_H_ */
