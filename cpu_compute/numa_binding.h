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
  // node index. threads: 0 = one per core of the node, else that many
  // (one per core first, then hyperthreads). Errors name the flag.
  static absl::StatusOr<std::unique_ptr<NumaBinding>> Create(const std::string& node, int threads);
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

// Bytes the kernel says can still be allocated (MemAvailable), 0 if unknown.
uint64_t AvailableMemoryBytes();

}  // namespace moe
