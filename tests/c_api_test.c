/* The C ABI (include/moe/moe.h, libmoe.so) from a program compiled as C, the
 * way a C engine uses it: a real moe-expert-server (shared memory and gRPC on
 * loopback), sessions on the cpu backend, outputs against the reference MoE
 * on random data, async start/wait, an applied assignment that turns misses
 * into hits, session stats, and clear errors on bad arguments. Exit 0 when
 * every check holds; each failure prints one line. */
#define _GNU_SOURCE
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "moe/moe.h"

#define MODEL "synthetic:tiny:seed=5"

static int failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++failures;                                         \
      fprintf(stderr, "FAIL line %d: ", __LINE__);        \
      fprintf(stderr, __VA_ARGS__);                       \
      fprintf(stderr, " [last error: %s]\n", moe_last_error()); \
    }                                                     \
  } while (0)

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static double uniform(void) { /* xorshift64*, in [0, 1) */
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return (double)((rng * 0x2545f4914f6cdd1dull) >> 11) / 9007199254740992.0;
}

/* Random hidden [T,H] and top-k routing with distinct experts per token. */
static void random_call(int T, int H, int k, int E, uint16_t* hidden, int32_t* ids, float* w) {
  for (int i = 0; i < T * H; ++i) hidden[i] = to_bf16((float)(uniform() * 2 - 1));
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < k; ++j) {
      int e, dup;
      do {
        e = (int)(uniform() * E);
        dup = 0;
        for (int q = 0; q < j; ++q) dup |= ids[t * k + q] == e;
      } while (dup);
      ids[t * k + j] = e;
      w[t * k + j] = (float)(0.1 + uniform());
    }
  }
}

/* ||out - ref|| / ||ref|| */
static double rel_error(const uint16_t* out, const float* ref, int n) {
  double num = 0, den = 0;
  for (int i = 0; i < n; ++i) {
    double x = from_bf16(out[i]), y = ref[i];
    if (!isfinite(x)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den == 0 ? INFINITY : sqrt(num / den);
}

/* Starts moe-expert-server; returns its pid and writes its gRPC address. */
static pid_t start_server(const char* socket_path, char* address, size_t cap) {
  char bin[4096];
  const char* dir = getenv("MOE_BIN_DIR");
  if (dir != NULL) snprintf(bin, sizeof bin, "%s/moe-expert-server", dir);
  else snprintf(bin, sizeof bin, "%s/expert_server/moe-expert-server", MOE_BUILD_DIR);
  int fds[2];
  if (pipe(fds) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    char shm[4200];
    snprintf(shm, sizeof shm, "--shm-socket=%s", socket_path);
    execl(bin, bin, "--insecure", "--model=" MODEL, "--threads=1", "--listen=127.0.0.1:0", shm, (char*)NULL);
    _exit(127);
  }
  close(fds[1]);
  FILE* f = fdopen(fds[0], "r");
  char line[1024];
  address[0] = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    const char* p = strstr(line, "ready on ");
    if (p != NULL) {
      snprintf(address, cap, "%s", p + 9);
      address[strcspn(address, "\r\n")] = 0;
      break;
    }
  }
  /* The server keeps writing to stdout; a reader thread is overkill for the
   * few lines it prints, so the pipe stays open (the buffer is 64 KiB). */
  return address[0] ? pid : -1;
}

int main(void) {
  CHECK(moe_abi_version() == MOE_ABI_VERSION, "abi version %d", moe_abi_version());
  CHECK(strcmp(moe_status_name(MOE_INVALID_ARGUMENT), "INVALID_ARGUMENT") == 0, "status name");

  char dir[] = "/tmp/moe_c_api_XXXXXX";
  if (mkdtemp(dir) == NULL) return 2;
  char sock[256], address[256];
  snprintf(sock, sizeof sock, "%s/expert.sock", dir);
  pid_t server = start_server(sock, address, sizeof address);
  if (server < 0) {
    fprintf(stderr, "FAIL: moe-expert-server did not come up\n");
    return 1;
  }

  /* Errors before a session exists. */
  moe_session* s = NULL;
  CHECK(moe_session_open("{not json", &s) == MOE_INVALID_ARGUMENT && s == NULL, "bad json");
  CHECK(strstr(moe_last_error(), "options_json") != NULL, "bad json names options_json");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"cache_slots\":3}", &s) == MOE_INVALID_ARGUMENT,
        "unknown key refused");
  CHECK(strstr(moe_last_error(), "cache_slots") != NULL, "unknown key named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"max_tokens\":\"many\"}", &s) == MOE_INVALID_ARGUMENT,
        "wrong type refused");
  CHECK(strstr(moe_last_error(), "max_tokens") != NULL, "wrong type named");
  CHECK(moe_session_open("{\"servers\":[]}", &s) == MOE_INVALID_ARGUMENT, "missing model");
  /* Sizing options have ranges, checked before anything is allocated (issue 25, defect 2). */
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"contexts\":100000}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "contexts out of range refused");
  CHECK(strstr(moe_last_error(), "contexts") != NULL, "contexts named");
  /* 2^63 parses as an unsigned JSON number: reported as given, not as a negative int64 (issue 47). */
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"contexts\":9223372036854775808}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "contexts 2^63 refused");
  CHECK(strstr(moe_last_error(), "contexts: 9223372036854775808") != NULL, "contexts 2^63 reported as given");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"cpu_threads\":100000}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "cpu_threads beyond the machine refused");
  CHECK(strstr(moe_last_error(), "cpu_threads") != NULL, "cpu_threads named (not --threads)");
  /* A bad expert-parallel rank or id is named as such, not as a missing cuda backend. */
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\","
                         "\"group\":{\"rank\":5,\"size\":2,\"mode\":\"expert\"}}", &s) == MOE_INVALID_ARGUMENT && s == NULL,
        "a rank outside the group refused");
  CHECK(strstr(moe_last_error(), "group (rank, size; mode expert)") != NULL, "group rank named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\","
                         "\"group\":{\"rank\":0,\"size\":2,\"mode\":\"expert\",\"id\":\"zz\"}}", &s) ==
                MOE_INVALID_ARGUMENT && s == NULL,
        "a malformed group id refused");
  CHECK(strstr(moe_last_error(), "group.id") != NULL, "group.id named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"group\":{\"mode\":\"data\"}}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "an unknown group mode refused");
  CHECK(strstr(moe_last_error(), "options.group.mode") != NULL, "group.mode named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"group\":{\"ranks\":2}}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "an unknown group key refused");
  CHECK(strstr(moe_last_error(), "options.group.ranks") != NULL, "group key named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"cache_gib\":1e9}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "cache_gib out of range refused");
  CHECK(strstr(moe_last_error(), "cache-gib") != NULL, "cache_gib named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"max_tokens\":1000000000}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "max_tokens out of range refused");
  CHECK(strstr(moe_last_error(), "max-tokens") != NULL, "max_tokens named");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\",\"device\":\"cpu\",\"group\":{\"rank\":2,\"size\":2}}", &s) ==
            MOE_INVALID_ARGUMENT && s == NULL,
        "a tensor-parallel rank outside the group refused");
  CHECK(strstr(moe_last_error(), "group (rank, size; mode tensor)") != NULL, "tensor group named");
  /* Expert parallelism: the cpu backend cannot take it. */
  {
    /* A well-formed group (rank, size and a 256-hex-character id) on the cpu backend. */
    char opts[512];
    char hex_id[257];
    memset(hex_id, 'a', 256);
    hex_id[256] = '\0';
    snprintf(opts, sizeof opts,
             "{\"model\":\"%s\",\"device\":\"cpu\",\"group\":{\"rank\":0,\"size\":2,\"mode\":\"expert\",\"id\":\"%s\"}}",
             MODEL, hex_id);
    CHECK(moe_session_open(opts, &s) == MOE_FAILED_PRECONDITION && s == NULL, "ep on the cpu backend refused");
  }
  CHECK(strstr(moe_last_error(), "group") != NULL, "group named");
  {
    char id[257];
    CHECK(moe_new_group_id(id, 10) != MOE_OK, "a short id buffer refused");
    const moe_status st = moe_new_group_id(id, sizeof id);
    /* NCCL builds make an id (256 hex characters); others say why not. */
    CHECK(st == MOE_OK ? strlen(id) == 256 && strspn(id, "0123456789abcdef") == 256
                       : st == MOE_FAILED_PRECONDITION || st == MOE_UNAVAILABLE,
          "moe_new_group_id");
  }
  CHECK(moe_session_open(NULL, &s) == MOE_INVALID_ARGUMENT, "null options");
  CHECK(moe_session_open("{\"model\":\"" MODEL "\"}", NULL) == MOE_INVALID_ARGUMENT, "null out");
  CHECK(moe_forward_layer(NULL, 1, 1, 1, NULL, NULL, NULL, NULL, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT,
        "null session");
  moe_session_close(NULL);

  /* One session over shared memory, one over gRPC. */
  char opts[2][1024];
  snprintf(opts[0], sizeof opts[0],
           "{\"model\":\"" MODEL "\",\"servers\":[\"unix://%s\"],\"device\":\"cpu\",\"policy\":\"static\",\"copy_mode\":\"never\","
           "\"cache_experts_per_layer\":2,\"max_tokens\":16,\"cpu_threads\":1,\"deadline_ms\":20000}",
           sock);
  snprintf(opts[1], sizeof opts[1],
           "{\"model\":\"" MODEL "\",\"servers\":[\"%s\"],\"device\":\"cpu\",\"policy\":\"static\",\"copy_mode\":\"never\","
           "\"cache_experts_per_layer\":2,\"max_tokens\":16,\"cpu_threads\":1,\"tls\":{\"insecure\":true}}",
           address);
  uint64_t identity = 0; /* the model's content identity: the same through either transport */
  for (int v = 0; v < 2; ++v) {
    s = NULL;
    moe_status st = moe_session_open(opts[v], &s);
    CHECK(st == MOE_OK && s != NULL, "open session %d: %s", v, moe_status_name(st));
    if (s == NULL) continue;
    moe_model_info info;
    CHECK(moe_session_model_info(s, &info) == MOE_OK, "model info");
    CHECK(strcmp(info.model_type, "deepseek_v3") == 0 && info.num_moe_layers >= 1 && info.moe_layers != NULL &&
              info.hidden > 0 && info.intermediate > 0 && info.weight_dtype[0] != '\0' &&
              info.expert_bytes > 0,
          "model info fields: type %s, %d MoE layers, dtype %s", info.model_type, info.num_moe_layers,
          info.weight_dtype);
    CHECK(strcmp(info.expert_math, "silu") == 0 && strcmp(info.routing, "softmax_topk") == 0,
          "model info: expert_math %s, routing %s", info.expert_math, info.routing);
    int32_t slots = 0;
    CHECK(moe_slots_per_layer(s, &slots) == MOE_OK && slots == 2, "slots per layer %d", slots);
    CHECK(strcmp(moe_session_device(s), "cpu") == 0, "device %s", moe_session_device(s));
    CHECK(strcmp(moe_session_device(NULL), "") == 0, "device of no session");
    CHECK(strstr(moe_session_options(s), "\"max_tokens\":16") != NULL &&
              strstr(moe_session_options(s), "\"policy\":\"static\"") != NULL,
          "options %s", moe_session_options(s));
    CHECK(info.identity != 0 && (identity == 0 || info.identity == identity), "info.identity %llx",
          (unsigned long long)info.identity);
    identity = info.identity;
    int32_t layers[8], nl = 0;
    CHECK(moe_session_served_layers(s, layers, 8, &nl) == MOE_OK && nl >= 1 && nl == info.num_moe_layers &&
              layers[0] == info.moe_layers[0],
          "served layers");
    const int H = info.hidden, E = info.num_experts, k = info.top_k, T = 5, L = layers[0];
    uint16_t* hidden = malloc(sizeof(uint16_t) * T * H);
    uint16_t* out = malloc(sizeof(uint16_t) * T * H);
    uint16_t* out2 = malloc(sizeof(uint16_t) * T * H);
    float* ref = malloc(sizeof(float) * T * H);
    int32_t ids[5 * 8];
    float w[5 * 8];

    /* All misses (nothing assigned yet): the CPU server computes them. */
    random_call(T, H, k, E, hidden, ids, w);
    moe_call_stats cs;
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, &cs) == MOE_OK, "forward");
    CHECK(moe_reference_forward(MODEL, L, T, k, hidden, ids, w, ref) == MOE_OK, "reference");
    double err = rel_error(out, ref, T * H);
    CHECK(err <= 1e-2, "session %d forward vs reference: rel error %g", v, err);
    CHECK(cs.cpu_pairs == T * k && cs.hit_pairs == 0 && cs.miss_tokens == T, "all-miss stats: cpu %lld hit %lld",
          (long long)cs.cpu_pairs, (long long)cs.hit_pairs);

    /* Assign experts 0 and 1: their pairs become hits, the output stays exact. */
    const int32_t assign[2] = {0, 1};
    CHECK(moe_apply_assignment(s, L, assign, 2, assign, 1) == MOE_OK, "assign (expert 0 pinned)");
    CHECK(moe_flush_copies(s) == MOE_OK, "flush");
    {
      int32_t cached[8], nc = 0;
      CHECK(moe_cached_experts(s, L, cached, 8, &nc) == MOE_OK && nc == 2 &&
                ((cached[0] == 0 && cached[1] == 1) || (cached[0] == 1 && cached[1] == 0)),
            "cached experts: %d", nc);
      CHECK(moe_cached_experts(s, 0, cached, 8, &nc) == MOE_INVALID_ARGUMENT && strstr(moe_last_error(), "layer"),
            "cached experts of a dense layer refused");
    }
    for (int t = 0; t < T; ++t) ids[t * k] = t % 2; /* every token uses expert 0 or 1 first */
    for (int t = 0; t < T; ++t)
      for (int j = 1; j < k; ++j)
        if (ids[t * k + j] == ids[t * k]) ids[t * k + j] = 2 + (j % (E - 2));
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, &cs) == MOE_OK, "forward 2");
    CHECK(moe_reference_forward(MODEL, L, T, k, hidden, ids, w, ref) == MOE_OK, "reference 2");
    err = rel_error(out, ref, T * H);
    CHECK(err <= 1e-2, "after assignment: rel error %g", err);
    CHECK(cs.hit_pairs >= T && cs.hit_pairs + cs.cpu_pairs + cs.copied_pairs == T * k, "hits after assignment: %lld",
          (long long)cs.hit_pairs);

    /* Two calls in flight, finished in reverse order. */
    uint16_t* hidden2 = malloc(sizeof(uint16_t) * T * H);
    int32_t ids2[5 * 8];
    float w2[5 * 8];
    float* ref2 = malloc(sizeof(float) * T * H);
    random_call(T, H, k, E, hidden2, ids2, w2);
    int32_t a = -1, b = -1;
    CHECK(moe_forward_layer_async(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, &a) == MOE_OK, "async a");
    CHECK(moe_forward_layer_async(s, nl > 1 ? layers[1] : L, T, k, hidden2, ids2, w2, out2, MOE_MEMORY_HOST, NULL, &b) ==
              MOE_OK,
          "async b");
    CHECK(moe_wait(s, b, NULL) == MOE_OK, "wait b");
    CHECK(moe_wait(s, a, NULL) == MOE_OK, "wait a");
    CHECK(moe_reference_forward(MODEL, nl > 1 ? layers[1] : L, T, k, hidden2, ids2, w2, ref2) == MOE_OK, "ref b");
    CHECK(rel_error(out, ref, T * H) <= 1e-2, "async a vs reference: %g", rel_error(out, ref, T * H));
    CHECK(rel_error(out2, ref2, T * H) <= 1e-2, "async b vs reference: %g", rel_error(out2, ref2, T * H));

    /* Bad arguments: clear errors naming the argument, the session keeps working. */
    CHECK(moe_forward_layer(s, 0, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "layer") != NULL,
          "dense layer refused");
    int32_t bad_ids[5 * 8];
    memcpy(bad_ids, ids, sizeof bad_ids);
    bad_ids[3] = E + 7;
    CHECK(moe_forward_layer(s, L, T, k, hidden, bad_ids, w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "expert_ids") != NULL,
          "expert id out of range refused");
    float bad_w[5 * 8];
    memcpy(bad_w, w, sizeof bad_w);
    bad_w[1] = NAN;
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, bad_w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "expert_weights") != NULL,
          "NaN weight refused");
    CHECK(moe_forward_layer(s, L, 17, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "tokens") != NULL,
          "T over max_tokens refused");
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, 7, NULL, NULL) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "memory") != NULL,
          "bad memory kind refused");
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_DEVICE, NULL, NULL) == MOE_INVALID_ARGUMENT,
          "device memory on the cpu backend refused");
    int dummy_stream;
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, &dummy_stream, NULL) ==
                  MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "cuda_stream") != NULL,
          "a CUDA stream on the cpu backend refused");
    CHECK(moe_forward_layer(s, L, T, k, NULL, ids, w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_INVALID_ARGUMENT,
          "null hidden refused");
    CHECK(moe_wait(s, 99, NULL) != MOE_OK, "unknown ticket refused");
    CHECK(moe_forward_layer_capturable(s, L, T, k, hidden, ids, w, out, &dummy_stream) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "memory") != NULL,
          "capturable call on the cpu backend refused");
    CHECK(moe_take_stream_error(s) == MOE_OK, "no stream error");
    CHECK(moe_apply_assignment(s, L, NULL, 3, NULL, 0) == MOE_INVALID_ARGUMENT, "null assignment refused");
    CHECK(moe_apply_assignment(s, L, assign, 2, NULL, 1) == MOE_INVALID_ARGUMENT &&
              strstr(moe_last_error(), "pinned") != NULL,
          "null pinned refused");
    const int32_t bad_assign[1] = {E};
    CHECK(moe_apply_assignment(s, L, bad_assign, 1, NULL, 0) == MOE_INVALID_ARGUMENT, "unknown expert in assignment");
    double hit_rate = -1;
    CHECK(moe_hit_rate(s, L, &hit_rate) == MOE_OK && hit_rate > 0 && hit_rate <= 1, "hit rate %g", hit_rate);
    CHECK(moe_set_server_enabled(s, "unix:///no/such.sock", 0) != MOE_OK, "an unknown server refused");
    CHECK(moe_set_server_enabled(s, NULL, 0) == MOE_INVALID_ARGUMENT, "a NULL server refused");
    CHECK(moe_forward_layer(s, L, T, k, hidden, ids, w, out, MOE_MEMORY_HOST, NULL, NULL) == MOE_OK &&
              rel_error(out, ref, T * H) <= 1e-2,
          "still exact after errors");

    moe_session_totals totals;
    CHECK(moe_totals(s, &totals) == MOE_OK, "totals");
    CHECK(totals.hit_pairs >= 2 * T && totals.cpu_pairs >= T * k && totals.miss_tokens >= T &&
              totals.cache_copies_started == 2 && totals.cache_copies_pending == 0 && totals.failed_calls >= 7,
          "totals: calls %lld failed %lld hits %lld cpu %lld copies %lld", (long long)totals.calls,
          (long long)totals.failed_calls, (long long)totals.hit_pairs, (long long)totals.cpu_pairs,
          (long long)totals.cache_copies_started);
    CHECK(strstr(moe_session_describe(s), "cpu") != NULL, "describe");
    free(hidden), free(out), free(out2), free(ref), free(hidden2), free(ref2);
    moe_session_close(s);
  }

  /* A session of another model than its server's is refused, naming the model identities. */
  char other[1024];
  snprintf(other, sizeof other,
           "{\"model\":\"synthetic:tiny:seed=6\",\"servers\":[\"unix://%s\"],\"device\":\"cpu\",\"cpu_threads\":1}",
           sock);
  s = NULL;
  CHECK(moe_session_open(other, &s) == MOE_FAILED_PRECONDITION && s == NULL &&
            strstr(moe_last_error(), "model identity") != NULL && strstr(moe_last_error(), MODEL) != NULL,
        "another model refused: %s", moe_last_error());

  /* A session whose server is not there fails to open, cleanly. */
  char missing[1024];
  snprintf(missing, sizeof missing,
           "{\"model\":\"" MODEL "\",\"servers\":[\"unix://%s/none.sock\"],\"device\":\"cpu\",\"host_copy\":false}",
           dir);
  s = NULL;
  moe_status st = moe_session_open(missing, &s);
  CHECK(st != MOE_OK && s == NULL && moe_last_error()[0] != 0, "missing server: %s", moe_status_name(st));

  kill(server, SIGTERM);
  waitpid(server, NULL, 0);
  unlink(sock);
  rmdir(dir);
  if (failures == 0) printf("c_api_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
