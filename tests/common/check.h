// Shared assertions for numerical tests: NaN/Inf first, then |actual - expected| <= atol + rtol |expected|
// elementwise, reporting the worst element. Every tolerance used with these must also reject the output
// of a wrong implementation (an off-by-one target, a dropped row, a missing temperature, a bf16-rounded
// logit): RLT_EXPECT_CLOSE_REJECTING takes that output beside the real one. Moving one element by a
// multiple of the tolerance's own allowance would prove nothing: it is rejected by any tolerance.
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

// The output of a deliberately wrong implementation must fail the same check: this is what shows the
// tolerance can tell a right result from a plausible wrong one. `why` names the mistake.
inline ::testing::AssertionResult rejects(const at::Tensor& wrong, const at::Tensor& expected, const at::Tensor& atol,
                                          double rtol, const std::string& what, const std::string& why) {
  if (close(wrong, expected, atol, rtol, what)) {
    return ::testing::AssertionFailure() << what << ": the tolerance accepts a wrong implementation (" << why << ")";
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult rejects(const at::Tensor& wrong, const at::Tensor& expected, double atol, double rtol,
                                          const std::string& what, const std::string& why) {
  return rejects(wrong, expected, at::scalar_tensor(atol, at::kDouble), rtol, what, why);
}

// Close only. Use it where the same tolerance is shown elsewhere in the test to reject a wrong
// implementation (as tests/model/ pair theirs).
#define RLT_EXPECT_CLOSE(actual, expected, atol, rtol, what) \
  EXPECT_TRUE(::rlt::testing::close((actual), (expected), (atol), (rtol), (what)))

// Both at once: the result is close, and the output `wrong` of a wrong implementation (named by `why`)
// is not.
#define RLT_EXPECT_CLOSE_REJECTING(actual, wrong, why, expected, atol, rtol, what)            \
  do {                                                                                        \
    EXPECT_TRUE(::rlt::testing::close((actual), (expected), (atol), (rtol), (what)));         \
    EXPECT_TRUE(::rlt::testing::rejects((wrong), (expected), (atol), (rtol), (what), (why))); \
  } while (0)

}  // namespace rlt::testing
