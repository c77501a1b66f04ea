// Tests of the shared-memory segment: layout, Create/Attach over a real memfd
// mapped twice, SPSC rings, futex doorbells (threads and a forked process),
// validation of untrusted headers and slots, and a bounded random fuzz.
#include "transport/shm_segment.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "transport/unix_socket.h"
#include "tests/shm_fuzz_one.h"

namespace moe::shm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr uint32_t H = 64, T = 16, K = 4, S = 8;

// A memfd of `bytes`, mapped (MAP_SHARED) as often as asked.
class Memfd {
 public:
  explicit Memfd(size_t bytes) : bytes_(bytes) {
    fd_ = memfd_create("shm_segment_test", MFD_CLOEXEC);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
  }
  ~Memfd() {
    for (void* m : maps_) munmap(m, bytes_);
    close(fd_);
  }
  void* Map() {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    maps_.push_back(p);
    return p;
  }
  int fd() const { return fd_; }
  size_t bytes() const { return bytes_; }

 private:
  int fd_ = -1;
  size_t bytes_;
  std::vector<void*> maps_;
};

// A server view and a client view of one memfd, at two different addresses.
struct Pair {
  Memfd mem{Geometry(H, T, K, S).total_bytes};
  void* server_map = mem.Map();
  void* client_map = mem.Map();
  Segment server = *Segment::Create(server_map, mem.bytes(), H, T, K, S);
  Segment client = *Segment::Attach(client_map, mem.bytes(), H);
};

// Waits for the next value of a ring, sleeping on its doorbell.
template <typename Pop>
std::optional<uint32_t> PopOrWait(Pop pop, std::atomic<uint32_t>& bell, Clock::time_point deadline) {
  for (;;) {
    const uint32_t seen = bell.load(std::memory_order_acquire);
    if (std::optional<uint32_t> v = pop()) return v;
    if (!WaitDoorbell(bell, seen, deadline)) return std::nullopt;
  }
}

void FillValidRequest(const RequestSlot& s, uint32_t n, uint32_t k, int num_experts) {
  WriteRequestHeader(s, 42, 0, n, k);
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t j = 0; j < k; ++j) {
      s.ids[t * k + j] = static_cast<int32_t>((t + j) % num_experts);
      s.weights[t * k + j] = 1.0f / static_cast<float>(k);
    }
  for (uint32_t i = 0; i < n * H; ++i) s.tokens[i] = F32ToBf16(static_cast<float>(i % 7));
}

TEST(ShmGeometry, AlignedAndSized) {
  for (auto [h, t, k, s] : {std::array<uint32_t, 4>{1, 1, 1, 1}, {H, T, K, S}, {2048, 256, 8, 64}, {7168, 3, 9, 2}}) {
    ASSERT_TRUE(ValidateGeometryArgs(h, t, k, s).ok());
    const SegmentGeometry g = Geometry(h, t, k, s);
    for (uint64_t off : {g.header_bytes, g.submit_ring_offset, g.complete_ring_offset, g.ring_bytes, g.slots_offset,
                         g.slot_stride, g.tokens_offset, g.ids_offset, g.weights_offset, g.output_offset,
                         g.total_bytes})
      EXPECT_EQ(off % 64, 0u) << off;
    EXPECT_EQ(g.submit_ring_offset, kHeaderBytes);
    EXPECT_GE(g.ring_bytes, sizeof(RingHeader) + 4u * s);
    EXPECT_EQ(g.complete_ring_offset, g.submit_ring_offset + g.ring_bytes);
    EXPECT_EQ(g.device_submit_ring_offset, g.complete_ring_offset + g.ring_bytes);
    EXPECT_EQ(g.device_complete_ring_offset, g.device_submit_ring_offset + g.ring_bytes);
    EXPECT_EQ(g.slots_offset, g.device_complete_ring_offset + g.ring_bytes);
    EXPECT_GE(g.tokens_offset, sizeof(SlotHeader));
    EXPECT_GE(g.ids_offset - g.tokens_offset, uint64_t{t} * h * 2);
    EXPECT_GE(g.weights_offset - g.ids_offset, uint64_t{t} * k * 4);
    EXPECT_GE(g.output_offset - g.weights_offset, uint64_t{t} * k * 4);
    EXPECT_GE(g.slot_stride - g.output_offset, uint64_t{t} * h * 2);
    EXPECT_EQ(g.total_bytes, g.slots_offset + g.slot_stride * s);
  }
  // H=64, T=16, K=4: header 256 + tokens 2048 + ids 256 + weights 256 + output 2048.
  const SegmentGeometry g = Geometry(H, T, K, S);
  EXPECT_EQ(g.slot_stride, 256u + 2048 + 256 + 256 + 2048);
  EXPECT_EQ(g.ring_bytes, 192u);
}

TEST(ShmGeometry, RejectsBadArgs) {
  EXPECT_FALSE(ValidateGeometryArgs(0, T, K, S).ok());
  EXPECT_FALSE(ValidateGeometryArgs(H, 0, K, S).ok());
  EXPECT_FALSE(ValidateGeometryArgs(H, T, 0, S).ok());
  EXPECT_FALSE(ValidateGeometryArgs(H, T, K, 0).ok());
  EXPECT_FALSE(ValidateGeometryArgs(H, T, K, 6).ok());
  EXPECT_FALSE(ValidateGeometryArgs(UINT32_MAX, UINT32_MAX, UINT32_MAX, 1u << 31).ok());
  EXPECT_FALSE(ValidateGeometryArgs(kMaxHidden + 1, T, K, S).ok());
  // Each dimension within its limit, the total (16 x 16 GiB) is not.
  const absl::Status s = ValidateGeometryArgs(kMaxHidden, kMaxTokensPerSlot, 1, 16);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("exceed the limit"), absl::string_view::npos) << s;
}

TEST(ShmSegment, CreateAndAttachShareMemory) {
  Pair p;
  ASSERT_NE(p.server_map, p.client_map);
  EXPECT_EQ(p.client.geometry(), p.server.geometry());
  const RequestSlot c = p.client.slot(3), s = p.server.slot(3);
  FillValidRequest(c, 5, 2, 16);
  EXPECT_EQ(s.header->n_tokens, 5u);
  EXPECT_EQ(s.ids[3], c.ids[3]);
  EXPECT_EQ(s.tokens[10], c.tokens[10]);
  s.output[H * 5 - 1] = 0x3f80;
  EXPECT_EQ(c.output[H * 5 - 1], 0x3f80);
  ASSERT_TRUE(p.client.TryPushSubmit(3));
  EXPECT_EQ(p.server.TryPopSubmit(), 3u);
  EXPECT_FALSE(p.server.TryPopSubmit());
  ASSERT_TRUE(p.server.TryPushComplete(3));
  EXPECT_EQ(p.client.TryPopComplete(), 3u);

  EXPECT_FALSE(Segment::Create(p.server_map, p.mem.bytes() - 1, H, T, K, S).ok());
  EXPECT_FALSE(Segment::Create(static_cast<char*>(p.server_map) + 8, p.mem.bytes(), H, T, K, S).ok());
}

TEST(ShmRing, FullEmptyAndWraparound) {
  Pair p;
  EXPECT_FALSE(p.server.TryPopSubmit());
  for (uint32_t i = 0; i < S; ++i) EXPECT_TRUE(p.client.TryPushSubmit(i));
  EXPECT_FALSE(p.client.TryPushSubmit(99));  // full
  for (uint32_t i = 0; i < S; ++i) EXPECT_EQ(p.server.TryPopSubmit(), i);
  EXPECT_FALSE(p.server.TryPopSubmit());
  // Many laps with varying fill levels; the complete ring is independent.
  uint32_t next_push = 0, next_pop = 0;
  for (uint32_t round = 0; round < 10000; ++round) {
    for (uint32_t j = 0; j < round % (S + 1); ++j)
      if (p.server.TryPushComplete(next_push)) ++next_push;
    for (uint32_t j = 0; j < (round * 7) % (S + 1); ++j) {
      std::optional<uint32_t> v = p.client.TryPopComplete();
      if (!v) break;
      ASSERT_EQ(*v, next_pop++);
    }
  }
  EXPECT_GT(next_pop, 10u * S);
  // The u64 counters themselves wrap.
  auto* ring = reinterpret_cast<RingHeader*>(static_cast<char*>(p.server_map) + p.server.geometry().submit_ring_offset);
  ring->head = ring->tail = UINT64_MAX - 2;
  for (uint32_t i = 0; i < 3 * S; ++i) {
    ASSERT_TRUE(p.client.TryPushSubmit(i));
    ASSERT_TRUE(p.client.TryPushSubmit(i + 100));
    ASSERT_EQ(p.server.TryPopSubmit(), i);
    ASSERT_EQ(p.server.TryPopSubmit(), i + 100);
  }
  EXPECT_FALSE(p.server.TryPopSubmit());
}

TEST(ShmRing, TwoThreadStressPreservesOrder) {
  Pair p;
  constexpr uint32_t kItems = 1000000;
  std::thread producer([&] {
    for (uint32_t i = 0; i < kItems; ++i)
      while (!p.client.TryPushSubmit(i)) std::this_thread::yield();
  });
  uint32_t expected = 0;
  bool in_order = true;
  while (expected < kItems) {
    std::optional<uint32_t> v = p.server.TryPopSubmit();
    if (!v) {
      std::this_thread::yield();
      continue;
    }
    in_order &= (*v == expected++);
  }
  producer.join();
  EXPECT_TRUE(in_order);
  EXPECT_FALSE(p.server.TryPopSubmit());
}

TEST(ShmDoorbell, WakesAcrossThreadsAndMappings) {
  Pair p;
  std::atomic<uint32_t>& server_bell = p.server.request_doorbell();
  const uint32_t seen = server_bell.load();
  std::thread ringer([&] {
    std::this_thread::sleep_for(milliseconds(20));  // long enough for the waiter to reach FUTEX_WAIT
    ASSERT_TRUE(p.client.TryPushSubmit(5));
    Ring(p.client.request_doorbell());  // the same word through the other mapping
  });
  const Clock::time_point start = Clock::now();
  EXPECT_TRUE(WaitDoorbell(server_bell, seen, start + std::chrono::seconds(10)));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  ringer.join();
  EXPECT_EQ(p.server.TryPopSubmit(), 5u);
  // Already rung: returns at once.
  EXPECT_TRUE(WaitDoorbell(server_bell, seen, Clock::now()));
}

// A waiter spinning in WaitDoorbell (a server connection in its poll window
// spins for milliseconds) shares its CPU with a thread that has work: the
// other connection of a two-GPU worker, bound to the same PU for its region,
// or the one whose GPU request just arrived. Pause-only spinning kept the
// CPU for whole scheduler slices: 20 ms of work took ~40 ms there. The
// spinner now yields every kSpinYieldPeriod: the work takes about as long as
// alone.
namespace {
double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}
bool PinTo(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return pthread_setaffinity_np(pthread_self(), sizeof(s), &s) == 0;
}
// Wall seconds this thread takes for `cpu_s` seconds of CPU on `cpu`.
double WallForCpu(int cpu, double cpu_s) {
  cpu_set_t saved;
  pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved);
  EXPECT_TRUE(PinTo(cpu));
  std::this_thread::sleep_for(milliseconds(2));
  const double c0 = ThreadCpuSeconds();
  const Clock::time_point w0 = Clock::now();
  while (ThreadCpuSeconds() - c0 < cpu_s) {
  }
  const double wall = std::chrono::duration<double>(Clock::now() - w0).count();
  pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
  return wall;
}
}  // namespace

TEST(ShmDoorbell, SpinningWaiterGivesItsCpuToAThreadWithWork) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &allowed)) ++cpu;
  // Each side the best of 3: other tests running beside this one (ctest -j)
  // take the CPU now and then; a waiter that does not yield takes it always.
  const double alone = std::min({WallForCpu(cpu, 0.02), WallForCpu(cpu, 0.02), WallForCpu(cpu, 0.02)});
  std::atomic<uint32_t> word{0};
  std::atomic<bool> spinning{false};
  std::thread waiter([&] {
    ASSERT_TRUE(PinTo(cpu));
    spinning.store(true);
    // Spins through the whole wait, as a connection in its poll window does.
    EXPECT_TRUE(WaitDoorbell(word, 0, Clock::now() + std::chrono::seconds(20), std::chrono::seconds(20)));
  });
  while (!spinning.load()) std::this_thread::sleep_for(milliseconds(1));
  std::this_thread::sleep_for(milliseconds(20));
  const double shared = std::min({WallForCpu(cpu, 0.02), WallForCpu(cpu, 0.02), WallForCpu(cpu, 0.02)});
  Ring(word);
  waiter.join();
  EXPECT_LT(shared, 1.35 * alone + 0.002) << "20 ms of work took " << 1e3 * shared << " ms beside a spinning waiter ("
                                          << 1e3 * alone << " ms alone)";
}

// The sleeper-counted doorbells: a ringer skips FUTEX_WAKE when nobody
// sleeps, so a lost wake-up would leave a waiter stuck until its deadline.
// Thousands of ping-pongs between two threads that never spin (every wait
// goes to FUTEX_WAIT) must all complete promptly.
TEST(ShmDoorbell, SleeperCountedPingPongLosesNoWakeUp) {
  Pair p;
  constexpr int kRounds = 3000;
  std::atomic<int> slow{0};
  std::thread server([&] {
    for (int i = 0; i < kRounds; ++i) {
      std::optional<uint32_t> idx;
      while (!(idx = p.server.TryPopSubmit())) {
        const uint32_t seen = p.server.request_doorbell().load(std::memory_order_acquire);
        if ((idx = p.server.TryPopSubmit())) break;
        const Clock::time_point t0 = Clock::now();
        p.server.WaitRequest(seen, t0 + std::chrono::seconds(2), std::chrono::nanoseconds(0));
        if (Clock::now() - t0 > milliseconds(500)) ++slow;
      }
      ASSERT_TRUE(p.server.TryPushComplete(*idx));
      p.server.RingResponse();
    }
  });
  for (int i = 0; i < kRounds; ++i) {
    ASSERT_TRUE(p.client.TryPushSubmit(static_cast<uint32_t>(i % S)));
    p.client.RingRequest();
    std::optional<uint32_t> idx;
    while (!(idx = p.client.TryPopComplete())) {
      const uint32_t seen = p.client.response_doorbell().load(std::memory_order_acquire);
      if ((idx = p.client.TryPopComplete())) break;
      const Clock::time_point t0 = Clock::now();
      p.client.WaitResponse(seen, t0 + std::chrono::seconds(2), std::chrono::nanoseconds(0));
      if (Clock::now() - t0 > milliseconds(500)) ++slow;
    }
    EXPECT_EQ(*idx, static_cast<uint32_t>(i % S));
  }
  server.join();
  EXPECT_EQ(slow.load(), 0) << "waits that ran into their deadline: a lost wake-up";
  EXPECT_EQ(p.server.header()->request_sleepers.load(), 0u);
  EXPECT_EQ(p.client.header()->response_sleepers.load(), 0u);
}

TEST(ShmDoorbell, ClientPollDeadlineCrossesTheMapping) {
  Pair p;
  EXPECT_EQ(p.server.ClientPollUntil().time_since_epoch().count(), 0);  // off in a fresh segment
  const Clock::time_point until = Clock::now() + milliseconds(3);
  p.client.SetClientPollUntil(until);
  EXPECT_EQ(p.server.ClientPollUntil(), until);
  // A hostile value cannot overflow the server's arithmetic.
  p.client.header()->client_poll_until_ns.store(~uint64_t{0});
  EXPECT_GT(p.server.ClientPollUntil(), Clock::now());
  EXPECT_LT(p.server.ClientPollUntil(), Clock::time_point::max());
}

TEST(ShmDoorbell, TimesOut) {
  Pair p;
  const Clock::time_point start = Clock::now();
  EXPECT_FALSE(WaitDoorbell(p.server.request_doorbell(), p.server.request_doorbell().load(), start + milliseconds(30)));
  EXPECT_GE(Clock::now() - start, milliseconds(30));
  EXPECT_FALSE(WaitDoorbell(p.server.request_doorbell(), p.server.request_doorbell().load(), start));
}

TEST(ShmDoorbell, CloseWakesPeer) {
  Pair p;
  EXPECT_FALSE(p.server.PeerClosed(Side::kServer));
  const uint32_t seen = p.server.request_doorbell().load();
  std::thread leaver([&] {
    std::this_thread::sleep_for(milliseconds(10));
    p.client.MarkClosed(Side::kClient);
  });
  EXPECT_TRUE(WaitDoorbell(p.server.request_doorbell(), seen, Clock::now() + std::chrono::seconds(10)));
  leaver.join();
  EXPECT_TRUE(p.server.PeerClosed(Side::kServer));
  EXPECT_FALSE(p.client.PeerClosed(Side::kClient));
}

// The child is the client (GPU worker), the parent the server.
TEST(ShmSegment, TwoProcesses) {
  constexpr int kExperts = 16;
  constexpr uint32_t kSlot = 6, kN = 9, kK = 3;
  Memfd mem(Geometry(H, T, K, S).total_bytes);
  absl::StatusOr<Segment> server = Segment::Create(mem.Map(), mem.bytes(), H, T, K, S);
  ASSERT_TRUE(server.ok()) << server.status();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    void* m = mmap(nullptr, mem.bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, mem.fd(), 0);
    if (m == MAP_FAILED) _exit(10);
    absl::StatusOr<Segment> c = Segment::Attach(m, mem.bytes(), H);
    if (!c.ok()) _exit(11);
    const RequestSlot s = c->slot(kSlot);
    FillValidRequest(s, kN, kK, kExperts);
    if (!c->TryPushSubmit(kSlot)) _exit(12);
    Ring(c->request_doorbell());
    std::optional<uint32_t> done =
        PopOrWait([&] { return c->TryPopComplete(); }, c->response_doorbell(), Clock::now() + std::chrono::seconds(20));
    if (!done) _exit(13);
    ValidatedResponse resp;
    if (!ValidateResponseSlot(*c, *done, &resp).ok() || *done != kSlot) _exit(14);
    if (!resp.status.ok() || resp.request_id != 42) _exit(15);
    for (uint32_t i = 0; i < kN * H; ++i)
      if (Bf16ToF32(s.output[i]) != 2.0f * Bf16ToF32(s.tokens[i])) _exit(16);
    _exit(0);
  }
  std::optional<uint32_t> idx = PopOrWait([&] { return server->TryPopSubmit(); }, server->request_doorbell(),
                                          Clock::now() + std::chrono::seconds(20));
  bool served = false;
  if (idx) {
    ValidatedRequest req;
    const absl::Status st = ValidateRequestSlot(*server, *idx, kExperts, 1, &req);
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(*idx, kSlot);
    EXPECT_EQ(req.n_tokens, int{kN});
    EXPECT_EQ(req.k, int{kK});
    const RequestSlot s = server->slot(*idx);
    for (int i = 0; i < req.n_tokens * int{H}; ++i) s.output[i] = F32ToBf16(2.0f * Bf16ToF32(s.tokens[i]));
    WriteResponseStatus(s, absl::OkStatus());
    served = server->TryPushComplete(*idx);
    Ring(server->response_doorbell());
  }
  if (!served) kill(pid, SIGKILL);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(served);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
}

TEST(ShmAttach, RejectsBadHeaders) {
  Pair p;
  auto* h = p.server.header();
  auto expect_reject = [&](const char* what, size_t bytes = 0) {
    absl::StatusOr<Segment> s = Segment::Attach(p.client_map, bytes ? bytes : p.mem.bytes(), H);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(what), absl::string_view::npos) << s.status();
  };
  auto restore = [&] { ASSERT_TRUE(Segment::Create(p.server_map, p.mem.bytes(), H, T, K, S).ok()); };

  h->magic = 0x1234;
  expect_reject("bad magic");
  restore();
  h->version = kVersion + 1;
  expect_reject(absl::StrCat("version ", kVersion + 1).c_str());
  restore();
  {
    absl::StatusOr<Segment> s = Segment::Attach(p.client_map, p.mem.bytes(), H * 2);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("hidden 64"), absl::string_view::npos) << s.status();
  }
  h->slots_offset = p.mem.bytes() * 100;
  expect_reject("slots_offset");
  restore();
  h->submit_ring_offset = p.mem.bytes() - 8;
  expect_reject("submit_ring_offset");
  restore();
  h->slot_stride = 1ull << 40;
  expect_reject("slot_stride");
  restore();
  h->total_bytes = 64;
  expect_reject("total_bytes");
  restore();
  h->num_slots = 6;
  expect_reject("not a power of two");
  restore();
  h->num_slots = 16;  // a valid geometry, but larger than the mapping and the stored offsets
  expect_reject("disagrees");
  restore();
  h->hidden = 0;
  expect_reject("hidden: 0");
  restore();
  expect_reject("bytes mapped", p.mem.bytes() - 64);
  expect_reject("smaller than the", 100);
  EXPECT_FALSE(Segment::Attach(nullptr, p.mem.bytes(), H).ok());
  EXPECT_TRUE(Segment::Attach(p.client_map, p.mem.bytes(), H).ok());
}

TEST(ShmValidate, RequestSlot) {
  Pair p;
  constexpr int kExperts = 16, kLayers = 2;
  const RequestSlot s = p.client.slot(2);
  ValidatedRequest req;
  auto check = [&](const char* want) {
    const absl::Status st = ValidateRequestSlot(p.server, 2, kExperts, kLayers, &req);
    if (want == nullptr) {
      EXPECT_TRUE(st.ok()) << st;
      return;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_NE(st.message().find(want), absl::string_view::npos) << st;
    FillValidRequest(s, T, K, kExperts);
  };
  FillValidRequest(s, T, K, kExperts);
  check(nullptr);
  EXPECT_EQ(req.request_id, 42u);
  EXPECT_EQ(req.ids.size(), size_t{T} * K);
  s.ids[0] = 99;  // the validated copy is private
  EXPECT_EQ(req.ids[0], 0);
  FillValidRequest(s, T, K, kExperts);
  s.ids[5] = -1;  // unused pair
  check(nullptr);

  s.header->n_tokens = 9000;
  check("n_tokens: 9000 exceeds the slot's 16");
  s.header->n_tokens = 0;
  check("n_tokens: empty batch");
  s.header->k = 0;
  check("k: 0");
  s.header->k = K + 1;
  check("k: 5");
  s.header->layer = kLayers;
  check("layer: 2 out of range");
  s.ids[3 * K + 1] = kExperts;
  check("expert_ids[3,1]: expert 16 out of range");
  s.ids[1] = -7;
  check("expert_ids[0,1]");
  s.ids[2 * K + 2] = s.ids[2 * K];
  check("expert_ids[2,2]: expert 2 repeats expert_ids[2,0]");
  s.weights[4 * K + 3] = std::nanf("");
  check("expert_weights[4,3]: weight is not finite");
  // With k < K the pairs are packed [n,k]: a duplicate in row 1 is at 1*k.
  WriteRequestHeader(s, 1, 0, 3, 2);
  s.ids[2] = 5, s.ids[3] = 5;
  check("expert_ids[1,1]: expert 5 repeats");
  EXPECT_FALSE(ValidateRequestSlot(p.server, S, kExperts, kLayers, &req).ok());
  // Only hosted experts.
  FillValidRequest(s, T, K, kExperts);
  EXPECT_FALSE(ValidateRequestSlot(p.server, 2, kExperts, kLayers, &req, [](int e) { return e != 3; }).ok());
}

TEST(ShmValidate, ResponseSlotAndIndex) {
  Pair p;
  const RequestSlot s = p.server.slot(1);
  ValidatedResponse resp;
  WriteRequestHeader(s, 77, 0, 1, 1);
  WriteResponseStatus(s, absl::ResourceExhaustedError(std::string(500, 'x')));
  ASSERT_TRUE(ValidateResponseSlot(p.client, 1, &resp).ok());
  EXPECT_EQ(resp.request_id, 77u);
  EXPECT_EQ(resp.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(resp.status.message().size(), kMaxMessageLen);
  s.header->status_code = 17;
  EXPECT_FALSE(ValidateResponseSlot(p.client, 1, &resp).ok());
  s.header->status_code = -1;
  EXPECT_FALSE(ValidateResponseSlot(p.client, 1, &resp).ok());
  s.header->status_code = 0;
  s.header->message_len = kMaxMessageLen + 1;
  EXPECT_FALSE(ValidateResponseSlot(p.client, 1, &resp).ok());
  EXPECT_FALSE(ValidateResponseSlot(p.client, S, &resp).ok());
  EXPECT_TRUE(p.client.ValidateSlotIndex(S - 1).ok());
  EXPECT_FALSE(p.client.ValidateSlotIndex(S).ok());
  EXPECT_FALSE(p.client.ValidateSlotIndex(UINT32_MAX).ok());
}

// Random byte patches through the fuzz entry point, then random overwrites of
// a real segment's header, ring and slot headers: validators only return statuses.
TEST(ShmFuzz, RandomCorruptionOnlyYieldsStatuses) {
  std::mt19937_64 rng(12345);
  const Clock::time_point stop = Clock::now() + milliseconds(1000);
  int runs = 0;
  std::vector<uint8_t> data;
  while (Clock::now() < stop && runs < 200000) {
    data.resize(rng() % 64);
    for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
    ASSERT_EQ(ShmFuzzOne(data.data(), data.size()), 0);
    ++runs;
  }
  EXPECT_GT(runs, 100);

  Pair p;
  auto* base = static_cast<uint8_t*>(p.server_map);
  const SegmentGeometry& g = p.server.geometry();
  ValidatedRequest req;
  ValidatedResponse resp;
  int attach[2] = {0, 0}, request[2] = {0, 0};
  const Clock::time_point stop2 = Clock::now() + milliseconds(1000);
  for (int i = 0; Clock::now() < stop2 && i < 200000; ++i) {
    if (i % 64 == 0) {
      ASSERT_TRUE(Segment::Create(p.server_map, p.mem.bytes(), H, T, K, S).ok());
      for (uint32_t j = 0; j < S; ++j) FillValidRequest(p.server.slot(j), 1 + j, 1 + j % K, 16);
    }
    const uint64_t r = rng();
    const uint32_t slot = static_cast<uint32_t>(r >> 32) % S;
    switch (r % 4) {
      case 0: base[(r >> 8) % 128] = static_cast<uint8_t>(r >> 16); break;
      case 1: base[g.slots_offset + slot * g.slot_stride + (r >> 8) % 32] = static_cast<uint8_t>(r >> 16); break;
      case 2: std::memcpy(base + g.submit_ring_offset + (r >> 8) % (2 * g.ring_bytes - 4), &r, 4); break;
      default: p.client.TryPushSubmit(static_cast<uint32_t>(r >> 8) % (2 * S)); break;
    }
    absl::StatusOr<Segment> c = Segment::Attach(p.client_map, p.mem.bytes(), H);
    ++attach[c.ok()];
    if (c.ok()) {
      ASSERT_LE(c->geometry().total_bytes, p.mem.bytes());
    }
    if (std::optional<uint32_t> idx = p.server.TryPopSubmit()) {
      ASSERT_EQ(p.server.ValidateSlotIndex(*idx).ok(), *idx < S);
      const bool ok = ValidateRequestSlot(p.server, *idx, 16, 1, &req).ok();
      ++request[ok];
      if (ok) {
        ASSERT_GE(req.n_tokens, 1);
        ASSERT_LE(req.n_tokens, int{T});
        ASSERT_EQ(req.ids.size(), size_t(req.n_tokens) * req.k);
      }
      (void)ValidateResponseSlot(p.server, *idx, &resp);
    }
  }
  // Both outcomes were exercised.
  EXPECT_GT(attach[0], 0);
  EXPECT_GT(attach[1], 0);
  EXPECT_GT(request[0], 0);
  EXPECT_GT(request[1], 0);
}


// The control socket's Receive: a bounded wait times out naming the bytes it
// got; a negative timeout waits as long as the data takes (the raw-socket
// floor of bench/transport uses it); a closed peer ends either wait.
TEST(UnixSocket, ReceiveTimeoutsAndUnboundedWait) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  char buf[8] = {};
  absl::Status st = unix_socket::Receive(sv[0], buf, sizeof(buf), nullptr, 30);
  EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    ASSERT_TRUE(unix_socket::Send(sv[1], "abcd", 4).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(80));
    ASSERT_TRUE(unix_socket::Send(sv[1], "efgh", 4).ok());
  });
  st = unix_socket::Receive(sv[0], buf, sizeof(buf), nullptr, -1);
  late.join();
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(std::string(buf, 8), "abcdefgh");
  close(sv[1]);
  st = unix_socket::Receive(sv[0], buf, sizeof(buf), nullptr, -1);
  EXPECT_TRUE(absl::IsUnavailable(st)) << st;
  close(sv[0]);
}

}  // namespace
}  // namespace moe::shm
