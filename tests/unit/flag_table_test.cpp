// The command line's flag table (src/node/command_line.h) against the README's flag tables: every
// flag is in both, once, with the same default; and every row registers a CLI11 option.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>

#include "node/command_line.h"

namespace colibri {
namespace {

std::string without_backticks(std::string text) {
  std::erase(text, '`');
  return text;
}

// The README's rows "| `--flag ARG` | default | meaning |": flag -> default cells, one per row.
std::map<std::string, std::vector<std::string>> readme_flags() {
  const std::filesystem::path readme = std::filesystem::path(COLIBRI_SOURCE_DIR) / "README.md";
  std::ifstream in(readme);
  EXPECT_TRUE(in) << readme;
  const std::regex row(R"(^\| `(--[a-z0-9-]+)[^`]*` \| (.*?) \| .*\|$)");
  std::map<std::string, std::vector<std::string>> flags;
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_match(line, m, row)) flags[m[1]].push_back(without_backticks(m[2]));
  }
  return flags;
}

TEST(FlagTable, EveryFlagIsInTheReadmeOnceWithItsDefault) {
  const auto readme = readme_flags();
  ASSERT_GT(readme.size(), 30u) << "the README's flag tables were not found";
  std::set<std::string> names;
  for (const FlagRow& row : flag_table()) {
    EXPECT_TRUE(names.insert(row.name).second) << row.name << " is in the table twice";
    const auto it = readme.find(row.name);
    if (it == readme.end()) {
      ADD_FAILURE() << row.name << " is missing from the README's flag tables";
      continue;
    }
    ASSERT_EQ(it->second.size(), 1u)
        << row.name << " has " << it->second.size() << " rows in the README";
    EXPECT_EQ(it->second[0], without_backticks(row.shown_default))
        << "the README's default of " << row.name;
  }
  for (const auto& [name, defaults] : readme)
    EXPECT_TRUE(names.count(name)) << name << " is in the README but not a flag";
}

TEST(FlagTable, EveryRowRegistersItsOptionAndComparesAValue) {
  CLI::App app;
  CommandLine line;
  add_flags(app, line);
  for (const FlagRow& row : flag_table()) {
    const CLI::Option* o = app.get_option_no_throw(row.name);
    ASSERT_NE(o, nullptr) << row.name;
    EXPECT_FALSE(row.help.empty()) << row.name;
    EXPECT_TRUE(row.value) << row.name;
  }
  // A value given on the command line is what the handshake compares.
  const char* argv[] = {"colibri-node", "--wire", "bf16", "--ngen", "7", "--seed", "0012"};
  app.parse(int(std::size(argv)), const_cast<char**>(argv));
  line.seed = 12;
  std::map<std::string, AgreedSetting> settings;
  for (const AgreedSetting& s : agreed_settings(app, line)) settings[s.flag] = s;
  EXPECT_EQ(settings.at("--wire").value, "bf16");
  EXPECT_TRUE(settings.at("--wire").given);
  EXPECT_EQ(settings.at("--wire").scope, AgreedSetting::kJob);
  EXPECT_EQ(settings.at("--ngen").value, "7");
  EXPECT_EQ(settings.at("--ngen").scope, AgreedSetting::kCoordinator);
  EXPECT_EQ(settings.at("--seed").value, "12");
  EXPECT_FALSE(settings.at("--temp").given);
  EXPECT_EQ(settings.count("--ram-gb"), 0u) << "each rank's own budget is not compared";
  EXPECT_EQ(settings.at("--kv-tokens").scope, AgreedSetting::kCoordinator);
  line.split_linears = true;  // the expert ranks then keep a copy of the cache the pool's size
  for (const AgreedSetting& s : agreed_settings(app, line)) {
    if (s.flag == "--kv-tokens") {
      EXPECT_EQ(s.scope, AgreedSetting::kJob);
    }
  }
}

}  // namespace
}  // namespace colibri
