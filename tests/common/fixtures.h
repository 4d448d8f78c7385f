// The HF fixtures folder (tokenizers/, templates/, data/: real published tokenizer files, chat templates
// and datasets) the build was configured with: -DRLT_FIXTURES_DIR, see tests/CMakeLists.txt. It is empty
// when the build found none; a test that reads the fixtures starts with RLT_SKIP_WITHOUT_FIXTURES(), so a
// checkout without them lists that test as skipped instead of failing on a missing file.
#pragma once

#include <gtest/gtest.h>

#include <string>

#define RLT_SKIP_WITHOUT_FIXTURES()          \
  if (std::string(RLT_FIXTURES_DIR).empty()) \
  GTEST_SKIP() << "no HF fixtures: configure with -DRLT_FIXTURES_DIR=<folder> (tests/CMakeLists.txt)"
