#include "gpu_worker/device_backend.h"

namespace moe {

#ifndef MOE_HAVE_CUDA
// Built without nvcc: the cuda backend does not exist in this binary.
std::unique_ptr<DeviceBackend> MakeCudaBackend(std::string* why) {
  *why = "this build has no CUDA support (nvcc was not found at configure time)";
  return nullptr;
}
bool CudaAvailable() { return false; }
#endif

absl::StatusOr<std::unique_ptr<DeviceBackend>> MakeDeviceBackend(const std::string& name) {
  if (name == "cpu") return MakeHostMemoryBackend();
  if (name == "cuda" || name == "auto") {
    std::string why;
    if (std::unique_ptr<DeviceBackend> b = MakeCudaBackend(&why)) return b;
    if (name == "auto") return MakeHostMemoryBackend();
    return absl::FailedPreconditionError("device: cuda backend unavailable: " + why);
  }
  return absl::InvalidArgumentError("device: unknown backend '" + name + "' (auto, cuda or cpu)");
}

}  // namespace moe
