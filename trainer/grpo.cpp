// GRPO with the ReTool rollout, one step read top to bottom:
//   1. rollout: prompts x G samples with sandboxed tool calls (rollout/retool.h)
//   2. rewards: boxed-answer match and tool-use shaping (data/reward.h)
//   3. advantages: per train.advantage (group-relative scaled per train.scale_rewards, leave-one-out, or
//      normalised over the batch); train.mask_truncated zeroes truncated trajectories' loss masks
//   4. old log-probs (only when an update is off-policy, and then the rollout's own unless
//      train.old_logprobs is recompute) and reference log-probs (only when objective.kl_coef > 0: no
//      reference model exists otherwise), all through the loss module
//   5. num_iterations x mini-batches x micro-batches: policy loss (loss/policy_loss.h), backward with
//      the mini-batch's global denominator, gradient clipping, AdamW, the learning-rate schedule
//   6. metrics, checkpoint
// A step whose loss or gradient is not finite is skipped and counted, never applied.
#include "trainer/grpo.h"

#include <ATen/core/grad_mode.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>

#include "common/memory.h"
#include "common/timing.h"
#include "data/reward.h"
#include "loss/policy_loss.h"
#include "rollout/engine.h"
#include "rollout/retool.h"
#include "rollout/sandbox.h"
#include "trainer/async_rollout.h"
#include "trainer/batch.h"
#include "trainer/checkpoint.h"
#include "trainer/dynamic_sampling.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/warmup.h"

namespace rlt {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

at::Tensor group_advantages(const at::Tensor& rewards, ScaleRewards scale) {
  TORCH_CHECK(rewards.dim() == 2, "rewards must be (P, G)");
  at::Tensor centred = rewards - rewards.mean(/*dim=*/1, /*keepdim=*/true);  // (P, G)
  if (scale == ScaleRewards::kNone) return centred;
  // Unbiased std as in the GRPO paper's implementations; a single sample has none (divide by 1).
  at::Tensor std = scale == ScaleRewards::kGroup
                       ? (rewards.size(1) > 1 ? rewards.std(/*dim=*/1, /*unbiased=*/true, /*keepdim=*/true)
                                              : at::ones({rewards.size(0), 1}, rewards.options()))
                       : (rewards.numel() > 1 ? rewards.std() : at::ones({}, rewards.options()));
  return centred / at::where(std < 1e-6, at::ones_like(std), std);
}

at::Tensor estimate_advantages(const at::Tensor& rewards, Advantage kind, ScaleRewards scale) {
  TORCH_CHECK(rewards.dim() == 2, "rewards must be (P, G)");
  const int64_t G = rewards.size(1);
  // Normalised over every reward of the step; a constant batch divides by 1.
  auto batch_normalise = [](const at::Tensor& x) {
    const at::Tensor std = x.numel() > 1 ? x.std() : at::ones({}, x.options());
    return (x - x.mean()) / at::where(std < 1e-6, at::ones_like(std), std);
  };
  switch (kind) {
    case Advantage::kGrpo:
      return group_advantages(rewards, scale);
    case Advantage::kRloo: {
      TORCH_CHECK(G >= 2, "rloo needs at least 2 samples per prompt, got ", G);
      const at::Tensor others = (rewards.sum(/*dim=*/1, /*keepdim=*/true) - rewards) / static_cast<double>(G - 1);
      return rewards - others;
    }
    case Advantage::kReinforcePp:
      return batch_normalise(rewards);
    case Advantage::kReinforcePpBaseline:
      return batch_normalise(rewards - rewards.mean(/*dim=*/1, /*keepdim=*/true));
  }
  TORCH_CHECK(false, "estimate_advantages: unknown kind");
}

void mask_truncated(std::vector<Trajectory>& trajs) {
  for (Trajectory& t : trajs) {
    if (t.truncated) std::fill(t.loss_mask.begin(), t.loss_mask.end(), uint8_t{0});
  }
}

double overlong_shaping(const Config& config, int64_t prompt_tokens, int64_t sampled_tokens) {
  const RolloutOptions& ro = config.rollout;
  const int64_t budget =
      overlong_budget(prompt_tokens, ro.max_context, ro.tools ? ro.max_turns : 1, config.sampling.max_new_tokens);
  return overlong_penalty(sampled_tokens, budget, config.reward);
}

std::map<std::string, double> train_grpo(Run& run, const GrpoHooks& hooks) {
  const Config& cfg = run.config;
  const TrainOptions& train = cfg.train;
  const int64_t P = train.prompts_per_step, G = cfg.sampling.samples_per_prompt;
  // train.rollout_ranks: a rollout rank samples every step's batch for the training ranks, and nothing else.
  if (run.rollout_rank) {
    serve_rollouts(run, hooks.placement_fault, hooks.before_sample);
    return {};
  }
  const auto [S, mini, micro, total_optimizer_steps] = step_shape(cfg, run.dist->world());  // this rank's share
  const double eval_start = begin_training(run);  // metrics log, warm-up, reference, evaluation before RL
  // Several ranks: gradients summed over them as the backward produces them (trajectories are not).
  std::unique_ptr<GradReducer> reducer = make_reducer(run);
  DynamicSampling sampling(cfg);  // train.dynamic_sampling: rounds of prompts, equal-reward groups dropped
  // train.async one_step: the next step's rollout runs beside this step's update (trainer/async_rollout.h).
  std::unique_ptr<AsyncRollouts> async;
  struct Detach {  // a checkpoint reads run.rollout.pending: never past the object's life
    Run& run;
    ~Detach() { run.rollout.pending = nullptr; }
  } detach{run};
  // train.rollout_ranks: the batches come from the rollout ranks, the weights go to them (trainer/rollout_ranks.h).
  std::unique_ptr<RemoteRollouts> remote;
  if (run.placement) {
    remote = std::make_unique<RemoteRollouts>(run, hooks.placement_fault, hooks.before_publish);
    run.rollout.pending = remote.get();
  } else if (train.async == AsyncMode::kOneStep) {
    async = std::make_unique<AsyncRollouts>(
        run, [&sampling](Run& r) { return sampling.collect(r); }, hooks.async_threaded, hooks.async_fault);
    run.rollout.pending = async.get();
  }
  std::map<std::string, double> m;

  while (run.more_steps()) {
    const auto t_step = Clock::now();
    PhasePeaks peaks(run.device);  // (park,) rollout, (unpark,) scoring, update

    run.dist->mark("step " + std::to_string(run.counters.step + 1) + ": rollout");

    // 1-2. Rollout (G samples per prompt, sandboxed tool calls) and rewards: this rank's prompts.
    // train.phase_offload: the training state in host memory meanwhile.
    RolloutBatch rb = parked_rollout(run, peaks, [&] {
      return remote ? remote->next() : async ? async->next() : sampling.collect(run);
    });
    if (remote && sampling.enabled()) sampling.record(remote->rounds());  // the rollout ranks' rounds
    if (train.mask_truncated) mask_truncated(rb.trajs);                   // before packing and the denominators
    // The update's order and micro-batches: the batch's own (prompt-major) in micro_batch_size rows, or
    // with train.micro_batch_tokens each mini-batch longest first (sharing prompts, a prompt's answers
    // together), under that token budget.
    const UpdateBatch ub = update_batch(rb, mini, micro, train.micro_batch_tokens, train.pack_sequences,
                                        train.share_prompts, train.balance_tokens ? run.dist.get() : nullptr);
    const std::vector<Trajectory>& trajs = ub.trajs();  // (S)

    // 3. Advantages: one per sequence, broadcast over its tokens by the policy loss; from the step's every
    // reward (rb.table, all ranks'), then this rank's rows.
    const at::Tensor rewards = rb.table.select(1, kReward).view({P, G});
    at::Tensor advantages = estimate_advantages(rewards, train.advantage, train.scale_rewards)
                                .view({P * G})
                                .index_select(0, at::tensor(ub.index, at::kLong))
                                .to(at::kFloat)
                                .to(run.device);

    // Micro-batches, packed once: [begin, end) never crosses a mini-batch boundary.
    const auto& micro_ranges = ub.micro_ranges;
    const std::vector<PackedBatch> batches = ub.micro_batches(run.device);

    // 4. Old and reference log-probs. With one iteration over one mini-batch the update is on-policy:
    // the old log-probs are the new ones, detached (ratio 1), and no extra forward is spent. Off-policy,
    // they are the rollout's sampling log-probs (train.old_logprobs: rollout; the same loss module on the
    // same weights, so equal to a recomputation up to rounding, and the policy's scoring forward is saved),
    // or a scoring forward (recompute, or since the mismatch exceeded train.old_logprobs_tol).
    const auto t_score = Clock::now();
    const bool stale = train.async == AsyncMode::kOneStep;  // sampled a step behind
    const bool on_policy = !stale && train.num_iterations == 1 && mini == S;
    const bool use_rollout = !on_policy && run.old_logprobs == OldLogprobs::kRollout;
    const bool score_old = !on_policy && !use_rollout;
    std::vector<at::Tensor> logprobs_old(batches.size()), logprobs_ref(batches.size());
    {
      at::NoGradGuard no_grad;
      for (size_t k = 0; k < batches.size(); ++k) {
        if (use_rollout) logprobs_old[k] = batches[k].logprobs_rollout;  // (S_m, R)
        if (score_old) logprobs_old[k] = response_logprobs(*run.model.policy, batches[k], cfg.loss).logprobs;
        if (run.model.reference)
          logprobs_ref[k] = response_logprobs(*run.model.reference, batches[k], cfg.loss).logprobs;
      }
    }
    const double t_scoring = seconds_since(t_score);

    // 5. Updates.
    peaks.end("scoring");
    run.dist->mark("step " + std::to_string(run.counters.step + 1) + ": update");
    const auto t_update = Clock::now();
    const double comm_before = update_comm_seconds(run.model, reducer.get());
    const std::vector<double> denoms = mini_batch_denominators(trajs, mini, cfg.objective.agg, *run.dist);
    UpdateMetrics um(run.device, cfg.objective.ratio_level == RatioLevel::kSequence);  // GSPO: clip_frac per sequence
    LogprobMismatch mismatch;  // rollout vs trainer log-probs on the rollout's weights
    for (int64_t it = 0; it < sampling.iterations(train.num_iterations); ++it) {  // 0: no group kept
      for (size_t k = 0; k < batches.size();) {
        const int64_t mb_begin = micro_ranges[k].first, mb_end = std::min(S, mb_begin + mini);
        const double denom = denoms[mb_begin / mini];
        zero_gradients(run.model);
        for (; k < batches.size() && micro_ranges[k].first < mb_end; ++k) {
          const PackedBatch& b = batches[k];
          const auto [begin, end] = micro_ranges[k];
          ResponseLogprobs r = response_logprobs(*run.model.policy, b, cfg.loss);  // (S_m, R)
          PolicyLossInputs in;
          in.logprobs = r.logprobs;
          in.logprobs_old = on_policy ? r.logprobs.detach() : logprobs_old[k];
          in.logprobs_ref = logprobs_ref[k];
          in.advantages = advantages.narrow(0, begin, end - begin);  // (S_m)
          in.loss_mask = b.loss_mask;
          in.entropy = r.entropy;
          in.logprobs_rollout = b.logprobs_rollout;  // objective.tis / icepop
          in.global_denominator = denom;
          // The mismatch needs the trainer's log-probs on the rollout's weights: the scored old ones, or this
          // pass's own while no optimizer step has moved the weights, i.e. in the first iteration's first
          // mini-batch (on-policy, the only one). With the rollout's old log-probs, later mini-batches are
          // scored on moved weights and are left out: the figure then covers the first mini-batch only.
          // Async, no pass runs on the rollout's weights (they are a step behind): no mismatch is measured.
          if (!stale && it == 0 && (score_old || mb_begin == 0)) {
            mismatch.add(score_old ? logprobs_old[k] : r.logprobs, b.logprobs_rollout, b.loss_mask);
          }
          PolicyLossOutput out = policy_loss(in, cfg.objective);
          const bool ends_step = k + 1 == batches.size() || micro_ranges[k + 1].first >= mb_end;
          backward(run, out.loss, reducer.get(), ends_step);           // master weights: into the fp32 gradients
          um.add_micro_batch(out.loss, out, r.logprobs, b.loss_mask);  // on the device: no host sync
        }
        um.end_optimizer_step(apply_gradients(run, um.step_loss(), total_optimizer_steps));
      }
    }
    zero_gradients(run.model);
    stream_synchronize(run.device);
    const double t_upd = seconds_since(t_update);
    peaks.end("update");

    // 6. Metrics, warnings (a mismatch above train.old_logprobs_tol switches to recompute), checkpoint.
    std::map<std::string, double> extra = mismatch.read(run.dist.get());
    extra.merge(sampling.metrics());
    if (async) extra.merge(async->metrics(rb));
    if (remote) extra.merge(remote->metrics(rb));
    {  // groups trained on whose rewards are all equal: zero advantage under a group baseline
      const std::vector<bool> varied = varied_groups(rb.table, G);
      extra["groups_equal_reward"] = static_cast<double>(std::count(varied.begin(), varied.end(), false));
    }
    if (cfg.reward.overlong_buffer > 0)  // the step's mean overlong penalty, as added to every rank's rewards
      extra["overlong_penalty_mean"] = rb.table.select(1, kOverlongPenalty).mean().item<double>();
    check_old_logprobs(run, use_rollout, extra);
    const double t_comm = update_comm_seconds(run.model, reducer.get()) - comm_before;
    m = finish_step(run, rb, um, update_work(cfg.loss, trajs, batches), peaks,
                    {t_scoring, t_upd, seconds_since(t_step), t_comm}, total_optimizer_steps, extra);
  }
  end_training(run, eval_start, m);
  return m;
}

}  // namespace rlt
