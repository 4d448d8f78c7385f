// A float64 gradient check for custom autograd functions (LibTorch has no C++ gradcheck): autograd's
// gradient of a scalar F(inputs) against central differences (F(x + h e_i) - F(x - h e_i)) / 2h for
// every element of every input.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <string>
#include <vector>

namespace rlt::testing {

// Central differences in float64 have truncation error O(h^2 f''') and rounding error O(eps / h):
// with h = 1e-6 both stay far below 1e-6 for the smooth, O(1) functions tested here.
constexpr double kGradcheckStep = 1e-6;
constexpr double kGradcheckTol = 1e-6;

inline ::testing::AssertionResult gradcheck(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& F,
                                            std::vector<at::Tensor> inputs, const std::string& what) {
  for (auto& x : inputs) {
    if (x.scalar_type() != at::kDouble) return ::testing::AssertionFailure() << what << ": gradcheck needs float64";
    x = x.detach().clone().requires_grad_(true);
  }
  at::Tensor y = F(inputs);
  auto grads = torch::autograd::grad({y}, inputs, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  at::NoGradGuard ng;
  for (size_t k = 0; k < inputs.size(); ++k) {
    at::Tensor x = inputs[k];
    at::Tensor flat = x.view({-1});
    at::Tensor ana = grads[k].defined() ? grads[k].reshape({-1}) : at::zeros_like(flat);
    for (int64_t i = 0; i < flat.numel(); ++i) {
      const double x0 = flat[i].item<double>();
      flat[i] = x0 + kGradcheckStep;
      const double fp = F(inputs).item<double>();
      flat[i] = x0 - kGradcheckStep;
      const double fm = F(inputs).item<double>();
      flat[i] = x0;
      const double num = (fp - fm) / (2 * kGradcheckStep), a = ana[i].item<double>();
      if (std::abs(num - a) > kGradcheckTol * (1 + std::abs(a))) {
        return ::testing::AssertionFailure()
               << what << ": input " << k << " element " << i << ": autograd " << a << " vs finite difference " << num;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace rlt::testing
