// LoRA adapters; see lora.h.
#include "model/lora.h"

#include <sstream>
#include <stdexcept>

namespace rlt {

namespace {

const char* const kTargets[] = {"q", "k", "v", "o", "gate", "up", "down"};

}  // namespace

std::vector<std::string> LoraOptions::target_list() const {
  std::vector<std::string> out;
  std::stringstream ss(targets);
  std::string t;
  while (std::getline(ss, t, ',')) {
    const size_t b = t.find_first_not_of(" \t"), e = t.find_last_not_of(" \t");
    t = b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
    bool known = false;
    for (const char* k : kTargets) known = known || t == k;
    if (!known) throw std::invalid_argument("unknown target '" + t + "' (known: q, k, v, o, gate, up, down)");
    for (const auto& o : out) {
      if (o == t) throw std::invalid_argument("target '" + t + "' listed twice");
    }
    out.push_back(t);
  }
  return out;
}

void LoraOptions::check(const FieldFail& fail) const {
  try {
    if (target_list().empty()) fail("targets", "names no projection");
  } catch (const std::invalid_argument& e) {
    fail("targets", e.what());
  }
}

}  // namespace rlt
