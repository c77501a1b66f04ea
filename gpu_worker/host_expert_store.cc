#include "gpu_worker/host_expert_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "cpu_compute/numa_binding.h"

namespace moe {

absl::StatusOr<std::unique_ptr<HostExpertStore>> HostExpertStore::Load(const ModelSource& source,
                                                                       const std::vector<int>& layers,
                                                                       DeviceBackend* backend,
                                                                       int threads) {
  const ModelSpec& spec = source.spec();
  auto store = std::unique_ptr<HostExpertStore>(new HostExpertStore());
  store->num_experts_ = spec.num_experts;
  store->expert_elems_ = 3ull * spec.hidden * spec.intermediate;
  store->layer_index_.assign(spec.num_layers, -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int l = layers[i];
    if (l < 0 || l >= spec.num_layers || !spec.IsMoeLayer(l))
      return absl::InvalidArgumentError(absl::StrCat("layers: ", l, " is not an MoE layer of the model"));
    store->layer_index_[l] = static_cast<int>(i);
  }
  const uint64_t count = layers.size() * static_cast<uint64_t>(spec.num_experts);
  store->bytes_ = std::max<uint64_t>(count * store->expert_elems_ * sizeof(bf16_t), 4096);
  const uint64_t avail = AvailableMemoryBytes();
  if (avail != 0 && store->bytes_ > avail)
    return absl::ResourceExhaustedError(
        absl::StrCat("host expert store: needs ", store->bytes_, " bytes for ", layers.size(),
                     " layers x ", spec.num_experts, " experts, ", avail, " available"));
  void* p = mmap(nullptr, store->bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return absl::ResourceExhaustedError(absl::StrCat("host expert store: mmap of ", store->bytes_,
                                                     " bytes failed: ", std::strerror(errno)));
  madvise(p, store->bytes_, MADV_HUGEPAGE);
  store->base_ = static_cast<bf16_t*>(p);

  // Read in parallel: experts are independent.
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  absl::Status first_error;
  auto work = [&] {
    ExpertWeights w;
    for (uint64_t i = next++; i < count; i = next++) {
      const int layer = layers[i / spec.num_experts];
      const int expert = static_cast<int>(i % spec.num_experts);
      absl::Status st = source.ReadExpert(layer, expert, &w);
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = st;
        next = count;
        return;
      }
      bf16_t* dst = store->base_ + i * store->expert_elems_;
      const size_t ih = store->expert_elems_ / 3;
      std::memcpy(dst, w.gate.data(), ih * sizeof(bf16_t));
      std::memcpy(dst + ih, w.up.data(), ih * sizeof(bf16_t));
      std::memcpy(dst + 2 * ih, w.down.data(), ih * sizeof(bf16_t));
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && static_cast<uint64_t>(t) < count; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (!first_error.ok()) return first_error;
  if (backend != nullptr) {
    MOE_RETURN_IF_ERROR(backend->RegisterHost(store->base_, store->bytes_));
    store->backend_ = backend;
  }
  return store;
}

HostExpertStore::~HostExpertStore() {
  if (base_ == nullptr) return;
  if (backend_ != nullptr) backend_->UnregisterHost(base_);
  munmap(base_, bytes_);
}

const bf16_t* HostExpertStore::Find(int layer, int expert) const {
  if (layer < 0 || layer >= static_cast<int>(layer_index_.size()) || layer_index_[layer] < 0 ||
      expert < 0 || expert >= num_experts_)
    return nullptr;
  return base_ + (static_cast<size_t>(layer_index_[layer]) * num_experts_ + expert) * expert_elems_;
}

}  // namespace moe
