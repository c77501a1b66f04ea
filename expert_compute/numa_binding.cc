#include "expert_compute/numa_binding.h"

#include <hwloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/log.h"

namespace moe {

struct NumaBinding::Impl {
  hwloc_topology_t topo = nullptr;
  hwloc_nodeset_t nodeset = nullptr;
  bool membind_ok = true;
  std::string describe;
  ~Impl() {
    if (nodeset) hwloc_bitmap_free(nodeset);
    if (topo) hwloc_topology_destroy(topo);
  }
};

uint64_t AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

ThreadDefault ChooseDefaultThreads(int cores, bool whole_machine, bool same_host_engine, double cpu_quota) {
  ThreadDefault d;
  d.threads = std::max(cores, 1);
  d.why = absl::StrCat("one per core of the node (", cores, ")");
  if (same_host_engine && whole_machine) {
    const int leave = std::max(2, cores / 16);
    d.threads = std::max(1, cores - leave);
    d.why = absl::StrCat(cores, " cores of the node less ", cores - d.threads,
                         " left to the engine and GPU worker on this host (no CPU affinity set aside cores for them)");
  }
  if (cpu_quota > 0 && cpu_quota < d.threads) {
    d.threads = std::max(1, static_cast<int>(cpu_quota));
    d.why = absl::StrCat("the cgroup's CPU quota (", cpu_quota, " CPUs)");
  }
  return d;
}

namespace {

// "max 100000" / "QUOTA PERIOD" -> CPUs (0: unlimited or unreadable).
double ReadCpuMax(const std::string& path) {
  std::ifstream in(path);
  std::string quota;
  double period = 0;
  if (!(in >> quota >> period) || quota == "max" || period <= 0) return 0;
  double q = 0;
  if (!absl::SimpleAtod(quota, &q) || q <= 0) return 0;
  return q / period;
}

}  // namespace

double CgroupCpuQuota() {
  std::ifstream self("/proc/self/cgroup");
  std::string line;
  double tightest = 0;
  while (std::getline(self, line)) {
    if (line.rfind("0::", 0) != 0) continue;  // the v2 hierarchy
    std::string path = line.substr(3);
    while (true) {
      const double q = ReadCpuMax(absl::StrCat("/sys/fs/cgroup", path == "/" ? "" : path, "/cpu.max"));
      if (q > 0 && (tightest == 0 || q < tightest)) tightest = q;
      if (path.empty() || path == "/") break;
      const size_t slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
    return tightest;
  }
  std::ifstream q("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), p("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  double quota = 0, period = 0;
  if (q >> quota && p >> period && quota > 0 && period > 0) return quota / period;
  return 0;
}

namespace {

// "topology: 1 package(s), 1 NUMA node(s), 16 cores, 32 PUs (MODEL); total memory N MiB".
std::string TopologySummary(hwloc_topology_t topo) {
  hwloc_obj_t root = hwloc_get_root_obj(topo);
  const char* model = hwloc_obj_get_info_by_name(hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, 0), "CPUModel");
  return absl::StrCat("topology: ", hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE), " package(s), ",
                      hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE), " NUMA node(s), ",
                      hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE), " cores, ",
                      hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU), " PUs",
                      model ? absl::StrCat(" (", model, ")") : "", "; total memory ", root->total_memory >> 20, " MiB");
}

// The PUs of `usable`: one per core first, then the remaining hyperthreads;
// *cores: how many are first PUs of a core.
std::vector<int> PusByCore(hwloc_topology_t topo, hwloc_const_cpuset_t usable, int* cores) {
  std::vector<int> first_pus, sibling_pus;
  const int ncores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, usable, HWLOC_OBJ_CORE);
  for (int c = 0; c < ncores; ++c) {
    hwloc_obj_t core = hwloc_get_obj_inside_cpuset_by_type(topo, usable, HWLOC_OBJ_CORE, c);
    bool first = true;
    for (int pu = hwloc_bitmap_first(core->cpuset); pu >= 0; pu = hwloc_bitmap_next(core->cpuset, pu)) {
      if (!hwloc_bitmap_isset(usable, pu)) continue;
      (first ? first_pus : sibling_pus).push_back(pu);
      first = false;
    }
  }
  if (first_pus.empty()) {  // no core objects: use PUs as they come
    for (int pu = hwloc_bitmap_first(usable); pu >= 0; pu = hwloc_bitmap_next(usable, pu)) first_pus.push_back(pu);
  }
  *cores = static_cast<int>(first_pus.size());
  first_pus.insert(first_pus.end(), sibling_pus.begin(), sibling_pus.end());
  return first_pus;
}

// The PUs of one of share_count servers sharing a node's `all` PUs (one per
// core first): `threads` of them — with explicit threads, PUs [index *
// threads, +threads) (overlapping another share when the node is too small:
// said in *why); else its part of the default's `threads` — or all of
// `threads` when each share has a node of its own.
std::vector<int> ShareOfPus(const std::vector<int>& all, int threads, bool explicit_threads, int share_index,
                            int share_count, bool node_per_share, std::string* why) {
  int n = threads, lo = 0;
  if (share_count > 1 && !node_per_share) {  // disjoint cores of one node
    const int usable = static_cast<int>(all.size());
    std::string overlap;
    if (explicit_threads) {
      lo = share_index * threads;
      if (lo + threads > usable) {  // too few cores for disjoint shares
        lo = std::min(lo % usable, usable - threads);
        overlap = "; too few cores: overlapping another share";
      }
    } else {
      lo = share_index * threads / share_count;
      n = std::max(1, (share_index + 1) * threads / share_count - lo);
      lo = std::min(lo, usable - n);
    }
    *why = absl::StrCat("; share ", share_index, " of ", share_count, " of the node's cores", overlap);
  } else if (node_per_share) {
    *why = absl::StrCat("; share ", share_index, " of ", share_count, ": one NUMA node each");
  }
  return std::vector<int>(all.begin() + lo, all.begin() + lo + n);
}

}  // namespace

absl::StatusOr<std::unique_ptr<NumaBinding>> NumaBinding::Create(const std::string& node_flag, int threads,
                                                                  bool same_host_engine, int share_index,
                                                                  int share_count, const std::string& threads_name) {
  if (share_count < 1 || share_index < 0 || share_index >= share_count)
    return absl::InvalidArgumentError(absl::StrCat("--slice: share ", share_index, " of ", share_count));
  std::unique_ptr<NumaBinding> b(new NumaBinding());
  b->impl_ = std::make_unique<Impl>();
  Impl& im = *b->impl_;
  if (hwloc_topology_init(&im.topo) != 0 || hwloc_topology_load(im.topo) != 0)
    return absl::InternalError("hwloc: cannot load the machine topology");
  hwloc_topology_t topo = im.topo;
  const int nnodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  b->num_nodes_ = nnodes;

  // The CPUs this process may use (cgroups / taskset).
  hwloc_cpuset_t allowed = hwloc_bitmap_alloc();
  if (hwloc_get_cpubind(topo, allowed, HWLOC_CPUBIND_PROCESS) != 0 || hwloc_bitmap_iszero(allowed))
    hwloc_bitmap_copy(allowed, hwloc_topology_get_allowed_cpuset(topo));
  // Against the kernel's count of online CPUs: inside a cpuset cgroup hwloc's
  // own topology shows only the allowed CPUs.
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  const bool whole_machine = online <= 0 || hwloc_bitmap_weight(allowed) >= online;

  hwloc_obj_t node = nullptr;
  // Nodes own CPUs this process may run on, in order (a share's candidates).
  std::vector<hwloc_obj_t> usable_nodes;
  for (int i = 0; i < nnodes; ++i) {
    hwloc_obj_t n = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i);
    if (n->cpuset && hwloc_bitmap_intersects(n->cpuset, allowed)) usable_nodes.push_back(n);
  }
  const bool node_per_share = node_flag == "auto" && share_count > 1 &&
                              static_cast<int>(usable_nodes.size()) >= share_count;
  if (node_per_share) {
    node = usable_nodes[share_index];
  } else if (node_flag == "auto") {
    const int first = hwloc_bitmap_first(allowed);
    for (int i = 0; i < nnodes; ++i) {
      hwloc_obj_t n = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i);
      if (n->cpuset && hwloc_bitmap_isset(n->cpuset, first)) { node = n; break; }
    }
  } else {
    int idx;
    if (!absl::SimpleAtoi(node_flag, &idx) || idx < 0 || idx >= nnodes) {
      hwloc_bitmap_free(allowed);
      return absl::InvalidArgumentError(absl::StrCat("--numa-node: '", node_flag,
                                                     "' is not auto or a node in [0, ", nnodes, ")"));
    }
    node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, idx);
  }
  hwloc_cpuset_t usable = hwloc_bitmap_dup(allowed);
  im.nodeset = hwloc_bitmap_alloc();
  if (node != nullptr) {
    b->node_ = static_cast<int>(node->logical_index);
    b->node_memory_ = node->attr ? node->attr->numanode.local_memory : 0;
    hwloc_bitmap_and(usable, usable, node->cpuset);
    hwloc_bitmap_copy(im.nodeset, node->nodeset);
  }
  hwloc_bitmap_free(allowed);
  if (hwloc_bitmap_iszero(usable)) {
    hwloc_bitmap_free(usable);
    return absl::InvalidArgumentError(absl::StrCat("--numa-node: node ", node_flag,
                                                   " has no CPU this process may run on"));
  }
  int cores = 0;
  const std::vector<int> all = PusByCore(topo, usable, &cores);
  hwloc_bitmap_free(usable);
  if (threads < 0 || threads > static_cast<int>(all.size()))
    return absl::InvalidArgumentError(absl::StrCat(threads_name, ": ", threads, " exceeds the ", all.size(),
                                                   " CPUs usable on the chosen node"));
  const ThreadDefault chosen =
      threads == 0 ? ChooseDefaultThreads(cores, whole_machine, same_host_engine,
                                          CgroupCpuQuota())
                   : ThreadDefault{threads, threads_name};
  std::string share_why;
  b->cpus_ = ShareOfPus(all, chosen.threads, threads > 0, share_index, share_count, node_per_share, &share_why);
  const int n = static_cast<int>(b->cpus_.size());

  im.describe = absl::StrCat(TopologySummary(topo), "; using node ", b->node_, " (", b->node_memory_ >> 20, " MiB), ",
                             n, " compute threads (", chosen.why, share_why, ") on PUs [",
                             absl::StrJoin(b->cpus_, ","), "]");
  return b;
}

NumaBinding::~NumaBinding() = default;

std::string NumaBinding::Describe() const { return impl_->describe; }

absl::Status NumaBinding::BindCurrentThread(int i) const {
  hwloc_cpuset_t set = hwloc_bitmap_alloc();
  hwloc_bitmap_only(set, cpus_.at(i));
  const int rc = hwloc_set_cpubind(impl_->topo, set, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free(set);
  if (rc != 0) return absl::InternalError(absl::StrCat("cannot pin thread to PU ", cpus_[i], ": ", std::strerror(errno)));
  return absl::OkStatus();
}

void* NumaBinding::Allocate(size_t bytes) const {
  if (bytes == 0) bytes = 64;
  void* p = nullptr;
  if (node_ >= 0 && num_nodes_ > 1 && impl_->membind_ok) {
    p = hwloc_alloc_membind(impl_->topo, bytes, impl_->nodeset, HWLOC_MEMBIND_BIND,
                            HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_NOCPUBIND);
    if (p == nullptr) {
      LogWarning("numa", "memory binding to node ", node_, " failed (", std::strerror(errno),
                 "); falling back to first-touch placement by the pinned threads");
      impl_->membind_ok = false;
    }
  }
  if (p == nullptr) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
  }
  madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

void* NumaBinding::AllocateShared(size_t bytes, int* fd) const {
  if (bytes == 0) bytes = 64;
  *fd = memfd_create("moe-expert-store", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*fd < 0) return nullptr;
  void* p = MAP_FAILED;
  if (ftruncate(*fd, static_cast<off_t>(bytes)) == 0)
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(*fd);
    *fd = -1;
    errno = err;
    return nullptr;
  }
  // Shared memory takes the mapping's policy for the pages it allocates.
  if (node_ >= 0 && num_nodes_ > 1 && impl_->membind_ok &&
      hwloc_set_area_membind(impl_->topo, p, bytes, impl_->nodeset, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0)
    LogWarning("numa", "binding the shared expert store to node ", node_, " failed (", std::strerror(errno),
               "); first-touch placement by the pinned threads");
  madvise(p, bytes, MADV_HUGEPAGE);  // honoured where shmem huge pages are enabled
  return p;
}

void NumaBinding::Free(void* p, size_t bytes) const {
  if (p == nullptr) return;
  if (bytes == 0) bytes = 64;
  munmap(p, bytes);  // hwloc_alloc_membind also maps with mmap
}

}  // namespace moe
