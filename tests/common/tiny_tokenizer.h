// A small corpus of tool-use traces and code, and the tool tags, for tests that need a trained tokenizer.
#pragma once

#include <string>
#include <vector>

namespace rlt::testing {

inline const std::vector<std::string> kToolTags = {"<code>", "</code>", "<interpreter>", "</interpreter>"};

inline std::vector<std::string> tool_corpus() {
  std::vector<std::string> docs;
  for (int i = 0; i < 200; ++i) {
    const std::string a = std::to_string(100 + 7 * i), b = std::to_string(311 + 13 * i);
    const std::string c = std::to_string((100 + 7 * i) * (311 + 13 * i));
    docs.push_back("User: What is " + a + " * " + b + "?\nAssistant: <code>\nprint(" + a + " * " + b +
                   ")\n</code>\n<interpreter>\n" + c + "\n</interpreter>\nAnswer: \\boxed{" + c + "}");
    docs.push_back("def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n```python\nprint(f(3))\n```\n");
  }
  return docs;
}

}  // namespace rlt::testing
