// Shared assertions for numerical tests: NaN/Inf first, then |actual - expected| <= atol + rtol |expected|
// elementwise, reporting the worst element. Every tolerance used with these must also be shown to
// reject a known-bad input (expect_tolerance_bites), so a tolerance can never accept everything.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>

namespace rlt::testing {

// atol may be a tensor broadcastable to expected: a per-element error bound derived from the inputs.
inline ::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected, const at::Tensor& atol,
                                        double rtol, const std::string& what) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << what << ": shape " << actual.sizes() << " vs " << expected.sizes();
  }
  at::Tensor a = actual.detach().to(at::kCPU).to(at::kDouble), e = expected.detach().to(at::kCPU).to(at::kDouble);
  if (!at::isfinite(a).all().item<bool>()) return ::testing::AssertionFailure() << what << ": NaN/Inf in result";
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  at::Tensor excess = (a - e).abs() - (atol.to(at::kCPU).to(at::kDouble) + rtol * e.abs());
  const int64_t worst = excess.argmax().item<int64_t>();
  if (excess.flatten()[worst].item<double>() > 0) {
    std::ostringstream os;
    os << what << ": element " << worst << " = " << a.flatten()[worst].item<double>() << ", expected "
       << e.flatten()[worst].item<double>() << " (atol "
       << atol.to(at::kCPU).to(at::kDouble).expand_as(e).flatten()[worst].item<double>() << ", rtol " << rtol
       << "), max abs diff " << (a - e).abs().max().item<double>();
    return ::testing::AssertionFailure() << os.str();
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult close(const at::Tensor& actual, const at::Tensor& expected, double atol, double rtol,
                                        const std::string& what) {
  return close(actual, expected, at::scalar_tensor(atol, at::kDouble), rtol, what);
}

// The same tolerance must reject the result with one element moved by 4x its allowance.
inline void expect_tolerance_bites(const at::Tensor& actual, const at::Tensor& expected, const at::Tensor& atol_t,
                                   double rtol, const std::string& what) {
  at::Tensor bad = actual.detach().to(at::kCPU).to(at::kDouble).clone();
  at::Tensor e = expected.detach().to(at::kCPU).to(at::kDouble);
  if (bad.numel() == 0) return;
  const int64_t i = bad.numel() / 2;
  const double atol = atol_t.to(at::kCPU).to(at::kDouble).expand_as(e).flatten()[i].item<double>();
  const double allowance = atol + rtol * std::abs(e.flatten()[i].item<double>());
  bad.flatten()[i] = e.flatten()[i].item<double>() + 4 * allowance + 1e-300;
  EXPECT_FALSE(close(bad, expected, atol_t, rtol, what + " (known-bad)")) << what << ": tolerance accepts a bad value";
  at::Tensor nan = actual.detach().to(at::kCPU).to(at::kDouble).clone();
  nan.flatten()[i] = std::nan("");
  EXPECT_FALSE(close(nan, expected, atol_t, rtol, what + " (NaN)")) << what << ": NaN accepted";
}

inline void expect_tolerance_bites(const at::Tensor& actual, const at::Tensor& expected, double atol, double rtol,
                                   const std::string& what) {
  expect_tolerance_bites(actual, expected, at::scalar_tensor(atol, at::kDouble), rtol, what);
}

// Both at once: the result is close, and the tolerance is not vacuous.
#define RLT_EXPECT_CLOSE(actual, expected, atol, rtol, what)                              \
  do {                                                                                    \
    EXPECT_TRUE(::rlt::testing::close((actual), (expected), (atol), (rtol), (what)));     \
    ::rlt::testing::expect_tolerance_bites((actual), (expected), (atol), (rtol), (what)); \
  } while (0)

}  // namespace rlt::testing
