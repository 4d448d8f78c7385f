// PPO with the ReTool rollout, one step read top to bottom:
//   1. rollout: prompts x G samples with sandboxed tool calls (rollout/retool.h), rewards (data/reward.h)
//   2. scoring (no grad): one forward of the policy per micro-batch gives the old values (value head on
//      its hidden states) and its log-probs (loss module), which are the old ones with
//      train.old_logprobs: recompute, else measure the rollout's; reference log-probs only when
//      objective.kl_coef > 0
//   3. advantages: the sequence's reward on its last sampled token, GAE(gamma, lambda) over the sampled
//      tokens only (tool output is the environment's part of a step), whitened over the batch
//   4. num_iterations x mini-batches x micro-batches: clipped surrogate (loss/policy_loss.h) +
//      vf_coef x clipped value loss, backward with the mini-batch's global denominator, gradient
//      clipping, AdamW (the value head in its own parameter group), the learning-rate schedule
//   5. metrics, checkpoint (the value head is saved with the optimizer state)
// The value head shares the decoder (critic.shared): its loss trains the trunk too, weighted by
// ppo.vf_coef. With critic.shared false the values come from a critic model of its own (trainer/critic.h),
// which trains on the value loss alone with its own optimizer, in step with the policy's. A step whose loss
// or gradient is not finite is skipped and counted, never applied.
#include "trainer/ppo.h"

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "common/memory.h"
#include "common/timing.h"
#include "rollout/sandbox.h"
#include "trainer/batch.h"
#include "trainer/checkpoint.h"
#include "trainer/critic.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/warmup.h"

namespace rlt {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

at::Tensor terminal_rewards(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, int64_t R) {
  at::Tensor r = at::zeros({end - begin, R}, at::kFloat);
  auto a = r.accessor<float, 2>();
  for (int64_t s = begin; s < end; ++s) {
    const auto& mask = trajs[s].loss_mask;
    for (int64_t j = static_cast<int64_t>(mask.size()) - 1; j >= 0; --j) {
      if (mask[j]) {
        a[s - begin][j] = static_cast<float>(trajs[s].reward);
        break;
      }
    }
  }
  return r;
}

ValueLoss value_loss(const at::Tensor& values, const at::Tensor& values_old, const at::Tensor& returns,
                     const at::Tensor& mask, const PpoOptions& ppo, const PolicyLossOptions& objective,
                     double denominator) {
  at::Tensor tok = (values - returns).square();
  ValueLoss out;
  out.clipped = at::zeros_like(tok);
  if (ppo.value_clip > 0) {
    at::Tensor v_clip = values_old + (values - values_old).clamp(-ppo.value_clip, ppo.value_clip);
    at::Tensor tok_clip = (v_clip - returns).square();
    out.clipped = (tok_clip > tok).to(at::kFloat);
    tok = at::maximum(tok, tok_clip);
  }
  out.loss = aggregate_loss(0.5 * tok, mask, objective.agg, objective.agg_norm, denominator);
  return out;
}

std::pair<at::Tensor, at::Tensor> gae_advantages(const at::Tensor& rewards, const at::Tensor& values,
                                                 const at::Tensor& mask, double gamma, double lam) {
  TORCH_CHECK(rewards.dim() == 2 && values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes(),
              "gae_advantages: rewards, values and mask must all be (S, R)");
  const at::Tensor r = rewards.detach().to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor v = values.detach().to(at::kCPU, at::kDouble).contiguous();
  const at::Tensor m = mask.detach().to(at::kCPU, at::kDouble).contiguous();
  TORCH_CHECK((r * (m == 0)).abs().max().item<double>() == 0, "gae_advantages: a reward lies on a non-action token");
  const int64_t S = r.size(0), R = r.size(1);
  at::Tensor adv = at::zeros({S, R}, at::kDouble);
  auto ra = r.accessor<double, 2>(), va = v.accessor<double, 2>(), ma = m.accessor<double, 2>();
  auto aa = adv.accessor<double, 2>();
  for (int64_t s = 0; s < S; ++s) {
    double next_value = 0, next_adv = 0;  // of the following action; 0 past the last one
    for (int64_t j = R - 1; j >= 0; --j) {
      if (ma[s][j] == 0) continue;
      const double delta = ra[s][j] + gamma * next_value - va[s][j];
      aa[s][j] = delta + gamma * lam * next_adv;
      next_value = va[s][j];
      next_adv = aa[s][j];
    }
  }
  at::Tensor returns = (adv + v) * m;  // (S, R)
  return {adv.to(at::kFloat).to(rewards.device()), returns.to(at::kFloat).to(rewards.device())};
}

ExtraParams value_head_params() {
  ExtraParams e;
  e.make = [](const Transformer& policy, const Config& config) {
    if (!config.critic.shared) return std::map<std::string, at::Tensor>{};  // the critic is a model of its own
    const int64_t D = policy.config().hidden_size;
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(policy.lm_head().device());
    return std::map<std::string, at::Tensor>{{"value_head.weight", at::zeros({1, D}, opts).requires_grad_()},
                                             {"value_head.bias", at::zeros({1}, opts).requires_grad_()}};
  };
  e.lr = [](const Config& c) { return c.ppo.value_lr; };
  return e;
}

at::Tensor value_head(const Run& run, const at::Tensor& hidden, const PackedBatch& batch) {
  const int64_t D = hidden.size(2);
  at::Tensor h = hidden.reshape({-1, D}).index_select(0, batch.sampled.rows).to(at::kFloat);  // (N, D)
  at::Tensor v =
      at::addmm(run.model.extra.at("value_head.bias"), h, run.model.extra.at("value_head.weight").t());  // (N, 1)
  return to_response_layout(v.squeeze(1), batch.sampled, batch);                                         // (S, R)
}

std::map<std::string, double> train_ppo(Run& run) {
  const Config& cfg = run.config;
  const TrainOptions& train = cfg.train;
  const PpoOptions& ppo = cfg.ppo;
  const auto [S, mini, micro, total_optimizer_steps] = step_shape(cfg, run.dist->world());  // this rank's share
  TORCH_CHECK(run.model.extra.count("value_head.weight") || !cfg.critic.shared,
              "train_ppo: the run was made without value_head_params()");
  // PPO's advantages are GAE on the value head; the truncation mask would move the reward's token.
  if (train.advantage != Advantage::kGrpo) {
    throw RunError(std::string("train.advantage = ") + enum_to_string(train.advantage) +
                   ": ppo_train estimates advantages with GAE (ppo.gamma, ppo.lam); leave it grpo");
  }
  if (train.mask_truncated) throw RunError("train.mask_truncated: ppo_train does not mask truncated trajectories");
  if (train.dynamic_sampling) throw RunError("train.dynamic_sampling: ppo_train samples no groups; it is grpo_train's");
  if (train.async != AsyncMode::kOff) {
    throw RunError("train.async: ppo_train runs its rollout and update in turn; one_step is grpo_train's");
  }
  if (train.rollout_ranks > 0) {
    throw RunError("train.rollout_ranks: ppo_train samples on its training ranks; the placement is grpo_train's");
  }
  const double eval_start = begin_training(run);  // metrics log, warm-up, reference, evaluation before RL
  ensure_critic(run);  // critic.shared false: a value model of its own, from the policy RL starts from (or a folder)
  reserve_phase_offload(run);  // train.phase_offload: the critic's pinned buffers, on a thread of their own
  Critic* critic = run.model.critic.get();
  std::unique_ptr<GradReducer> reducer = make_reducer(run);  // several ranks: gradients summed over them
  std::map<std::string, double> m;

  while (run.more_steps()) {
    const auto t_step = Clock::now();
    PhasePeaks peaks(run.device);  // (park,) rollout, (unpark,) scoring, update

    run.dist->mark("step " + std::to_string(run.counters.step + 1) + ": rollout");

    // 1. Rollout and rewards (this rank's prompts).
    // train.phase_offload: the training state in host memory meanwhile.
    const RolloutBatch rb = parked_rollout(run, peaks, [&run] { return collect_rollouts(run); });
    // The update's order and micro-batches (train.micro_batch_tokens: each mini-batch longest first, under a
    // token budget).
    const UpdateBatch ub = update_batch(rb, mini, micro, train.micro_batch_tokens, train.pack_sequences,
                                        train.share_prompts, train.balance_tokens ? run.dist.get() : nullptr);
    const std::vector<Trajectory>& trajs = ub.trajs();  // (S)
    const auto& micro_ranges = ub.micro_ranges;
    const std::vector<PackedBatch> batches = ub.micro_batches(run.device);

    // 2. Scoring: old values and the policy's log-probs from one forward; reference log-probs. The values
    // need the forward whatever train.old_logprobs says, so the rollout's old log-probs save nothing here:
    // they keep PPO on the same old log-probs as GRPO, and the scored ones measure the mismatch.
    const auto t_score = Clock::now();
    const size_t K = batches.size();
    const bool use_rollout = run.old_logprobs == OldLogprobs::kRollout;
    std::vector<at::Tensor> logprobs_old(K), logprobs_ref(K), values_old(K), advantages(K), returns(K);
    LogprobMismatch mismatch;  // rollout vs trainer log-probs on the rollout's weights (the scored ones)
    {
      at::NoGradGuard no_grad;
      for (size_t k = 0; k < K; ++k) {
        ResponseLogprobs r = response_logprobs(*run.model.policy, batches[k], cfg.loss);
        mismatch.add(r.logprobs, batches[k].logprobs_rollout, batches[k].loss_mask);
        logprobs_old[k] = use_rollout ? batches[k].logprobs_rollout : r.logprobs;  // (S_m, R)
        values_old[k] = critic ? critic_values(*critic->state.policy, batches[k])  // (S_m, R), 0 off the mask
                               : value_head(run, r.hidden, batches[k]);
        if (run.model.reference)
          logprobs_ref[k] = response_logprobs(*run.model.reference, batches[k], cfg.loss).logprobs;
      }
    }
    const double t_scoring = seconds_since(t_score);

    // 3. GAE per micro-batch (sequences are independent), then whitened over the whole batch (every rank's).
    // advantages, their squares, actions, values, returns: summed on the device, copied once
    at::Tensor sums = at::zeros({5}, at::TensorOptions().dtype(at::kDouble).device(run.device));
    for (size_t k = 0; k < K; ++k) {
      const auto [begin, end] = micro_ranges[k];
      const at::Tensor rewards = terminal_rewards(trajs, begin, end, batches[k].R).to(run.device);
      std::tie(advantages[k], returns[k]) =
          gae_advantages(rewards, values_old[k], batches[k].loss_mask, ppo.gamma, ppo.lam);
      sums += at::stack({advantages[k].sum(), advantages[k].square().sum(), batches[k].loss_mask.sum(),
                         values_old[k].sum(), returns[k].sum()})
                  .to(at::kDouble);
    }
    sums = sums.cpu();
    run.dist->all_reduce({sums}, ReduceOp::kSum);
    const double adv_sum = sums[0].item<double>(), adv_sq = sums[1].item<double>(), n_act = sums[2].item<double>();
    const double adv_mean = adv_sum / std::max(1.0, n_act);
    const double adv_std = std::sqrt(std::max(0.0, adv_sq / std::max(1.0, n_act) - adv_mean * adv_mean));
    if (ppo.whiten_advantages) {
      for (size_t k = 0; k < K; ++k) {
        advantages[k] = (advantages[k] - adv_mean) / std::max(adv_std, 1e-6) * batches[k].loss_mask;
      }
    }

    // 4. Updates.
    peaks.end("scoring");
    const auto t_update = Clock::now();
    run.dist->mark("step " + std::to_string(run.counters.step + 1) + ": update");
    const double comm_before = update_comm_seconds(run.model, reducer.get());
    const std::vector<double> denoms = mini_batch_denominators(trajs, mini, cfg.objective.agg, *run.dist);
    UpdateMetrics um(run.device, cfg.objective.ratio_level == RatioLevel::kSequence);  // GSPO: clip_frac per sequence
    double critic_norms = 0;  // the separate critic's gradient norms, summed over its optimizer steps
    int64_t critic_steps = 0;
    for (int64_t it = 0; it < train.num_iterations; ++it) {
      for (size_t k = 0; k < K;) {
        const int64_t mb_begin = micro_ranges[k].first, mb_end = std::min(S, mb_begin + mini);
        const double denom = denoms[mb_begin / mini];
        zero_gradients(run.model);
        if (critic) zero_gradients(critic->state);
        at::Tensor critic_loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(run.device));
        for (; k < K && micro_ranges[k].first < mb_end; ++k) {
          const PackedBatch& b = batches[k];
          ResponseLogprobs r = response_logprobs(*run.model.policy, b, cfg.loss);  // (S_m, R)
          PolicyLossInputs in;
          in.logprobs = r.logprobs;
          in.logprobs_old = logprobs_old[k];
          in.logprobs_ref = logprobs_ref[k];
          in.advantages = advantages[k];  // (S_m, R) per token
          in.loss_mask = b.loss_mask;
          in.entropy = r.entropy;
          in.logprobs_rollout = b.logprobs_rollout;  // objective.tis / icepop
          in.global_denominator = denom;
          PolicyLossOutput out = policy_loss(in, cfg.objective);
          const bool ends_step = k + 1 == K || micro_ranges[k + 1].first >= mb_end;
          // The shared head's value loss weighs in the policy's loss. A separate critic trains on the value
          // loss alone, its forward after the policy's backward, so the two graphs never live at once.
          at::Tensor loss = out.loss;
          ValueLoss vf;
          if (critic) {
            backward(run, loss, reducer.get(), ends_step);  // master weights: into the fp32 gradients
            r.hidden = at::Tensor();
            const at::Tensor values = critic_values(*critic->state.policy, b);  // (S_m, R)
            vf = value_loss(values, values_old[k], returns[k], b.loss_mask, ppo, cfg.objective, denom);
            critic_backward(*critic, vf.loss, ends_step);
            critic_loss += vf.loss.detach();
          } else {
            vf = value_loss(value_head(run, r.hidden, b), values_old[k], returns[k], b.loss_mask, ppo, cfg.objective,
                            denom);
            loss = loss + ppo.vf_coef * vf.loss;
            backward(run, loss, reducer.get(), ends_step);
          }
          const at::Tensor& vf_loss = vf.loss;                     // ()
          um.add_micro_batch(loss, out, r.logprobs, b.loss_mask);  // on the device: no host sync
          um.add_update_term("value_loss", vf_loss);
          um.add_token_sum("value_clip_frac", (vf.clipped * b.loss_mask).sum());
        }
        um.end_optimizer_step(apply_gradients(run, um.step_loss(), total_optimizer_steps));
        if (critic) {
          critic_norms += critic_step(run, *critic, critic_loss, total_optimizer_steps);
          ++critic_steps;
        }
      }
    }
    zero_gradients(run.model);
    if (critic) zero_gradients(critic->state);
    device_synchronize(run.device);
    const double t_upd = seconds_since(t_update);
    peaks.end("update");

    // 5. Metrics, checkpoint.
    const double v_sum = sums[3].item<double>(), ret_sum = sums[4].item<double>();
    std::map<std::string, double> extra = mismatch.read(run.dist.get());
    check_old_logprobs(run, use_rollout, extra);  // above train.old_logprobs_tol: recompute from the next step
    extra.insert({{"value_mean", v_sum / std::max(1.0, n_act)},
                  {"return_mean", ret_sum / std::max(1.0, n_act)},
                  {"advantage_mean", adv_mean},
                  {"advantage_std", adv_std}});
    if (critic) {
      extra["critic_grad_norm"] = critic_norms / std::max<int64_t>(1, critic_steps);
      extra["critic_lr"] =
          critic_learning_rate(cfg, std::max<int64_t>(0, critic->counters.optimizer_steps - 1), total_optimizer_steps);
    }
    const double t_comm = update_comm_seconds(run.model, reducer.get()) - comm_before;
    m = finish_step(run, rb, um, update_work(cfg.loss, trajs, batches), peaks,
                    {t_scoring, t_upd, seconds_since(t_step), t_comm}, total_optimizer_steps, extra);
  }
  end_training(run, eval_start, m);
  return m;
}

}  // namespace rlt
