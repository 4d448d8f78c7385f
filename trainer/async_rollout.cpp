#include "trainer/async_rollout.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "trainer/shard.h"

namespace fs = std::filesystem;

namespace rlt {

namespace {

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Where the published copy is kept in a checkpoint (a Hugging Face folder, as the model's).
constexpr const char* kWeightsDir = "rollout_weights";

}  // namespace

struct AsyncRollouts::CudaOrder {
#ifdef RLT_HAVE_CUDA
  at::cuda::CUDAEvent published;  // on the main stream, after a publish's copies
  at::cuda::CUDAEvent finished;   // on the rollout's stream, after its last kernel
  std::optional<c10::cuda::CUDAStream> stream;
#endif
};

AsyncRollouts::AsyncRollouts(Run& run, std::function<RolloutBatch(Run&)> collect, bool threaded, AsyncFault fault)
    : run_(run), collect_(std::move(collect)), threaded_(threaded), fault_(fault) {
  dist_ = run.dist->fork("rollout");
#ifdef RLT_HAVE_CUDA
  if (run.device.is_cuda()) {
    cuda_ = std::make_shared<CudaOrder>();
    cuda_->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, run.device.index());
  }
#endif
  // A resumed run: the checkpoint's published copy and where its pending rollout's prompts began (a
  // checkpoint of a run in turn has neither: the first step then publishes the weights as they are).
  if (run.resumed_from.empty()) return;
  std::ifstream f((fs::path(run.resumed_from) / "state.json").string());
  const nlohmann::json state = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!state.is_object() || !state.contains("async")) return;
  const nlohmann::json& a = state.at("async");
  const std::string weights = (fs::path(run.resumed_from) / kWeightsDir).string();
  if (!fs::exists(fs::path(weights) / "config.json")) {
    throw RunError(weights + ": missing; the checkpoint of train.async lost the weights its next rollout samples from");
  }
  copy_ = std::make_unique<Transformer>(
      Transformer::load(weights, run.policy->named_parameters().front().second.scalar_type(), run.device));
  version_ = a.at("version").get<int64_t>();
  run.prompts->seek(a.at("prompts_begin").get<int64_t>());
  published_once_ = true;
}

AsyncRollouts::~AsyncRollouts() {
  if (thread_.joinable()) thread_.join();
}

void AsyncRollouts::publish() {
  if (fault_ == AsyncFault::kNoPublish && published_once_) {
    version_ = run_.step;  // the bookkeeping of a publish, without its copy
    return;
  }
  if (copy_ && version_ == run_.step) return;  // nothing trained since the last publish
  at::NoGradGuard no_grad;
  const GatheredWeights whole(run_.sharded);  // train.shard parameters: the layers gathered for the copy
  if (run_.policy->has_lora()) {
    if (!copy_)
      copy_ = std::make_unique<Transformer>(run_.policy->merged());
    else
      run_.policy->merge_into(*copy_);  // in place: the rollout's kept policy and graphs stay valid
  } else if (!copy_) {
    copy_ = std::make_unique<Transformer>(run_.policy->clone());
  } else {
    const auto src = run_.policy->named_parameters();
    const auto dst = copy_->named_parameters();
    TORCH_CHECK(src.size() == dst.size(), "AsyncRollouts: the copy has ", dst.size(), " tensors, the policy ",
                src.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second, /*non_blocking=*/true);
  }
#ifdef RLT_HAVE_CUDA
  if (cuda_) cuda_->published.record(c10::cuda::getCurrentCUDAStream(run_.device.index()));
#endif
  version_ = run_.step;
  published_once_ = true;
}

void AsyncRollouts::launch(int64_t batch_step) {
  source_.model = fault_ == AsyncFault::kLiveWeights ? run_.policy.get() : copy_.get();
  source_.policy = &policy_;
  source_.dist = dist_.get();
  source_.step = batch_step - 1;  // as collect_rollouts sees run.step when it samples that step in turn
  source_.version = version_;
  pending_prompts_ = run_.prompts->consumed();
  pending_ = true;
  error_ = nullptr;
  started_ = Clock::now();
  auto body = [this, threads = at::get_num_threads()] {
    try {
      at::set_num_threads(threads);  // the same CPU reductions as on the main thread
#ifdef RLT_HAVE_CUDA
      std::optional<c10::cuda::CUDAGuard> device;
      std::optional<c10::cuda::CUDAStreamGuard> on;
      if (cuda_) {
        device.emplace(run_.device.index());
        on.emplace(*cuda_->stream);
        cuda_->published.block(*cuda_->stream);  // the copy is written before the rollout reads it
      }
#endif
      const RolloutSourceScope scope(source_);
      result_ = collect_(run_);
#ifdef RLT_HAVE_CUDA
      if (cuda_) cuda_->finished.record(*cuda_->stream);
#endif
    } catch (...) {
      error_ = std::current_exception();
    }
    ended_ = Clock::now();
  };
  if (threaded_)
    thread_ = std::thread(body);
  else
    body();
}

RolloutBatch AsyncRollouts::wait() {
  if (thread_.joinable()) thread_.join();
  pending_ = false;
  if (error_) std::rethrow_exception(error_);
#ifdef RLT_HAVE_CUDA
  // The next publish rewrites the copy: after the rollout's last read of it.
  if (cuda_) cuda_->finished.block(c10::cuda::getCurrentCUDAStream(run_.device.index()));
#endif
  return std::move(result_);
}

RolloutBatch AsyncRollouts::next() {
  const Clock::time_point asked = Clock::now();
  RolloutBatch batch;
  if (!pending_) {  // the run's first step, or a resumed run's: sampled here, from the copy
    if (!copy_) publish();
    launch(run_.step + 1);
    batch = wait();
    overlap_s_ = 0;
    wait_rollout_s_ = seconds(ended_ - started_);
    rollout_wall_s_ = wait_rollout_s_;
    wait_update_s_ = 0;
  } else {
    batch = wait();
    const Clock::time_point from = std::max(started_, update_began_), to = std::min(ended_, asked);
    overlap_s_ = update_running_ && to > from ? seconds(to - from) : 0;
    wait_rollout_s_ = ended_ > asked ? seconds(ended_ - asked) : 0;
    wait_update_s_ = asked > ended_ ? seconds(asked - ended_) : 0;
    rollout_wall_s_ = seconds(ended_ - started_);
  }
  // The next step's rollout, from the weights as they are now, unless the run ends (or stops) first.
  const int64_t after = run_.step + 2;
  const bool needed = after <= run_.config.train.steps && !(run_.stop_after > 0 && after > run_.stop_after);
  publish();
  if (needed) launch(after);
  update_began_ = Clock::now();
  update_running_ = true;
  return batch;
}

std::map<std::string, double> AsyncRollouts::metrics(const RolloutBatch& batch) const {
  double stale = 0;
  for (const Trajectory& t : batch.trajs) stale += static_cast<double>(run_.step - t.weights_version);
  return {{"staleness_mean", batch.trajs.empty() ? 0.0 : stale / static_cast<double>(batch.trajs.size())},
          {"overlap_s", overlap_s_},
          {"time_rollout_wall_s", rollout_wall_s_},
          {"wait_rollout_s", wait_rollout_s_},
          {"wait_update_s", wait_update_s_}};
}

void AsyncRollouts::save(const std::string& dir, nlohmann::json& state) {
  int64_t begin = run_.prompts->consumed();  // no rollout pending (the run ends or stops here)
  if (pending_) {
    // Its batch stays for the next step; the checkpoint keeps what samples it again.
    if (thread_.joinable()) thread_.join();
    begin = pending_prompts_;
  }
  copy_->save((fs::path(dir) / kWeightsDir).string());
  state["async"] = {{"version", version_}, {"prompts_begin", begin}};
}

}  // namespace rlt
