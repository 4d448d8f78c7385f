// RewardModel; see reward_model.h.
#include "rollout/reward_model.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "common/memory.h"
#include "data/chat_template.h"

namespace rlt {

ModelConfig reward_model_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path)) throw RewardModelError(dir + ": no config.json (a Hugging Face model folder)");
  ModelConfig c = load_model_config(path);
  if (c.head != ModelHead::kSequenceScore) {
    throw RewardModelError(path + ": architectures: " + (c.architecture.empty() ? "none named" : c.architecture) +
                           ", not a *ForSequenceClassification reward model");
  }
  if (c.num_labels != 1) {
    throw RewardModelError(path + ": id2label: " + std::to_string(c.num_labels) +
                           " labels; a reward model's score head has one (num_labels 1)");
  }
  return c;
}

namespace {

// The folder's tokenizer and chat template; RewardModelError naming the missing or bad file.
std::pair<Tokenizer, HfChatTemplate> read_text_side(const std::string& dir) {
  try {
    return {Tokenizer::from_checkpoint(dir), HfChatTemplate::from_folder(dir)};
  } catch (const DataError& e) {
    throw RewardModelError(std::string("the reward model's ") + e.what());
  }
}

}  // namespace

void check_reward_model_folder(const std::string& dir) {
  reward_model_config(dir);
  read_text_side(dir);
}

at::Tensor last_real_tokens(const at::Tensor& mask) {
  TORCH_CHECK(mask.dim() == 2, "last_real_tokens: mask must be (B, T)");
  const at::Tensor real = mask.to(at::kLong) != 0;
  const at::Tensor index = at::arange(mask.size(1), mask.options().dtype(at::kLong)).unsqueeze(0);
  // The largest index whose token is real; a row without one reads position 0, as transformers does.
  return (index * real.to(at::kLong)).argmax(1);
}

RewardModel::RewardModel(Transformer model, int64_t token_budget) : token_budget_(token_budget) {
  if (token_budget <= 0) throw std::invalid_argument("RewardModel: token_budget must be > 0");
  const ModelConfig& c = model.config();
  if (c.head != ModelHead::kSequenceScore || c.num_labels != 1) {
    throw RewardModelError("RewardModel: the model (" + c.architecture + ", " + std::to_string(c.num_labels) +
                           " labels) is not a one-label sequence-classification model");
  }
  for (const at::Tensor& p : model.parameters()) p.requires_grad_(false);
  device_ = model.parameters().front().device();
  model_ = std::make_shared<Transformer>(std::move(model));
}

RewardModel RewardModel::load(const std::string& dir, at::ScalarType dtype, at::Device device, int64_t token_budget) {
  reward_model_config(dir);
  RewardModel rm(Transformer::load(dir, dtype, device), token_budget);
  auto [tokenizer, chat] = read_text_side(dir);
  rm.tokenizer_ = std::make_shared<Tokenizer>(std::move(tokenizer));
  rm.chat_ = std::make_shared<HfChatTemplate>(std::move(chat));
  if (rm.tokenizer_->vocab_size() > rm.model_->config().vocab_size) {
    throw RewardModelError(dir + ": the tokenizer has " + std::to_string(rm.tokenizer_->vocab_size()) +
                           " pieces, more than config.json's vocab_size " +
                           std::to_string(rm.model_->config().vocab_size));
  }
  return rm;
}

std::vector<int64_t> RewardModel::encode(const std::vector<ChatMessage>& conversation, const std::string& question,
                                         const std::string& response) const {
  if (!chat_) throw RewardModelError("RewardModel::encode: the model was given without a tokenizer and template");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (conversation.empty()) {
    messages.push_back({{"role", "user"}, {"content", question}});
  } else {
    for (const ChatMessage& m : conversation) messages.push_back({{"role", m.role}, {"content", m.content}});
  }
  messages.push_back({{"role", "assistant"}, {"content", response}});
  return tokenizer_->encode(chat_->render(messages, nlohmann::ordered_json(), /*add_generation_prompt=*/false));
}

// encode() of each text on threads of their own, taking the texts in order, while the caller uses those
// done (get() waits for one). The first error is rethrown by get(); the threads stop at their next text and
// are joined when this goes.
class RewardModel::EncodeAhead {
 public:
  EncodeAhead(const RewardModel& rm, const std::vector<Text>& texts)
      : rm_(rm), texts_(texts), out_(texts.size()), done_(texts.size(), 0) {
    // Threads of its own: at::parallel_for runs serially in code compiled without OpenMP, as this is.
    const size_t threads = std::min<size_t>(std::max(1, at::get_num_threads()), texts.size());
    try {
      for (size_t w = 0; w < threads; ++w) pool_.emplace_back([this] { work(); });
    } catch (...) {  // a thread the system refused: the ones started stop at their next text
      stop();
      throw;
    }
  }
  EncodeAhead(const EncodeAhead&) = delete;
  EncodeAhead& operator=(const EncodeAhead&) = delete;
  ~EncodeAhead() { stop(); }

  // Text i's ids, once encoded; the first encoding error instead, where one came first.
  std::vector<int64_t>& get(size_t i) {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return done_[i] != 0 || failed_; });
    if (failed_) std::rethrow_exception(failed_);
    return out_[i];
  }

 private:
  void work() {
    for (size_t i = next_++; i < texts_.size(); i = next_++) {
      try {
        std::vector<int64_t> ids = rm_.encode(texts_[i].conversation, texts_[i].question, texts_[i].response);
        std::lock_guard<std::mutex> lock(mutex_);
        out_[i] = std::move(ids);
        done_[i] = 1;
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!failed_) failed_ = std::current_exception();
        next_ = texts_.size();  // the others stop at their next text
      }
      ready_.notify_all();
    }
  }
  void stop() {
    next_ = texts_.size();
    for (std::thread& t : pool_) t.join();
    pool_.clear();
  }

  const RewardModel& rm_;
  const std::vector<Text>& texts_;
  std::vector<std::vector<int64_t>> out_;
  std::vector<uint8_t> done_;
  std::exception_ptr failed_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::atomic<size_t> next_{0};
  std::vector<std::thread> pool_;
};

std::vector<std::vector<int64_t>> RewardModel::encode(const std::vector<Text>& texts) const {
  EncodeAhead ahead(*this, texts);
  std::vector<std::vector<int64_t>> out(texts.size());
  for (size_t i = 0; i < texts.size(); ++i) out[i] = std::move(ahead.get(i));
  return out;
}

std::vector<double> RewardModel::score_texts(const std::vector<Text>& texts, int64_t* tokens_forwarded) const {
  EncodeAhead ahead(*this, texts);
  return score_in_order(
      texts.size(), [&](size_t i) -> const std::vector<int64_t>& { return ahead.get(i); }, tokens_forwarded);
}

std::vector<double> RewardModel::score(const std::vector<std::vector<int64_t>>& sequences,
                                       int64_t* tokens_forwarded) const {
  return score_in_order(
      sequences.size(), [&](size_t i) -> const std::vector<int64_t>& { return sequences[i]; }, tokens_forwarded);
}

std::vector<double> RewardModel::score_in_order(size_t count,
                                                const std::function<const std::vector<int64_t>&(size_t)>& sequence_at,
                                                int64_t* tokens_forwarded) const {
  const int64_t V = model_->config().vocab_size;
  size_t checked = 0;  // sequences before it are checked
  auto seq_at = [&](size_t s) -> const std::vector<int64_t>& {
    const std::vector<int64_t>& seq = sequence_at(s);
    for (; checked <= s; ++checked) {
      const std::vector<int64_t>& c = checked == s ? seq : sequence_at(checked);
      if (c.empty())
        throw std::invalid_argument("RewardModel::score: sequence " + std::to_string(checked) + " is empty");
      for (int64_t id : c) {
        if (id < 0 || id >= V) {
          throw std::invalid_argument("RewardModel::score: sequence " + std::to_string(checked) + " has id " +
                                      std::to_string(id) + ", outside the vocabulary of " + std::to_string(V));
        }
      }
    }
    return seq;
  };
  at::NoGradGuard no_grad;
  // Runs of consecutive sequences that begin with the same kMinSharedTokens tokens or more (the answers to
  // one prompt, as a step lists them): their common first tokens, leaving each one token of its own, run
  // once as a prefix that each continues (Transformer::forward_packed's prefix_of). Answers to the next
  // prompt share with these only what the two prompts have in common (a chat template's header, an
  // instruction): where the tokens a sequence shares with the run's first fall below 3/4 of what the run's
  // first two share, the next run begins. A sequence that shares much less with the next than the next
  // shares with the one after it (a prompt's last answer before the next prompt's) runs alone.
  auto common = [&](size_t a, size_t b, int64_t most) {
    const std::vector<int64_t>&x = seq_at(a), &y = seq_at(b);
    int64_t c = 0;
    while (c < most && x[c] == y[c]) ++c;
    return c;
  };
  auto own_most = [&](size_t k) { return static_cast<int64_t>(seq_at(k).size()) - 1; };
  struct Group {
    size_t begin = 0, end = 0;
    int64_t shared = 0;
  };
  // The run that begins at sequence b: it reads at most two sequences past its end.
  auto group_from = [&](size_t b) {
    Group g{b, b + 1, own_most(b)};
    int64_t first_two = -1;  // what the run's first two sequences share
    while (share_prefixes_ && g.end < count) {
      const int64_t c = common(b, g.end, std::min(g.shared, own_most(g.end)));
      if (c < kMinSharedTokens || (first_two >= 0 && 4 * c < 3 * first_two)) break;
      if (first_two < 0 && g.end + 1 < count) {
        const int64_t next_two = common(g.end, g.end + 1, std::min(own_most(g.end), own_most(g.end + 1)));
        if (4 * c < 3 * next_two) break;
      }
      if (first_two < 0) first_two = c;
      g.shared = c;
      ++g.end;
    }
    if (g.end - g.begin < 2) g.shared = 0;
    return g;
  };
  // Forwards of at most token_budget tokens (a sequence longer than that alone), and of at most
  // kKeysPerToken x token_budget keys over all sequences (each answer attends over its prefix's keys, which
  // every layer gathers for it); a group split between two forwards runs its prefix in each. Each run is
  // packed once it is known, so a forward is queued while the sequences after it are still being made.
  const int64_t most_keys = kKeysPerToken * token_budget_;
  std::vector<at::Tensor> chunks;  // each forward's scores, on the device
  std::vector<size_t> order;       // the sequence each score belongs to, forward after forward
  std::vector<int64_t> ids, positions, starts{0}, prefix_of, last;
  int64_t keys = 0, forwarded = 0;
  bool prefixed = false;
  auto flush = [&] {
    if (last.empty()) return;
    if (!prefixed) prefix_of.clear();
    // The packed ids go up through pinned memory without waiting for the device.
    // Each sequence's last token alone: the last layer runs over those rows only.
    const at::Tensor hidden = model_->forward_packed(to_device_async(ids, device_).view({1, -1}),
                                                     to_device_async(positions, device_).view({1, -1}), starts,
                                                     prefix_of, scored_rows_only_ ? last : std::vector<int64_t>{});
    const at::Tensor rows = scored_rows_only_ ? hidden[0] : hidden[0].index_select(0, to_device_async(last, device_));
    chunks.push_back(model_->score(rows).select(1, 0));
    forwarded += static_cast<int64_t>(ids.size());
    ids.clear(), positions.clear(), starts.assign(1, 0), prefix_of.clear(), last.clear();
    keys = 0;
    prefixed = false;
  };
  auto append = [&](const std::vector<int64_t>& seq, int64_t from, int64_t to, int64_t prefix) {
    for (int64_t i = from; i < to; ++i) ids.push_back(seq[i]), positions.push_back(i);
    starts.push_back(static_cast<int64_t>(ids.size()));
    prefix_of.push_back(prefix);
    keys += to;  // its own tokens and those of the prefix before them
  };
  for (size_t b = 0; b < count;) {
    const Group g = group_from(b);
    int64_t prefix = -1;  // the group's prefix in the forward being packed
    for (size_t k = g.begin; k < g.end; ++k) {
      const std::vector<int64_t>& seq = seq_at(k);
      const int64_t length = static_cast<int64_t>(seq.size());
      const int64_t more = prefix < 0 ? g.shared : 0;  // the prefix, where this forward lacks it
      if (!last.empty() && (static_cast<int64_t>(ids.size()) + length - g.shared + more > token_budget_ ||
                            keys + length + more > most_keys)) {
        flush();
        prefix = -1;
      }
      if (g.shared > 0 && prefix < 0) {
        prefix = static_cast<int64_t>(starts.size()) - 1;
        append(seq, 0, g.shared, -1);
        prefixed = true;
      }
      append(seq, g.shared, length, prefix);
      last.push_back(static_cast<int64_t>(ids.size()) - 1);
      order.push_back(k);
    }
    b = g.end;
  }
  flush();
  if (tokens_forwarded) *tokens_forwarded = forwarded;
  if (chunks.empty()) return {};
  const at::Tensor scores = at::cat(chunks).to(at::kCPU, at::kDouble).contiguous();
  std::vector<double> out(count);
  for (size_t i = 0; i < order.size(); ++i) out[order[i]] = scores.data_ptr<double>()[i];
  return out;
}

at::Tensor RewardModel::score_padded(const at::Tensor& ids, const at::Tensor& mask) const {
  TORCH_CHECK(ids.dim() == 2 && mask.sizes() == ids.sizes(), "score_padded: ids and mask must be (B, T) alike");
  at::NoGradGuard no_grad;
  const at::Tensor m = mask.to(at::kLong);
  const at::Tensor positions = (m.cumsum(1) - 1).clamp_min(0);
  const at::Tensor hidden = model_->forward(ids, positions, m);  // (B, T, D)
  const at::Tensor last = last_real_tokens(m).to(hidden.device());
  const at::Tensor rows = at::arange(ids.size(0), last.options());
  return model_->score(hidden.index({rows, last})).select(1, 0).to(at::kFloat);
}

}  // namespace rlt
