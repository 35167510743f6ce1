#include <gtest/gtest.h>

#include <cstdio>

#include "support.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("[dsa] random seed %llu (set DSA_TEST_SEED to repeat)\n",
              static_cast<unsigned long long>(dsa::testing::test_seed()));
  if (dsa::testing::gpu_available()) {
    std::printf("[dsa] GPU tests run on device 0\n");
  } else {
    std::printf("[dsa] GPU tests will be skipped: %s\n", dsa::testing::gpu_skip_reason().c_str());
  }
  return RUN_ALL_TESTS();
}
