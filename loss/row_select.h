// Row selection for the loss module (seed 001): which rows of a flattened batch get a log-prob.
// Only the index is built here; the gather happens inside each path so no [T', V] copy is made
// where a path can read rows in place.
#pragma once

#include <ATen/ATen.h>

namespace rlt {

// What the loss module knows about the batch's layout.
struct RowSelection {
  at::Tensor response_windows;  // (W, 2) int64: [start, end) rows of the flattened batch (response tokens)
  at::Tensor loss_mask;         // (T) 0/1, any dtype: 1 = the row's token counts in the policy loss
};

// Sorted int64 indices (T') of the rows to compute, on the windows' device:
//   response_only  -> rows inside any response window (windows may touch or overlap);
//   loss_mask_only -> of those, rows with loss_mask != 0.
// Returns an undefined tensor when every row is kept (the caller then skips the gather entirely).
// Checks: windows inside [0, T] with start <= end; loss_mask of length T; loss_mask_only needs
// response_only.
at::Tensor build_keep_index(int64_t T, const RowSelection& rows, bool response_only, bool loss_mask_only);

}  // namespace rlt
