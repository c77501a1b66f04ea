#include "gpu_worker/host_expert_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "transport/shm_server.h"
#include "expert_compute/compute_pool.h"
#include "expert_compute/expert_store.h"
#include "expert_compute/numa_binding.h"

namespace moe {

namespace {

absl::Status IndexLayers(const ModelSpec& spec, const std::vector<int>& layers, std::vector<int>* index) {
  index->assign(spec.num_layers, -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    const int l = layers[i];
    if (l < 0 || l >= spec.num_layers || !spec.IsMoeLayer(l))
      return absl::InvalidArgumentError(absl::StrCat("layers: ", l, " is not an MoE layer of the model"));
    (*index)[l] = static_cast<int>(i);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HostExpertStore::Register(void* p, size_t bytes, bool read_only) {
  if (backend_ == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(backend_->RegisterHost(p, bytes, read_only));
  registered_.push_back(p);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostExpertStore>> HostExpertStore::Load(const ModelSource& source,
                                                                       const std::vector<int>& layers,
                                                                       const ExpertGeometry& geometry,
                                                                       DeviceBackend* backend, int threads) {
  const ModelSpec& spec = source.spec();
  auto store = std::unique_ptr<HostExpertStore>(new HostExpertStore());
  store->backend_ = backend;
  store->geometry_ = geometry;
  store->num_experts_ = spec.num_experts;
  MOE_RETURN_IF_ERROR(IndexLayers(spec, layers, &store->layer_index_));
  HostedSet hosted;
  hosted.layers = layers;
  std::sort(hosted.layers.begin(), hosted.layers.end());
  hosted.layers.erase(std::unique(hosted.layers.begin(), hosted.layers.end()), hosted.layers.end());
  for (int e = 0; e < spec.num_experts; ++e) hosted.experts.push_back(e);
  // Packed in parallel on a pool of this process's cores (the servers' packer).
  MOE_ASSIGN_OR_RETURN(store->binding_, NumaBinding::Create("auto", std::max(threads, 0)));
  {
    ComputePool pool(*store->binding_, std::chrono::microseconds(0));
    absl::StatusOr<std::unique_ptr<ExpertStore>> own =
        ExpertStore::Load(source, geometry, std::move(hosted), *store->binding_, pool);
    if (!own.ok())
      return absl::Status(own.status().code(), absl::StrCat("host expert store: ", own.status().message()));
    store->own_ = *std::move(own);
  }
  store->table_.assign(layers.size() * spec.num_experts, nullptr);
  for (size_t i = 0; i < layers.size(); ++i)
    for (int e = 0; e < spec.num_experts; ++e) store->table_[i * spec.num_experts + e] = store->own_->Find(layers[i], e);
  if (store->own_->resident_bytes() > 0)
    MOE_RETURN_IF_ERROR(store->Register(store->own_->data(), store->own_->resident_bytes(), /*read_only=*/false));
  return store;
}

absl::StatusOr<std::unique_ptr<HostExpertStore>> HostExpertStore::Attach(const ModelSpec& spec,
                                                                         const ModelIdentity& model,
                                                                         const std::vector<int>& layers,
                                                                         const std::vector<std::string>& unix_sockets,
                                                                         DeviceBackend* backend,
                                                                         std::chrono::milliseconds timeout) {
  auto store = std::unique_ptr<HostExpertStore>(new HostExpertStore());
  store->backend_ = backend;
  store->num_experts_ = spec.num_experts;
  MOE_RETURN_IF_ERROR(IndexLayers(spec, layers, &store->layer_index_));
  if (unix_sockets.empty()) return absl::FailedPreconditionError("no same-host (unix://) expert server");
  store->table_.assign(layers.size() * spec.num_experts, nullptr);
  for (size_t s = 0; s < unix_sockets.size(); ++s) {
    const std::string& path = unix_sockets[s];
    MOE_ASSIGN_OR_RETURN(SharedStoreFd fd, FetchSharedStore(path, spec.hidden, model, timeout));
    absl::StatusOr<SharedStoreInfo> info = ParseSharedStoreInfo(fd.info, spec, fd.bytes);
    if (!info.ok()) {
      close(fd.fd);
      return absl::Status(info.status().code(), absl::StrCat("expert server on ", path, ": ", info.status().message()));
    }
    if (s == 0) store->geometry_ = info->geometry;
    const ExpertGeometry& g = store->geometry_;
    if (info->geometry.format != g.format || info->geometry.group != g.group) {
      close(fd.fd);
      return absl::FailedPreconditionError(absl::StrCat("expert server on ", path, " stores ",
                                                        WeightFormatName(info->geometry.format), ", ", unix_sockets[0],
                                                        " stores ", WeightFormatName(g.format)));
    }
    void* base = fd.bytes == 0 ? MAP_FAILED : mmap(nullptr, fd.bytes, PROT_READ, MAP_SHARED, fd.fd, 0);
    close(fd.fd);
    if (base == MAP_FAILED)
      return absl::ResourceExhaustedError(absl::StrCat("mapping the store of ", path, ": ", std::strerror(errno)));
    store->mappings_.push_back({base, fd.bytes});
    MOE_RETURN_IF_ERROR(store->Register(base, fd.bytes, /*read_only=*/true));
    for (size_t i = 0; i < layers.size(); ++i)
      for (int e = 0; e < spec.num_experts; ++e) {
        const int64_t off = info->Offset(layers[i], e);
        const std::byte*& slot = store->table_[i * spec.num_experts + e];
        if (off >= 0 && slot == nullptr) slot = static_cast<const std::byte*>(base) + off;
      }
  }
  for (size_t i = 0; i < layers.size(); ++i)
    for (int e = 0; e < spec.num_experts; ++e)
      if (store->table_[i * spec.num_experts + e] == nullptr)
        return absl::FailedPreconditionError(
            absl::StrCat("no same-host server shares expert ", e, " of layer ", layers[i]));
  return store;
}

absl::StatusOr<std::unique_ptr<HostExpertStore>> HostExpertStore::Open(const ModelSource& source,
                                                                       const ModelIdentity& model,
                                                                       const std::vector<int>& layers,
                                                                       const std::vector<std::string>& unix_sockets,
                                                                       const std::string& weight_dtype, bool share,
                                                                       DeviceBackend* backend) {
  MOE_ASSIGN_OR_RETURN(const ExpertGeometry own_geometry, StorageGeometry(source.spec(), weight_dtype));
  if (share && !unix_sockets.empty()) {
    absl::StatusOr<std::unique_ptr<HostExpertStore>> shared =
        Attach(source.spec(), model, layers, unix_sockets, backend, std::chrono::milliseconds(5000));
    if (shared.ok() && weight_dtype != "auto" && (*shared)->geometry_.format != own_geometry.format)
      shared = absl::FailedPreconditionError(absl::StrCat("the servers store ", WeightFormatName((*shared)->geometry_.format),
                                                          ", --weight-dtype asks for ", weight_dtype));
    if (shared.ok()) {
      LogInfo("worker", "host copy: shared with the same-host servers (", WeightFormatName((*shared)->geometry_.format),
              ", ", (*shared)->mappings_.size(), " stores mapped read-only); no copy of its own");
      return shared;
    }
    LogInfo("worker", "host copy: not shared (", shared.status().message(), "); packing its own");
  }
  MOE_ASSIGN_OR_RETURN(std::unique_ptr<HostExpertStore> own, Load(source, layers, own_geometry, backend));
  LogInfo("worker", "host copy: its own, ", own->bytes(), " bytes (", WeightFormatName(own_geometry.format), ")");
  return own;
}

HostExpertStore::~HostExpertStore() {
  if (backend_ != nullptr)
    for (void* p : registered_) backend_->UnregisterHost(p);
  for (const Mapping& m : mappings_) munmap(m.base, m.bytes);
}

uint64_t HostExpertStore::bytes() const { return own_ ? own_->resident_bytes() : 0; }

const std::byte* HostExpertStore::Find(int layer, int expert) const {
  if (layer < 0 || layer >= static_cast<int>(layer_index_.size()) || layer_index_[layer] < 0 || expert < 0 ||
      expert >= num_experts_)
    return nullptr;
  return table_[static_cast<size_t>(layer_index_[layer]) * num_experts_ + expert];
}

}  // namespace moe
