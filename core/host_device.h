// MOE_HOST_DEVICE: marks small inline functions that host code and CUDA
// device code share (the packed-expert index math, the seeded values of the
// benchmark model's attention, bench/model/attention_weights.h), so both
// compute with one definition.
#pragma once

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif
