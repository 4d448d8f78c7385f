// The demo's warm-up and tokenizer corpus; see warmup.h.
#include "trainer/warmup.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>

#include "common/timing.h"
#include "data/chat_template.h"
#include "data/synthetic.h"
#include "trainer/batch.h"
#include "trainer/optim.h"

namespace rlt {

std::vector<std::string> tokenizer_corpus(const Config& c, const ToolProtocol& tools) {
  SyntheticOptions s = c.synthetic;
  s.count = 600;
  s.seed = c.synthetic.seed + 7919;
  std::vector<std::string> docs;
  for (const auto& ex : make_multiplication_tasks(s)) {
    std::string trace = render_prompt(c.chat, ex.prompt);
    const WorkedSolution w = worked_solution(ex);
    for (const auto& seg : tool_use_trace(tools, w.code, w.output, w.answer)) trace += seg.text;
    docs.push_back(trace);
    docs.push_back(render_prompt(c.chat, ex.prompt) + "Answer: \\boxed{" + ex.answer + "}");
  }
  docs.push_back(c.rollout.feedback);
  return docs;
}

std::vector<PromptExample> warmup_tasks(const SyntheticOptions& task, const SftOptions& o) {
  const int64_t n = o.steps * o.batch_size;
  // Operand lengths (digits_a, digits_b) of the warm-up problems, cycled through problem by problem.
  auto shortest = [&](int64_t digits) {
    return o.operand_digits_min > 0 ? std::min(o.operand_digits_min, digits) : digits;
  };
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t a = shortest(task.digits_a); a <= task.digits_a; ++a) {
    for (int64_t b = shortest(task.digits_b); b <= task.digits_b; ++b) shapes.emplace_back(a, b);
  }
  const int64_t S = static_cast<int64_t>(shapes.size());
  std::vector<std::vector<PromptExample>> by_shape(S);
  for (int64_t i = 0; i < S; ++i) {
    SyntheticOptions s = task;
    s.digits_a = shapes[i].first;
    s.digits_b = shapes[i].second;
    s.count = (n + S - 1) / S;
    s.seed = task.seed + 104729 + 7919 * i;  // other problems than the RL prompts
    by_shape[i] = make_multiplication_tasks(s);
  }
  std::vector<PromptExample> tasks;
  tasks.reserve(n);
  for (int64_t k = 0; k < n; ++k) tasks.push_back(by_shape[k % S][k / S]);
  return tasks;
}

double sft_warmup(Run& run) {
  const SftOptions& o = run.config.sft;
  if (o.steps == 0) return 0.0;
  const std::vector<PromptExample> tasks = warmup_tasks(run.config.synthetic, o);
  const auto prompts = encode_prompts(run.data, run.config, run.rollout.tools, tasks);
  // A bf16 model with master weights trains the run's fp32 masters here too (its own AdamW state): plain
  // bf16 AdamW would round most small updates away, and the RL optimizer then starts from the masters the
  // warm-up left, not from the weights before it.
  const std::vector<at::Tensor> trained =
      run.model.master.empty() ? run.model.policy->trainable_parameters() : run.model.master;
  torch::optim::AdamW opt(
      trained, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.adam_eps).weight_decay(o.weight_decay));
  TrainOptions sched;  // the schedule's fields, read by learning_rate()
  sched.lr = o.lr;
  sched.lr_schedule = o.lr_schedule;
  sched.min_lr_ratio = o.min_lr_ratio;
  sched.warmup_steps = o.warmup_steps;
  // A fixed log-prob path, whatever `loss:` says: the warm-up then ends in the same weights for every
  // loss.impl / row-selection setting, so the README's ablation compares the RL step alone.
  LossOptions lo;
  lo.impl = LogprobImpl::kSelective;
  lo.response_only = true;
  lo.loss_mask_only = true;
  lo.entropy = EntropyMode::kNone;
  double loss_value = 0;
  const auto t0 = std::chrono::steady_clock::now();
  // The live line: rewritten in place ("\r") on a terminal, one line per update in a log file; the last
  // update ends with a newline either way, so what follows starts on a line of its own.
  const bool tty = isatty(fileno(stderr)) == 1;
  for (int64_t step = 0; step < o.steps; ++step) {
    std::vector<Trajectory> batch;
    for (int64_t i = 0; i < o.batch_size; ++i) {
      const int64_t k = step * o.batch_size + i;
      Trajectory t;
      t.prompt_ids = prompts[k];
      // A fixed share uses the tool (a deterministic interleave, not a random draw).
      const bool tool = std::floor((k + 1) * o.tool_fraction) > std::floor(k * o.tool_fraction);
      std::vector<TraceSegment> segs;
      if (tool) {
        const WorkedSolution w = worked_solution(tasks[k]);
        segs = tool_use_trace(run.rollout.tools, w.code, w.output, w.answer);
      } else {
        segs = {{"Answer: \\boxed{" + tasks[k].answer + "}", true}};
      }
      for (const auto& seg : segs) {
        for (int64_t id : run.data.tokenizer->encode(seg.text)) {
          t.response_ids.push_back(id);
          t.loss_mask.push_back(seg.trainable ? 1 : 0);
          t.logprobs.push_back(0.0f);
        }
      }
      batch.push_back(std::move(t));
    }
    set_learning_rate(opt, learning_rate(sched, step, o.steps));
    opt.zero_grad();
    PackedBatch b = pack(batch, 0, static_cast<int64_t>(batch.size()), run.device, run.config.train.pack_sequences,
                         run.config.train.share_prompts);
    ResponseLogprobs r = response_logprobs(*run.model.policy, b, lo);
    at::Tensor loss = -(r.logprobs * b.loss_mask).sum() / b.loss_mask.sum().clamp_min(1);  // token-mean NLL
    loss.backward();
    accumulate_gradients(run.model);  // master weights: the bf16 gradients into the fp32 masters' gradients
    if (o.grad_clip > 0) clip_gradients(trained, o.grad_clip);
    step_multi_tensor(opt);
    copy_master_weights_to_model(run.model);
    loss_value = loss.item<double>();
    if (run.lead() && (step % 20 == 0 || step + 1 == o.steps)) {
      const double sec = seconds_since(t0);
      const char* end = step + 1 == o.steps ? ", done\n" : (tty ? "" : "\n");
      std::cerr << (tty ? "\r" : "") << "warm-up " << step + 1 << "/" << o.steps << "  loss " << std::fixed
                << std::setprecision(4) << loss_value << "  " << std::setprecision(1) << sec << " s" << end
                << std::flush;
    }
  }
  return loss_value;
}

}  // namespace rlt
