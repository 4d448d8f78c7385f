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

#include "parallel/shard.h"

namespace fs = std::filesystem;

namespace rlt {

namespace {

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string carry_path(const std::string& dir, int rank) {
  return (fs::path(dir) / ("partial_rank" + std::to_string(rank) + ".json")).string();
}

// A carry as JSON: every field the loop continues a trajectory from (the texts it rebuilds from the tokens).
nlohmann::json carry_to_json(const PartialCarry& c) {
  nlohmann::json groups = nlohmann::json::array();
  for (const CarriedGroup& g : c.groups) {
    const PromptExample& ex = c.examples.at(g.key);
    nlohmann::json messages = nlohmann::json::array();
    for (const ChatMessage& m : ex.messages) messages.push_back({{"role", m.role}, {"content", m.content}});
    nlohmann::json trajs = nlohmann::json::array();
    for (size_t i = 0; i < g.trajs.size(); ++i) {
      const Trajectory& t = g.trajs[i];
      trajs.push_back({{"sample_index", t.sample_index},
                       {"started", g.started[i] != 0},
                       {"done", g.done[i] != 0},
                       {"response_ids", t.response_ids},
                       {"loss_mask", t.loss_mask},
                       {"logprobs", t.logprobs},
                       {"versions", t.versions},
                       {"finish", enum_to_string(t.finish)},
                       {"truncated", t.truncated},
                       {"turns", t.turns},
                       {"tool_calls", t.tool_calls},
                       {"feedback_turns", t.feedback_turns},
                       {"tool_timeouts", t.tool_timeouts},
                       {"weights_version", t.weights_version}});
    }
    groups.push_back(
        {{"key", g.key},
         {"prompt_ids", g.prompt_ids},
         {"example", {{"prompt", ex.prompt}, {"answer", ex.answer}, {"source", ex.source}, {"messages", messages}}},
         {"trajectories", trajs}});
  }
  return {{"groups", groups}};
}

PartialCarry carry_from_json(const nlohmann::json& j) {
  PartialCarry c;
  for (const nlohmann::json& g : j.at("groups")) {
    CarriedGroup group;
    group.key = g.at("key").get<int64_t>();
    group.prompt_ids = g.at("prompt_ids").get<std::vector<int64_t>>();
    PromptExample ex;
    const nlohmann::json& e = g.at("example");
    ex.prompt = e.at("prompt").get<std::string>();
    ex.answer = e.at("answer").get<std::string>();
    ex.source = e.at("source").get<std::string>();
    for (const nlohmann::json& m : e.at("messages")) {
      ChatMessage msg;
      msg.role = m.at("role").get<std::string>();
      msg.content = m.at("content").get<std::string>();
      ex.messages.push_back(std::move(msg));
    }
    for (const nlohmann::json& tj : g.at("trajectories")) {
      Trajectory t;
      t.sample_index = tj.at("sample_index").get<int64_t>();
      t.prompt_ids = group.prompt_ids;
      t.response_ids = tj.at("response_ids").get<std::vector<int64_t>>();
      t.loss_mask = tj.at("loss_mask").get<std::vector<uint8_t>>();
      t.logprobs = tj.at("logprobs").get<std::vector<float>>();
      t.versions = tj.at("versions").get<std::vector<int64_t>>();
      parse_field(tj.at("finish").get<std::string>(), t.finish, "a carried trajectory", "finish");
      t.truncated = tj.at("truncated").get<bool>();
      t.turns = tj.at("turns").get<int64_t>();
      t.tool_calls = tj.at("tool_calls").get<int64_t>();
      t.feedback_turns = tj.at("feedback_turns").get<int64_t>();
      t.tool_timeouts = tj.at("tool_timeouts").get<int64_t>();
      t.weights_version = tj.at("weights_version").get<int64_t>();
      group.started.push_back(tj.at("started").get<bool>());
      group.done.push_back(tj.at("done").get<bool>());
      group.trajs.push_back(std::move(t));
    }
    c.examples[group.key] = std::move(ex);
    c.groups.push_back(std::move(group));
  }
  return c;
}

}  // namespace

std::optional<PendingRollout> pending_rollout(const Run& run) {
  if (run.resumed_from.empty()) return std::nullopt;
  std::ifstream f((fs::path(run.resumed_from) / "state.json").string());
  const nlohmann::json state = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!state.is_object() || !state.contains("async")) return std::nullopt;
  const nlohmann::json& a = state.at("async");
  PendingRollout p;
  p.prompts_begin = a.at("prompts_begin").get<int64_t>();
  p.version = a.at("version").get<int64_t>();
  p.partial = a.value("partial", false);
  p.weights = (fs::path(run.resumed_from) / kRolloutWeightsDir).string();
  if (!fs::exists(fs::path(p.weights) / "config.json")) {
    throw RunError(p.weights +
                   ": missing; the checkpoint of train.async lost the weights its next rollout samples from");
  }
  return p;
}

struct AsyncRollouts::CudaOrder {
#ifdef RLT_HAVE_CUDA
  at::cuda::CUDAEvent published;  // on the main stream, after a publish's copies
  at::cuda::CUDAEvent finished;   // on the rollout's stream, after its last kernel
  std::optional<c10::cuda::CUDAStream> stream;
#endif
};

AsyncRollouts::AsyncRollouts(Run& run, std::function<RolloutBatch(Run&)> collect, bool threaded, AsyncFault fault)
    : run_(run),
      collect_(std::move(collect)),
      threaded_(threaded),
      fault_(fault),
      partial_(run.config.rollout.partial) {
  dist_ = run.dist->fork("rollout");
#ifdef RLT_HAVE_CUDA
  if (run.device.is_cuda()) {
    cuda_ = std::make_shared<CudaOrder>();
    cuda_->stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, run.device.index());
  }
#endif
  // A resumed run: the checkpoint's published copy and where its pending rollout's prompts began (a
  // checkpoint of a run in turn has neither: the first step then publishes the weights as they are).
  const std::optional<PendingRollout> pending = pending_rollout(run);
  if (!pending) return;
  copy_ = std::make_unique<Transformer>(Transformer::load(
      pending->weights, run.model.policy->named_parameters().front().second.scalar_type(), run.device));
  version_ = pending->version;
  run.data.prompts->seek(pending->prompts_begin);
  published_once_ = true;
  const std::string carried = carry_path(run.resumed_from, run.dist->rank());
  if (pending->partial && !partial_) {
    throw RunError(run.resumed_from +
                   ": the checkpoint holds the unfinished groups of rollout.partial; resume with "
                   "rollout.partial: true");
  }
  if (partial_ && pending->partial) {
    std::ifstream cf(carried);
    if (!cf) throw RunError(carried + ": missing; the checkpoint of rollout.partial lost this rank's carried groups");
    try {
      carry_ = carry_from_json(nlohmann::json::parse(cf));
    } catch (const std::exception& e) {
      throw RunError(carried + ": " + e.what());
    }
  }
}

AsyncRollouts::~AsyncRollouts() {
  if (thread_.joinable()) thread_.join();
}

void AsyncRollouts::publish() {
  if (fault_ == AsyncFault::kNoPublish && published_once_) {
    version_ = run_.counters.step;  // the bookkeeping of a publish, without its copy
    return;
  }
  if (copy_ && version_ == run_.counters.step) return;  // nothing trained since the last publish
  at::NoGradGuard no_grad;
  const GatheredWeights whole(run_.model.sharded);  // train.shard parameters: the layers gathered for the copy
  if (run_.model.policy->has_lora()) {
    if (!copy_)
      copy_ = std::make_unique<Transformer>(run_.model.policy->merged());
    else
      run_.model.policy->merge_into(*copy_);  // in place: the rollout's kept engine and graphs stay valid
  } else if (!copy_) {
    copy_ = std::make_unique<Transformer>(run_.model.policy->clone());
  } else {
    const auto src = run_.model.policy->named_parameters();
    const auto dst = copy_->named_parameters();
    TORCH_CHECK(src.size() == dst.size(), "AsyncRollouts: the copy has ", dst.size(), " tensors, the policy ",
                src.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second, /*non_blocking=*/true);
  }
#ifdef RLT_HAVE_CUDA
  if (cuda_) cuda_->published.record(c10::cuda::getCurrentCUDAStream(run_.device.index()));
#endif
  version_ = run_.counters.step;
  published_once_ = true;
}

void AsyncRollouts::launch(int64_t batch_step) {
  source_.model = fault_ == AsyncFault::kLiveWeights ? run_.model.policy.get() : copy_.get();
  source_.engine = &engine_;
  source_.dist = dist_.get();
  source_.step = batch_step - 1;  // as collect_rollouts sees run.counters.step when it samples that step in turn
  source_.version = version_;
  source_.carry = partial_ ? &carry_ : nullptr;
  if (partial_) carry_in_ = carry_;
  pending_prompts_ = run_.data.prompts->consumed();
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
    launch(run_.counters.step + 1);
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
  const int64_t after = run_.counters.step + 2;
  const bool needed = after <= run_.last_step();
  publish();
  if (needed) launch(after);
  update_began_ = Clock::now();
  update_running_ = true;
  return batch;
}

Staleness batch_staleness(const Run& run, Collectives& dist, const RolloutBatch& batch) {
  double stale = 0, most = 0, tokens = 0, spanning = 0;
  for (const Trajectory& t : batch.trajs) {
    int64_t lo = t.weights_version, hi = t.weights_version;
    for (size_t k = 0; k < t.versions.size(); ++k) {
      lo = std::min(lo, t.versions[k]);
      hi = std::max(hi, t.versions[k]);
      if (!t.loss_mask[k]) continue;
      const double s = static_cast<double>(run.counters.step - t.versions[k]);
      stale += s;
      most = std::max(most, s);
      tokens += 1;
    }
    spanning += hi > lo;
  }
  if (dist.world() > 1) {  // every rank's batch: each samples its own share (and carries its own groups)
    at::Tensor sums = at::tensor({stale, tokens, spanning}, at::kDouble);
    at::Tensor highest = at::tensor({most}, at::kDouble);
    dist.all_reduce({sums}, ReduceOp::kSum);
    dist.all_reduce({highest}, ReduceOp::kMax);
    stale = sums[0].item<double>(), tokens = sums[1].item<double>(), spanning = sums[2].item<double>();
    most = highest[0].item<double>();
  }
  return {tokens > 0 ? stale / tokens : 0.0, most, spanning};
}

std::map<std::string, double> AsyncRollouts::metrics(const RolloutBatch& batch) const {
  const Staleness st = batch_staleness(run_, *run_.dist, batch);
  std::map<std::string, double> m = {{"staleness_mean", st.mean},         {"staleness_max", st.max},
                                     {"overlap_s", overlap_s_},           {"time_rollout_wall_s", rollout_wall_s_},
                                     {"wait_rollout_s", wait_rollout_s_}, {"wait_update_s", wait_update_s_}};
  if (partial_) {
    m["partial_resumed"] = static_cast<double>(batch.stats.resumed);
    m["partial_cut"] = static_cast<double>(batch.stats.cut);
    m["partial_spanning"] = st.spanning;
  }
  return m;
}

void AsyncRollouts::save(const std::string& dir, nlohmann::json& state) {
  int64_t begin = run_.data.prompts->consumed();  // no rollout pending (the run ends or stops here)
  if (pending_) {
    // Its batch stays for the next step; the checkpoint keeps what samples it again.
    if (thread_.joinable()) thread_.join();
    begin = pending_prompts_;
  }
  copy_->save((fs::path(dir) / kRolloutWeightsDir).string());
  state["async"] = {{"version", version_}, {"prompts_begin", begin}, {"partial", partial_}};
}

void AsyncRollouts::save_carry(const std::string& dir) const {
  if (!partial_) return;
  const std::string path = carry_path(dir, run_.dist->rank());
  std::ofstream f(path);
  f << carry_to_json(pending_ ? carry_in_ : carry_).dump() << "\n";
  if (!f) throw RunError(path + ": cannot write");
}

}  // namespace rlt
