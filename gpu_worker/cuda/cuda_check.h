// Turning CUDA / cuBLAS errors into absl::Status values. Every CUDA runtime
// and cuBLAS call in gpu_worker/ goes through one of the macros below, so a
// failure reports where it happened, the failing call and the library's
// message, e.g.
//   INTERNAL: gpu_worker/cuda_backend.cu:120: cudaMalloc(&p, n) failed:
//   out of memory (cudaErrorMemoryAllocation)
// Header-only; usable from .cc and .cu files. Thread-safe (pure functions).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe {

// OkStatus for cudaSuccess; otherwise a Status carrying "file:line: expr
// failed: <cudaGetErrorString> (<cudaGetErrorName>)". Out-of-memory maps to
// ResourceExhausted, a missing / unusable device to FailedPrecondition, the
// rest to Internal.
inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                 cudaGetErrorString(err), " (", cudaGetErrorName(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// Readable name of a cuBLAS status (cublasGetStatusString exists since 11.4).
inline const char* CublasStatusString(cublasStatus_t st) { return cublasGetStatusString(st); }

// Same as CudaStatus for cuBLAS results.
inline absl::Status CublasStatus(cublasStatus_t st, const char* expr, const char* file, int line) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string msg = absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                 CublasStatusString(st), " (cublasStatus ",
                                 static_cast<int>(st), ")");
  if (st == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  if (st == CUBLAS_STATUS_NOT_INITIALIZED) return absl::FailedPreconditionError(msg);
  return absl::InternalError(msg);
}

}  // namespace moe

// Evaluates a CUDA runtime call; on error returns its Status from the
// enclosing function (which must return absl::Status or absl::StatusOr<T>).
#define MOE_CUDA_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                   \
    const cudaError_t moe_cuda_err_ = (expr);                                            \
    if (moe_cuda_err_ != cudaSuccess)                                                    \
      return ::moe::CudaStatus(moe_cuda_err_, #expr, __FILE__, __LINE__);                \
  } while (0)

// Same for a cuBLAS call.
#define MOE_CUBLAS_RETURN_IF_ERROR(expr)                                                 \
  do {                                                                                   \
    const cublasStatus_t moe_cublas_st_ = (expr);                                        \
    if (moe_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                         \
      return ::moe::CublasStatus(moe_cublas_st_, #expr, __FILE__, __LINE__);             \
  } while (0)

// The Status of the most recent kernel launch on this thread (launch
// configuration errors); use right after a <<<...>>> launch.
#define MOE_CUDA_RETURN_IF_LAUNCH_ERROR() MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError())
