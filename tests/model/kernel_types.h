// The dtypes the CUDA layer kernels are tested in (test_decode_kernels, test_train_kernels), and their
// pairing with sizes that pick each kernel's one-element form and its 16-byte one.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <utility>
#include <vector>

namespace rlt::testing {

inline constexpr at::ScalarType kTypes[] = {at::kFloat, at::kBFloat16, at::kHalf};

// Every dtype of kTypes with every size of `sizes`.
inline std::vector<std::pair<at::ScalarType, int64_t>> kinds(std::initializer_list<int64_t> sizes) {
  std::vector<std::pair<at::ScalarType, int64_t>> out;
  for (const at::ScalarType dt : kTypes)
    for (const int64_t n : sizes) out.emplace_back(dt, n);
  return out;
}

}  // namespace rlt::testing
