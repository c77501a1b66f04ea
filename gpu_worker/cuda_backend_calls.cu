// CudaBackend (gpu_worker/cuda/cuda_backend_impl.h; design: cuda_backend.cu):
// the host path's calls — BeginCall, RoutingToHost, GatherRows, AddRows,
// RunExperts (grouped launches and cuBLAS groups), FinishCall — and the
// engine-stream handshakes (WaitStream, SignalStream, SynchronizeDevice).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "gpu_worker/cuda/cuda_backend_impl.h"

namespace moe {
namespace cuda_backend_impl {

absl::Status CudaBackend::BeginCall(int ctx, int T, const bf16_t* hidden, MemoryKind kind) {
  MOE_RETURN_IF_ERROR(Use());
  if (ctx < 0 || ctx >= static_cast<int>(contexts_.size()))
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: context ", ctx, " of ",
                                                   contexts_.size()));
  if (T < 0 || T > std::max(config_.max_tokens, 0) || (T > 0 && hidden == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda backend: BeginCall with ", T,
                                                   " tokens (max_tokens ", config_.max_tokens,
                                                   hidden == nullptr ? ", null input" : "", ")"));
  }
  MOE_RETURN_IF_ERROR(TakeDeferred());
  Context& c = contexts_[ctx];
  MOE_RETURN_IF_ERROR(ResetStage(c));
  c.active = false;
  if (T > 0) {
    const size_t n = static_cast<size_t>(T) * H_;
    if (kind == MemoryKind::kHost) {  // not behind queued expert copies when the caller's memory is registered
      const size_t bytes = n * sizeof(bf16_t);
      MOE_RETURN_IF_ERROR(UploadFromHost(c.x.get(), hidden, bytes, compute_, MappedRange(hidden, bytes)));
    } else {
      MOE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(c.x.get(), hidden, n * sizeof(bf16_t), cudaMemcpyDeviceToDevice, compute_));
    }
    MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(c.accum.get(), 0, n * sizeof(float), compute_));
  }
  c.T = T;
  c.active = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::RoutingToHost(const int32_t* ids, const float* weights, int n,
                                        int32_t* host_ids, float* host_weights) {
  MOE_RETURN_IF_ERROR(Use());
  if (n < 0) return absl::InvalidArgumentError("cuda backend: RoutingToHost of negative size");
  if (n == 0) return absl::OkStatus();
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_ids, ids, static_cast<size_t>(n) * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_weights, weights,
                                           static_cast<size_t>(n) * sizeof(float),
                                           cudaMemcpyDeviceToHost, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CudaBackend::GatherRows(int ctx, const int32_t* rows, int n,
                                                 bf16_t* dst) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  MOE_RETURN_IF_ERROR(CheckRows(c, rows, n, "GatherRows"));
  if (n > 0) {
    if (dst == nullptr) return absl::InvalidArgumentError("cuda backend: GatherRows into null");
    absl::StatusOr<const int32_t*> d_rows = UploadRows(c, rows, n);
    if (!d_rows.ok()) return d_rows.status();
    const bf16_t* x = static_cast<const bf16_t*>(c.x.get());
    const size_t row_bytes = static_cast<size_t>(H_) * sizeof(bf16_t);
    if (void* mapped = MappedForKernelWrite(dst, n * row_bytes); mapped != nullptr) {
      MOE_CUDA_RETURN_IF_ERROR(
          cuda::LaunchGatherRows(x, H_, *d_rows, n, static_cast<bf16_t*>(mapped), compute_));
    } else {
      bf16_t* scratch = static_cast<bf16_t*>(rows_bf16_.get());
      for (int off = 0; off < n; off += chunk_rows_) {
        const int m = std::min(chunk_rows_, n - off);
        MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(x, H_, *d_rows + off, m, scratch, compute_));
        MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst + static_cast<size_t>(off) * H_, scratch,
                                                 m * row_bytes, cudaMemcpyDeviceToHost, compute_));
      }
    }
  }
  return compute_fences_.Record(compute_);
}

absl::StatusOr<uint64_t> CudaBackend::AddRows(int ctx, const int32_t* rows, int n,
                                              const bf16_t* partial) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  MOE_RETURN_IF_ERROR(CheckRows(c, rows, n, "AddRows"));
  if (n > 0) {
    if (partial == nullptr) return absl::InvalidArgumentError("cuda backend: AddRows from null");
    absl::StatusOr<const int32_t*> d_rows = UploadRows(c, rows, n);
    if (!d_rows.ok()) return d_rows.status();
    const size_t row_bytes = static_cast<size_t>(H_) * sizeof(bf16_t);
    bf16_t* scratch = static_cast<bf16_t*>(rows_bf16_.get());
    const bf16_t* mapped = static_cast<const bf16_t*>(MappedRange(partial, n * row_bytes));
    for (int off = 0; off < n; off += chunk_rows_) {
      const int m = std::min(chunk_rows_, n - off);
      const size_t at = static_cast<size_t>(off) * H_;
      MOE_RETURN_IF_ERROR(UploadFromHost(scratch, partial + at, m * row_bytes, compute_,
                                         mapped != nullptr ? mapped + at : nullptr));
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddBf16(
          scratch, *d_rows + off, m, H_, static_cast<float*>(c.accum.get()), compute_));
    }
  }
  return compute_fences_.Record(compute_);
}

// Validates the hit plan against the call (an index out of range would fault
// on the device) and splits its groups between the grouped kernels
// (small_groups_) and cuBLAS (big_groups_); returns the largest small group.
absl::StatusOr<int> CudaBackend::SplitHitGroups(const Context& c, const HitPlan& plan) {
  const ExpertGroups& gr = *plan.groups;
  const int num_groups = gr.num_groups(), plan_rows = gr.total_rows;
  if (plan_rows < 0 || gr.row_begin.size() != gr.expert.size() || gr.count.size() != gr.expert.size() ||
      gr.token.size() < static_cast<size_t>(plan_rows) || gr.weight.size() < static_cast<size_t>(plan_rows))
    return absl::InvalidArgumentError("cuda backend: RunExperts: inconsistent plan sizes");
  small_groups_.clear();
  big_groups_.clear();
  if (num_groups == 0 || plan_rows == 0) return 0;
  if (plan.buffer == nullptr) return absl::InvalidArgumentError("cuda backend: RunExperts: plan has null arrays");
  int small_max = 0;
  for (int g = 0; g < num_groups; ++g) {
    const cuda::GroupDesc d{plan.buffer[g], gr.row_begin[g], gr.count[g], 0};
    if (d.buffer < 0 || d.buffer >= config_.num_buffers || d.row_begin < 0 || d.count < 0 ||
        d.count > plan_rows - d.row_begin) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda backend: RunExperts: group ", g, " (buffer ", d.buffer, ", rows ", d.row_begin,
          "+", d.count, ") out of range (", config_.num_buffers, " buffers, ", plan_rows,
          " rows)"));
    }
    if (d.count == 0) continue;
    if (d.count > gemm_min_rows_) {
      big_groups_.push_back(d);
    } else {
      small_groups_.push_back(d);
      small_max = std::max(small_max, d.count);
    }
  }
  for (int r = 0; r < plan_rows; ++r) {
    if (gr.token[r] < -1 || gr.token[r] >= c.T) {
      return absl::InvalidArgumentError(absl::StrCat("cuda backend: RunExperts: row ", r,
                                                     " has token ", gr.token[r], ", call has ",
                                                     c.T, " tokens"));
    }
  }
  return small_max;
}

absl::Status CudaBackend::RunExperts(int ctx, const HitPlan& plan) {
  MOE_ASSIGN_OR_RETURN(Context * cs, ActiveContext(ctx));
  Context& c = *cs;
  if (plan.groups == nullptr) return absl::OkStatus();  // no hits
  const ExpertGroups& gr = *plan.groups;
  const int plan_rows = gr.total_rows;
  MOE_ASSIGN_OR_RETURN(const int small_max, SplitHitGroups(c, plan));
  if (small_groups_.empty() && big_groups_.empty()) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(EnsurePlanRows(plan_rows));

  // One upload: token [rows], weight [rows], small group descriptors.
  const size_t rows = plan_rows;
  const size_t token_off = 0;
  const size_t weight_off = RoundUp(rows * sizeof(int32_t), 16);
  const size_t groups_off = weight_off + RoundUp(rows * sizeof(float), 16);
  const size_t total = groups_off + small_groups_.size() * sizeof(cuda::GroupDesc);
  MOE_ASSIGN_OR_RETURN(const Upload u, Reserve(c, total));
  std::memcpy(u.host + token_off, gr.token.data(), rows * sizeof(int32_t));
  std::memcpy(u.host + weight_off, gr.weight.data(), rows * sizeof(float));
  if (!small_groups_.empty())
    std::memcpy(u.host + groups_off, small_groups_.data(), small_groups_.size() * sizeof(cuda::GroupDesc));
  MOE_RETURN_IF_ERROR(Commit(c, u));
  const int32_t* d_token = reinterpret_cast<const int32_t*>(u.dev + token_off);
  const float* d_weight = reinterpret_cast<const float*>(u.dev + weight_off);

  if (!small_groups_.empty()) {
    cuda::GroupedExpertArgs a;
    a.hidden = H_;
    a.intermediate = I_;
    a.groups = reinterpret_cast<const cuda::GroupDesc*>(u.dev + groups_off);
    a.num_groups = static_cast<int>(small_groups_.size());
    a.max_count = small_max;
    a.token = d_token;
    a.weight = d_weight;
    a.x = static_cast<const bf16_t*>(c.x.get());
    a.act = static_cast<bf16_t*>(act_.get());
    a.accum = static_cast<float*>(c.accum.get());
    MOE_RETURN_IF_ERROR(LaunchGroups(a, compute_));
  }
  for (const cuda::GroupDesc& g : big_groups_) {
    MOE_RETURN_IF_ERROR(RunGemmGroup(c, g, d_token, d_weight));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchGroups(cuda::GroupedExpertArgs a, cudaStream_t stream) const {
  a.activation = geometry_.activation;
  a.bias_ld = geometry_.Ki;
  a.bias_offset = !geometry_.biases ? 0 : geometry_.quantized() ? layout_.bias_offset : cuda::Bf16BiasOffset(H_, I_);
  if (geometry_.quantized()) {
    const cuda::PackedSlots p{static_cast<const uint8_t*>(experts_.get()), slot_bytes_, layout_};
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchPackedGateUp(a, p, stream));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchPackedDown(a, p, stream));
    return absl::OkStatus();
  }
  a.experts = static_cast<const bf16_t*>(experts_.get());
  a.expert_stride = slot_bytes_ / sizeof(bf16_t);
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedGateUp(a, stream));
  MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGroupedDown(a, stream));
  return absl::OkStatus();
}

// One big group through cuBLAS, in pieces of at most chunk_rows_ rows:
//   xg = x[token]                       (gather)
//   gu = xg . [gate; up]^T              (one GEMM: gate and up are adjacent)
//   act = bf16(activation(gu[:, :I] + bg, gu[:, I:] + bu))
//   y = act . down^T                    (into the same f32 scratch)
//   accum[token] += weight * (y + bd)   (scatter-add; biases when the experts have them)
// cuBLAS is column-major: a row-major [r, c] matrix is a column-major [c, r]
// one, so each product is computed transposed (C^T = B^T A^T).
absl::Status CudaBackend::RunGemmGroup(Context& c, const cuda::GroupDesc& g,
                                       const int32_t* d_token, const float* d_weight) {
  const bf16_t* gate_up = buffer_ptr(g.buffer);  // [2I, H] row-major
  if (geometry_.quantized()) {  // dequantized once for all the group's pieces
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchUnpackExpert(slot(g.buffer), layout_, H_, I_,
                                                      static_cast<bf16_t*>(unpacked_.get()), compute_));
    gate_up = static_cast<const bf16_t*>(unpacked_.get());
  }
  const bf16_t* down = gate_up + 2 * static_cast<size_t>(I_) * H_;  // [H, I] row-major
  const float* bias = geometry_.biases ? reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(gate_up) +
                                                                        cuda::Bf16BiasOffset(H_, I_))
                                       : nullptr;
  bf16_t* xg = static_cast<bf16_t*>(rows_bf16_.get());
  float* f32 = static_cast<float*>(gemm_f32_.get());
  const float one = 1.f, zero = 0.f;
  for (int off = 0; off < g.count; off += chunk_rows_) {
    const int n = std::min(chunk_rows_, g.count - off);
    const int r0 = g.row_begin + off;
    bf16_t* act = static_cast<bf16_t*>(act_.get()) + static_cast<size_t>(r0) * I_;
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchGatherRows(static_cast<const bf16_t*>(c.x.get()), H_,
                                                    d_token + r0, n, xg, compute_));
    // gu^T [2I, n] = [gate; up] [2I, H] . xg^T [H, n]
    MOE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I_, n, H_, &one,
                                            gate_up, CUDA_R_16BF, H_, xg, CUDA_R_16BF, H_, &zero,
                                            f32, CUDA_R_32F, 2 * I_, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
    MOE_CUDA_RETURN_IF_ERROR(
        cuda::LaunchActivate(f32, n, I_, geometry_.activation, bias, geometry_.Ki, act, compute_));
    // y^T [H, n] = down [H, I] . act^T [I, n]
    MOE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, H_, n, I_, &one,
                                            down, CUDA_R_16BF, I_, act, CUDA_R_16BF, I_, &zero,
                                            f32, CUDA_R_32F, H_, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT));
    MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchScatterAddF32(f32, d_token + r0, d_weight + r0, n, H_,
                                                       bias != nullptr ? bias + 2 * geometry_.Ki : nullptr,
                                                       static_cast<float*>(c.accum.get()),
                                                       compute_));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::FinishCall(int ctx, bf16_t* out, MemoryKind kind) {
  absl::StatusOr<Context*> cs = ActiveContext(ctx);
  if (!cs.ok()) return cs.status();
  Context& c = **cs;
  c.active = false;
  const size_t n = static_cast<size_t>(c.T) * H_;
  if (n > 0) {
    if (out == nullptr) return absl::InvalidArgumentError("cuda backend: FinishCall into null");
    const float* accum = static_cast<const float*>(c.accum.get());
    if (kind == MemoryKind::kDevice) {
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(accum, n, out, compute_));
    } else if (void* mapped = MappedForKernelWrite(out, n * sizeof(bf16_t)); mapped != nullptr) {
      MOE_CUDA_RETURN_IF_ERROR(
          cuda::LaunchAccumToBf16(accum, n, static_cast<bf16_t*>(mapped), compute_));
    } else {
      // The activations are dead now: their storage stages the output.
      bf16_t* staging = static_cast<bf16_t*>(c.x.get());
      MOE_CUDA_RETURN_IF_ERROR(cuda::LaunchAccumToBf16(accum, n, staging, compute_));
      MOE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, staging, n * sizeof(bf16_t),
                                               cudaMemcpyDeviceToHost, compute_));
    }
  }
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return TakeDeferred();
}

absl::Status CudaBackend::WaitStream(void* stream) {
  if (stream == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(engine_ready_, static_cast<cudaStream_t>(stream)));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, engine_ready_, 0));
  return absl::OkStatus();
}

absl::Status CudaBackend::SynchronizeDevice() {
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaBackend::SignalStream(void* stream) {
  if (stream == nullptr) return absl::OkStatus();
  MOE_RETURN_IF_ERROR(Use());
  MOE_CUDA_RETURN_IF_ERROR(cudaEventRecord(output_ready_, compute_));
  MOE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), output_ready_, 0));
  return absl::OkStatus();
}

}  // namespace cuda_backend_impl
}  // namespace moe
