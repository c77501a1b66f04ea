// A layer call's tensors in GPU memory, for tests of device-pointer calls
// (cuda builds): hidden, routing and weights uploaded, the output allocated
// and read back. Freed on destruction.
#pragma once

#ifdef MOE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "core/bf16.h"

namespace moe::testing {

class DeviceCall {
 public:
  DeviceCall(const std::vector<bf16_t>& x, const std::vector<int32_t>& ids, const std::vector<float>& w)
      : n_out_(x.size()) {
    ok_ = Upload(&x_, x.data(), x.size() * sizeof(bf16_t)) && Upload(&ids_, ids.data(), ids.size() * sizeof(int32_t)) &&
          Upload(&w_, w.data(), w.size() * sizeof(float)) && cudaMalloc(&out_, x.size() * sizeof(bf16_t)) == cudaSuccess;
  }
  ~DeviceCall() {
    for (void* p : {x_, ids_, w_, out_}) cudaFree(p);
  }
  DeviceCall(const DeviceCall&) = delete;
  DeviceCall& operator=(const DeviceCall&) = delete;

  bool ok() const { return ok_; }
  const bf16_t* x() const { return static_cast<const bf16_t*>(x_); }
  const int32_t* ids() const { return static_cast<const int32_t*>(ids_); }
  const float* weights() const { return static_cast<const float*>(w_); }
  bf16_t* out() const { return static_cast<bf16_t*>(out_); }
  // The output, copied to the host.
  std::vector<bf16_t> Output() const {
    std::vector<bf16_t> o(n_out_);
    cudaMemcpy(o.data(), out_, o.size() * sizeof(bf16_t), cudaMemcpyDeviceToHost);
    return o;
  }

 private:
  static bool Upload(void** dst, const void* src, size_t bytes) {
    return cudaMalloc(dst, bytes) == cudaSuccess && cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  size_t n_out_;
  void *x_ = nullptr, *ids_ = nullptr, *w_ = nullptr, *out_ = nullptr;
  bool ok_ = false;
};

}  // namespace moe::testing
#endif  // MOE_HAVE_CUDA
