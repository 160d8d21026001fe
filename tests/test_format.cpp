// common/format.h: the one way counts, bytes and durations are written for people.
#include "common/format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

using namespace malleus;

TEST(Format, CountsTakeThreeSignificantDigitsAndADecimalSuffix) {
  EXPECT_EQ(format_count(0), "0");
  EXPECT_EQ(format_count(950), "950");
  EXPECT_EQ(format_count(12345), "12.3k");
  EXPECT_EQ(format_count(1.2e6), "1.2M");
  EXPECT_EQ(format_count(124.44e6), "124M");
  EXPECT_EQ(format_count(1.2e9), "1.2B");
  EXPECT_EQ(format_count(-12345), "-12.3k");
  EXPECT_EQ(format_count(0.25), "0.25");
}

TEST(Format, CountsPickTheSuffixOfTheRoundedValue) {
  EXPECT_EQ(format_count(999.6), "1k");
  EXPECT_EQ(format_count(999'999), "1M");
  EXPECT_EQ(format_count(999.4e6), "999M");
}

TEST(Format, BytesUseBinaryUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(1048576), "1.00 MiB");
  EXPECT_EQ(format_bytes(40.0 * (1 << 30)), "40.00 GiB");
  EXPECT_EQ(format_bytes(2.0 * (1LL << 40)), "2.00 TiB");
  EXPECT_EQ(format_bytes(-1536), "-1.50 KiB");
  // A re-plan that moved 1.2e9 bytes once read "1.20BB" (a count's suffix, then bytes).
  EXPECT_EQ(format_bytes(1.2e9), "1.12 GiB");
}

TEST(Format, BytesPickTheUnitOfTheRoundedValue) {
  EXPECT_EQ(format_bytes(1048575), "1.00 MiB");
  EXPECT_EQ(format_bytes(1023), "1023 B");
}

TEST(Format, DurationsGrowCoarserWithTheirLength) {
  EXPECT_EQ(format_duration(0), "0 ms");
  EXPECT_EQ(format_duration(0.25), "250 ms");
  EXPECT_EQ(format_duration(0.9996), "1.00 s");
  EXPECT_EQ(format_duration(12.346), "12.35 s");
  EXPECT_EQ(format_duration(59.996), "1m00s");
  EXPECT_EQ(format_duration(123), "2m03s");
  EXPECT_EQ(format_duration(3599.6), "1h00m");
  EXPECT_EQ(format_duration(3720), "1h02m");
  EXPECT_EQ(format_duration(-0.25), "-250 ms");
}

TEST(Format, NumbersThatAreNotFiniteReadNA) {
  for (double x : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_EQ(format_count(x), "n/a");
    EXPECT_EQ(format_bytes(x), "n/a");
    EXPECT_EQ(format_duration(x), "n/a");
  }
}
