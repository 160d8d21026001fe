// common/format.h: the one way counts, bytes and durations are written for people.
#include "common/format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

using namespace malleus;

namespace {

// Each (value, text) pair: `format` writes the value as the text.
void expect_written(std::string (*format)(double),
                    std::initializer_list<std::pair<double, const char*>> cases) {
  for (const auto& [value, text] : cases) EXPECT_EQ(format(value), text) << "of " << value;
}

}  // namespace

TEST(Format, CountsTakeThreeSignificantDigitsAndADecimalSuffix) {
  expect_written(format_count, {{0, "0"},
                                {950, "950"},
                                {12345, "12.3k"},
                                {1.2e6, "1.2M"},
                                {124.44e6, "124M"},
                                {1.2e9, "1.2B"},
                                {-12345, "-12.3k"},
                                {0.25, "0.25"}});
}

TEST(Format, CountsPickTheSuffixOfTheRoundedValue) {
  expect_written(format_count, {{999.6, "1k"}, {999'999, "1M"}, {999.4e6, "999M"}});
}

TEST(Format, BytesUseBinaryUnits) {
  expect_written(
      format_bytes,
      {{0, "0 B"},
       {512, "512 B"},
       {1536, "1.50 KiB"},
       {1048576, "1.00 MiB"},
       {40.0 * (1 << 30), "40.00 GiB"},
       {2.0 * (1LL << 40), "2.00 TiB"},
       {-1536, "-1.50 KiB"},
       // A re-plan that moved 1.2e9 bytes once read "1.20BB" (a count's suffix, then bytes).
       {1.2e9, "1.12 GiB"}});
}

TEST(Format, BytesPickTheUnitOfTheRoundedValue) {
  expect_written(format_bytes, {{1048575, "1.00 MiB"}, {1023, "1023 B"}});
}

TEST(Format, DurationsGrowCoarserWithTheirLength) {
  expect_written(format_duration, {{0, "0 ms"},
                                   {0.25, "250 ms"},
                                   {0.9996, "1.00 s"},
                                   {12.346, "12.35 s"},
                                   {59.996, "1m00s"},
                                   {123, "2m03s"},
                                   {3599.6, "1h00m"},
                                   {3720, "1h02m"},
                                   {-0.25, "-250 ms"}});
}

TEST(Format, NumbersThatAreNotFiniteReadNA) {
  for (double x : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_EQ(format_count(x), "n/a");
    EXPECT_EQ(format_bytes(x), "n/a");
    EXPECT_EQ(format_duration(x), "n/a");
  }
}

TEST(Format, CountedNounsArePluralUnlessThereIsOne) {
  EXPECT_EQ(format_counted(1, "rank"), "1 rank");
  EXPECT_EQ(format_counted(3, "rank"), "3 ranks");
  EXPECT_EQ(format_counted(0, "step"), "0 steps");
  EXPECT_EQ(format_counted(-1, "step"), "-1 steps");
}
