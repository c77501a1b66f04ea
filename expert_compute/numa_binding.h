// NumaBinding: the NUMA node this process computes on, the cores its compute
// threads are pinned to, and memory bound to that node — from hwloc.
// Create() once at start; afterwards all methods are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe {

class NumaBinding {
 public:
  // node: "auto" (the node of the first CPU this process may run on) or a
  // node index. threads: 0 = ChooseDefaultThreads (same_host_engine says
  // whether an engine shares this host), else that many (one per core first,
  // then hyperthreads). share_index / share_count: this process is one of
  // share_count servers that split the machine (slices of one model,
  // --slice): with "auto" and at least share_count NUMA nodes it takes node
  // share_index; otherwise the node's cores are split into disjoint shares —
  // the default thread count's cores (or `threads` cores each) — and it takes
  // share share_index, so the servers together use what one would. Errors
  // name the flag; `threads_name` is how the caller's users name `threads`
  // (the worker's cpu backend: cpu_threads).
  static absl::StatusOr<std::unique_ptr<NumaBinding>> Create(const std::string& node, int threads,
                                                             bool same_host_engine = false, int share_index = 0,
                                                             int share_count = 1,
                                                             const std::string& threads_name = "--threads");
  ~NumaBinding();

  int node() const { return node_; }        // logical index; -1 if hwloc sees no NUMA node
  int num_nodes() const { return num_nodes_; }
  const std::vector<int>& cpus() const { return cpus_; }  // OS PU index per compute thread
  uint64_t node_memory_bytes() const { return node_memory_; }
  // Multi-line summary: machine, nodes, cores, the PUs used.
  std::string Describe() const;

  // Pins the calling thread to cpus()[i].
  absl::Status BindCurrentThread(int i) const;
  // Memory bound to the node (transparent huge pages requested); 64-byte aligned.
  // Falls back to plain anonymous memory where binding is not supported.
  void* Allocate(size_t bytes) const;
  void Free(void* p, size_t bytes) const;
  // The same in a memfd (sealable, mapped shared), so the memory can be
  // handed to another process (SCM_RIGHTS). *fd is the caller's to close
  // after Free. nullptr (errno set) on failure.
  void* AllocateShared(size_t bytes, int* fd) const;

 private:
  NumaBinding() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int node_ = -1;
  int num_nodes_ = 0;
  std::vector<int> cpus_;
  uint64_t node_memory_ = 0;
};

// The compute threads of a process started without a thread count, and why.
struct ThreadDefault {
  int threads = 1;
  std::string why;  // one phrase, for the start-up log and --help's promise
};
// cores: the chosen node's cores this process may run on. whole_machine: its
// affinity (taskset, cgroup cpuset) allows every CPU of the machine, so no
// one set cores aside for other processes. same_host_engine: an engine and
// its GPU worker run on this host beside us (the server serves shared
// memory). cpu_quota: the cgroup's CPU limit in CPUs (0: none). One thread
// per core, less max(2, cores / 16) cores left to the engine's launch thread
// and the worker's completion thread when they share this machine's cores
// (measured through transformers on a 16-core host: all 16 cores ran decode
// 2.5x slower than 14), capped by the quota; at least 1. Pure.
ThreadDefault ChooseDefaultThreads(int cores, bool whole_machine, bool same_host_engine, double cpu_quota);
// This process's cgroup CPU limit in CPUs (cgroup v2 cpu.max along its path,
// the tightest; else v1 cpu.cfs_quota_us / cpu.cfs_period_us), 0 if none.
double CgroupCpuQuota();

// Bytes the kernel says can still be allocated (MemAvailable), 0 if unknown.
uint64_t AvailableMemoryBytes();

}  // namespace moe
