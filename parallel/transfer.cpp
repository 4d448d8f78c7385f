// Trajectory records and the byte exchange; see transfer.h.
#include "parallel/transfer.h"

namespace rlt {

void write_group(ByteWriter& w, int64_t slot, const PromptExample& ex, const Trajectory* trajs, int64_t G) {
  w.put<int64_t>(slot);
  w.put_str(ex.prompt);
  w.put_str(ex.answer);
  w.put_str(ex.source);
  w.put<int64_t>(static_cast<int64_t>(ex.messages.size()));
  for (const ChatMessage& m : ex.messages) {
    w.put_str(m.role);
    w.put_str(m.content);
  }
  for (int64_t g = 0; g < G; ++g) {
    const Trajectory& t = trajs[g];
    w.put<int64_t>(t.prompt_index);
    w.put<int64_t>(t.sample_index);
    w.put_vec(t.prompt_ids);
    w.put_vec(t.response_ids);
    w.put_vec(t.loss_mask);
    w.put_vec(t.logprobs);
    w.put<int64_t>(static_cast<int64_t>(t.finish));
    w.put<uint8_t>(t.truncated);
    w.put<int64_t>(t.turns);
    w.put<int64_t>(t.tool_calls);
    w.put<int64_t>(t.feedback_turns);
    w.put<int64_t>(t.tool_timeouts);
    w.put_str(t.response_text);
    w.put<double>(t.reward);
    w.put<uint8_t>(t.correct);
    w.put<double>(t.overlong_penalty);
    w.put<int64_t>(t.weights_version);
    w.put_vec(t.versions);
  }
}

GroupRecord read_group(ByteReader& r, int64_t G) {
  GroupRecord d;
  d.slot = r.get<int64_t>();
  d.example.prompt = r.get_str();
  d.example.answer = r.get_str();
  d.example.source = r.get_str();
  const auto n_messages = r.get<int64_t>();
  for (int64_t i = 0; i < n_messages; ++i) {
    ChatMessage m;
    m.role = r.get_str();
    m.content = r.get_str();
    d.example.messages.push_back(std::move(m));
  }
  for (int64_t g = 0; g < G; ++g) {
    Trajectory t;
    t.prompt_index = r.get<int64_t>();
    t.sample_index = r.get<int64_t>();
    t.prompt_ids = r.get_vec<int64_t>();
    t.response_ids = r.get_vec<int64_t>();
    t.loss_mask = r.get_vec<uint8_t>();
    t.logprobs = r.get_vec<float>();
    t.finish = static_cast<FinishReason>(r.get<int64_t>());
    t.truncated = r.get<uint8_t>() != 0;
    t.turns = r.get<int64_t>();
    t.tool_calls = r.get<int64_t>();
    t.feedback_turns = r.get<int64_t>();
    t.tool_timeouts = r.get<int64_t>();
    t.response_text = r.get_str();
    t.reward = r.get<double>();
    t.correct = r.get<uint8_t>() != 0;
    t.overlong_penalty = r.get<double>();
    t.weights_version = r.get<int64_t>();
    t.versions = r.get_vec<int64_t>();
    d.trajs.push_back(std::move(t));
  }
  return d;
}

void write_tally(ByteWriter& w, const RewardTally& t) {
  w.put<int64_t>(t.scored);
  w.put<int64_t>(t.failed);
  for (const auto* named : {&t.fields, &t.terms}) {
    w.put<int64_t>(static_cast<int64_t>(named->size()));
    for (const auto& [name, v] : *named) {
      w.put_str(name);
      w.put<double>(v.first);
      w.put<int64_t>(v.second);
    }
  }
  w.put<double>(t.seconds);
}

RewardTally read_tally(ByteReader& r) {
  RewardTally t;
  t.scored = r.get<int64_t>();
  t.failed = r.get<int64_t>();
  for (auto* named : {&t.fields, &t.terms}) {
    const auto n = r.get<int64_t>();
    TORCH_CHECK(n >= 0, "a corrupt reward tally: ", n, " names");
    for (int64_t i = 0; i < n; ++i) {
      std::string name = r.get_str();
      const auto sum = r.get<double>();
      (*named)[std::move(name)] = {sum, r.get<int64_t>()};
    }
  }
  t.seconds = r.get<double>();
  return t;
}

std::vector<uint8_t> exchange_bytes(Collectives& dist, const std::vector<uint8_t>& mine) {
  const int world = dist.world(), rank = dist.rank();
  at::Tensor sizes = at::zeros({world}, at::kDouble);
  sizes[rank] = static_cast<double>(mine.size());
  dist.all_reduce({sizes}, ReduceOp::kSum);
  const auto s = sizes.accessor<double, 1>();
  int64_t total = 0, offset = 0;
  for (int r = 0; r < world; ++r) {
    if (r < rank) offset += static_cast<int64_t>(s[r]);
    total += static_cast<int64_t>(s[r]);
  }
  if (total == 0) return {};
  at::Tensor buf = at::zeros({total}, at::kByte);
  if (!mine.empty()) std::memcpy(buf.data_ptr<uint8_t>() + offset, mine.data(), mine.size());
  dist.all_reduce({buf}, ReduceOp::kSum);
  const uint8_t* b = buf.data_ptr<uint8_t>();
  return std::vector<uint8_t>(b, b + total);
}

}  // namespace rlt
