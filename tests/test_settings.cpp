// The settings schema: checked parsing, shortest round-trip numbers, one table for strings and diffs.
#include "helpers.hpp"
#include "qkv/core/settings.hpp"
#include "qkv/train/settings.hpp"

namespace qkv::test {
namespace {

TEST(Settings, NumbersAreParsedWholeAndInRange) {
  EXPECT_EQ(parse_int("42", "n"), 42);
  EXPECT_EQ(parse_int("-7", "n"), -7);
  for (const char* bad : {"", "3junk", " 3", "4.0", "99999999999999999999999", "0x10"})
    EXPECT_THROW(parse_int(bad, "n"), ValueError) << bad;
  EXPECT_THROW(parse_uint("-1", "seed"), ValueError);
  EXPECT_EQ(parse_uint("18446744073709551615", "seed"), 18446744073709551615ull);
  EXPECT_DOUBLE_EQ(parse_real("5e-5", "lr"), 5e-5);
  for (const char* bad : {"", "abc", "1e400", "nan", "inf", "-inf", "0.1x"}) EXPECT_THROW(parse_real(bad, "lr"), ValueError) << bad;
  EXPECT_TRUE(parse_bool("True", "b"));
  EXPECT_FALSE(parse_bool("false", "b"));
  EXPECT_THROW(parse_bool("yes", "b"), ValueError);
  try {
    parse_int("4junk", "n_head");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_STREQ(e.what(), "n_head = \"4junk\" is not an integer");
  }
}

TEST(Settings, RealsPrintInTheShortestExactForm) {
  EXPECT_EQ(format_real(0.05), "0.05");
  EXPECT_EQ(format_real(5e-5), "5e-05");
  EXPECT_EQ(format_real(0.1), "0.1");
  for (double v : {0.1, 1.0 / 3.0, 2.5e-7, 123456.789}) EXPECT_EQ(parse_real(format_real(v), "v"), v);
}

TEST(Settings, OneTableRoundTripsEveryTrainingSetting) {
  train::TrainSettings s;
  s.learning_rate = 5e-5;
  s.min_learning_rate = 1e-5;
  s.model.qkv_bias = true;
  const auto strings = s.to_strings();
  EXPECT_EQ(strings.size(), train::train_settings_schema().size());
  EXPECT_EQ(strings.at("learning_rate"), "5e-05");
  const train::TrainSettings back = train::TrainSettings::from_strings(strings);
  EXPECT_EQ(back.to_strings(), strings);
  auto missing = strings;
  missing.erase("seed");
  EXPECT_THROW(train::TrainSettings::from_strings(missing), ValueError);
  // Overrides are applied to the strings first and validated once: lowering lr below the old min-lr together
  // with min-lr is fine, though either change alone would be invalid.
  train::TrainSettings old;
  old.learning_rate = 1e-3;
  old.min_learning_rate = 1e-4;
  auto changed = old.to_strings();
  changed["learning_rate"] = "5e-5";
  changed["min_learning_rate"] = "1e-5";
  EXPECT_NO_THROW(train::TrainSettings::from_strings(changed));
  const auto diffs = train::settings_differences(old, train::TrainSettings::from_strings(changed), false);
  ASSERT_EQ(diffs.size(), 2u);
  EXPECT_EQ(diffs[0], "learning_rate: checkpoint 0.001, this run 5e-05");
  EXPECT_TRUE(train::settings_differences(old, train::TrainSettings::from_strings(changed), true).empty());
}

}  // namespace
}  // namespace qkv::test
