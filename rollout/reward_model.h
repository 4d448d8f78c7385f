// reward.kind model: a Hugging Face sequence-classification checkpoint (*ForSequenceClassification: the
// decoder trunk and a one-output `score` layer without bias) scores each (prompt, response) conversation
// at its last token, what transformers' AutoModelForSequenceClassification returns as logits[:, 0]. The
// conversation is rendered through the reward model's own chat template and encoded by its own tokenizer,
// which may differ from the policy's. Scoring runs without gradients, packed: sequences laid end to end
// into forwards of at most a token budget (Transformer::forward_packed), so no padding reaches a GEMM, and
// the answers to one prompt run the prompt's tokens once.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/hf_chat.h"
#include "data/tokenizer.h"
#include "model/transformer.h"

namespace rlt {

// A folder that is not a single-label sequence-classification checkpoint, or one without a tokenizer or
// chat template: the message names the folder and the field.
class RewardModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Checks `dir`'s config.json before anything is loaded: a *ForSequenceClassification architecture of a
// supported family with one label. Returns its parsed config. RewardModelError naming `architectures` or
// `id2label` otherwise (ModelConfigError for a config.json that does not parse).
ModelConfig reward_model_config(const std::string& dir);
// reward_model_config's checks, then the folder's tokenizer and chat template, read as load() reads them:
// what the config reader runs, so that a folder load() would refuse is an error before the run starts.
void check_reward_model_folder(const std::string& dir);

// Each row's rightmost real token of a padded batch (mask (B, T) of 0/1): transformers' pooling rule,
// which serves left and right padding alike. transformers finds real tokens as ids != pad_token_id; the
// two agree unless a real token is the pad id (an EOS that doubles as pad), where the mask is right.
at::Tensor last_real_tokens(const at::Tensor& mask);

class RewardModel {
 public:
  // Loads `dir` (reward_model_config's checks, then the weights) in `dtype` on `device`, with the folder's
  // tokenizer and chat template. token_budget: the most tokens one scoring forward packs (a longer
  // sequence goes alone).
  static RewardModel load(const std::string& dir, at::ScalarType dtype, at::Device device, int64_t token_budget);
  // A loaded sequence-classification model without tokenizer or template: it scores ids (score,
  // score_padded); encode throws.
  RewardModel(Transformer model, int64_t token_budget);

  // The conversation's ids: `conversation` (a prompt's messages, or one user turn holding `question` when
  // empty), then an assistant turn holding `response`, rendered by the template without a generation
  // prompt and encoded with special-token text as special tokens (the template writes BOS itself).
  std::vector<int64_t> encode(const std::vector<ChatMessage>& conversation, const std::string& question,
                              const std::string& response) const;
  // encode() of each of `texts` on at::get_num_threads() threads (the tokenizer and the template are safe
  // to share): a step's 256 new conversations take about half a second on one core. The first error is
  // rethrown once every thread has stopped.
  struct Text {
    const std::vector<ChatMessage>& conversation;
    const std::string& question;
    const std::string& response;
  };
  std::vector<std::vector<int64_t>> encode(const std::vector<Text>& texts) const;
  // score() of encode(texts), the two overlapped: the texts are encoded on those threads in order while
  // the forwards of the ones done are packed and queued, so the host's encoding runs beside the device's
  // forwards instead of before them. The same scores as score(encode(texts)).
  std::vector<double> score_texts(const std::vector<Text>& texts, int64_t* tokens_forwarded = nullptr) const;

  // One score per sequence of ids, read at its last token. Sequences are packed in order into forwards
  // of at most token_budget tokens, queued without waiting (ids through pinned memory, the scores read
  // back once at the end), so the host packs the next forward while the device runs this one. Consecutive
  // sequences that begin with the same kMinSharedTokens tokens or more (a step's answers to one prompt)
  // share them: those run once as a prefix each continues, with the same scores. tokens_forwarded: where
  // given, the tokens the forwards ran. An empty sequence or an id outside the vocabulary throws
  // std::invalid_argument naming it (the forwards of the sequences before it may have been queued;
  // tokens_forwarded is then left as it was).
  std::vector<double> score(const std::vector<std::vector<int64_t>>& sequences,
                            int64_t* tokens_forwarded = nullptr) const;
  static constexpr int64_t kMinSharedTokens = 16;
  // The keys a forward's sequences attend over, prefixes counted for each, at most this many times
  // token_budget: the gathered keys and values stay a fraction of the forward's activations (a key holds
  // 2 Hkv hd values, a token's MLP 2 x intermediate: 512 bytes against 19 KB at Qwen2.5-0.5B).
  static constexpr int64_t kKeysPerToken = 8;
  // Off: every sequence runs whole (what the shared prefixes save is measured against it).
  void set_share_prefixes(bool on) { share_prefixes_ = on; }
  // Off: the last layer runs over every token, the scores read after it (what running it over each
  // sequence's last token alone saves is measured against it).
  void set_last_layer_scored_rows_only(bool on) { scored_rows_only_ = on; }

  // A padded batch as transformers scores it: ids (B, T) int64, mask (B, T) 0/1 (1 = real token), RoPE
  // positions counting real tokens from 0. Returns (B) float32 scores, each row's at last_real_tokens.
  at::Tensor score_padded(const at::Tensor& ids, const at::Tensor& mask) const;

  const Transformer& model() const { return *model_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  int64_t token_budget() const { return token_budget_; }

 private:
  class EncodeAhead;
  // score()'s pass over `count` sequences, sequence_at(i) giving the i-th: asked in order, a few past the
  // last packed, so it may wait for a sequence still being made.
  std::vector<double> score_in_order(size_t count,
                                     const std::function<const std::vector<int64_t>&(size_t)>& sequence_at,
                                     int64_t* tokens_forwarded) const;

  std::shared_ptr<Transformer> model_;
  std::shared_ptr<Tokenizer> tokenizer_;
  std::shared_ptr<HfChatTemplate> chat_;
  at::Device device_ = at::kCPU;
  int64_t token_budget_ = 0;
  bool share_prefixes_ = true;
  bool scored_rows_only_ = true;
};

}  // namespace rlt
