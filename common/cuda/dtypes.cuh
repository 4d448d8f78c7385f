// Device-side dtype helpers shared by the project's CUDA kernels (loss/cuda, model/cuda): float32 views
// of float32 / bfloat16 / float16 elements, rounding back, and a dispatch over those three dtypes.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace rlt::cuda {

template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}

// Round to nearest even, as ATen's casts do.
template <typename T>
__device__ __forceinline__ T from_f(float v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

// Rounded to T and back: what storing a T tensor between two ATen kernels does to a value.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_f(from_f<T>(x));
}

// N elements of T moved as one load or store (N sizeof(T) bytes, at most 16: one vector instruction), from or
// to an address aligned to its size.
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};
template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// Whether `p` may take 16-byte loads and stores; a null pointer (an operand not given) does not stop them.
inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(T{}) with T the device type of `t`: float, __nv_bfloat16 or __half; other dtypes are an error
// naming `what`.
template <typename F>
void dispatch_float_types(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(__nv_bfloat16{});
      break;
    case at::kHalf:
      f(__half{});
      break;
    default:
      TORCH_CHECK(false, what, ": float32, bfloat16 or float16 only, got ", t);
  }
}

}  // namespace rlt::cuda
