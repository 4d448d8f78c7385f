// Keep-index construction (seed 001): a difference array over window bounds, cumulated, marks rows
// inside any response window without a host loop over windows.
#include "loss/row_select.h"

namespace rlt {

at::Tensor build_keep_index(int64_t T, const RowSelection& rows, bool response_only, bool loss_mask_only) {
  TORCH_CHECK(!loss_mask_only || response_only, "loss_mask_only needs response_only");
  if (!response_only) return at::Tensor();
  const at::Tensor& win = rows.response_windows;  // (W, 2)
  TORCH_CHECK(win.defined(), "response_only needs the batch's response windows");
  TORCH_CHECK(win.dim() == 2 && win.size(1) == 2, "response windows must be (W, 2), got ", win.sizes());
  TORCH_CHECK(win.scalar_type() == at::kLong, "response windows must be int64");
  auto dev = win.device();
  at::Tensor keep_mask;  // (T) bool
  if (win.size(0) == 0) {
    keep_mask = at::zeros({T}, at::TensorOptions().dtype(at::kBool).device(dev));
  } else {
    at::Tensor starts = win.select(1, 0), ends = win.select(1, 1);
    TORCH_CHECK(
        starts.min().item<int64_t>() >= 0 && ends.max().item<int64_t>() <= T && (ends >= starts).all().item<bool>(),
        "response windows must satisfy 0 <= start <= end <= T = ", T);
    // delta[s] += 1, delta[e] -= 1; cumsum(delta)[t] = number of windows covering row t.
    at::Tensor delta = at::zeros({T + 1}, at::TensorOptions().dtype(at::kLong).device(dev));
    delta.index_add_(0, starts, at::ones_like(starts));
    delta.index_add_(0, ends, -at::ones_like(ends));
    keep_mask = delta.narrow(0, 0, T).cumsum(0) > 0;
  }
  if (loss_mask_only) {
    const at::Tensor& m = rows.loss_mask;
    TORCH_CHECK(m.defined() && m.dim() == 1 && m.size(0) == T, "loss_mask must be (T) with T = ", T);
    keep_mask = keep_mask & (m.to(dev) != 0);
  }
  at::Tensor keep = keep_mask.nonzero().squeeze(1);  // (T') sorted
  if (keep.size(0) == T) return at::Tensor();        // all rows: no gather needed
  return keep;
}

}  // namespace rlt
