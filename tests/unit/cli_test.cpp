// The colibri-node binary on tiny model directories: a valid one runs, a corrupted one ends with
// a non-zero status and exactly one error line naming the file and tensor or field at fault.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "model_writer.h"

extern char** environ;

namespace colibri {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct RunResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out, err;
};

// Runs colibri-node with `args`, stdout and stderr captured in files under `scratch`.
RunResult run_node(const std::vector<std::string>& args, const fs::path& scratch) {
  const fs::path out_path = scratch / "stdout.txt", err_path = scratch / "stderr.txt";
  std::vector<std::string> argv_strings = {COLIBRI_NODE_BINARY};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = -1;
  const int spawn_error = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  RunResult result;
  if (spawn_error != 0) {
    ADD_FAILURE() << "cannot start " << argv[0] << ": " << std::strerror(spawn_error);
    return result;
  }

  // A hang is a failure, not a stuck test run.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "colibri-node did not finish within 120 s";
      return result;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  result.out = test::read_file_bytes(out_path);
  result.err = test::read_file_bytes(err_path);
  return result;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    out.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return out;
}

TEST(Cli, ValidModelGenerates) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const RunResult r = run_node(
      {"--model", dir.path().string(), "--prompt-ids", "3,4,5", "--ngen", "3", "--ignore-eos"},
      scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // Three token ids, each followed by a space.
  const auto out_lines = lines(r.out);
  ASSERT_EQ(out_lines.size(), 1u) << r.out;
  int tokens = 0;
  for (char ch : out_lines[0]) tokens += ch == ' ';
  EXPECT_EQ(tokens, 3) << r.out;
}

struct CliCase {
  const char* name;
  std::function<void(const fs::path& dir, const test::TinyModel&)> corrupt;
  std::function<std::vector<std::string>(const fs::path& dir, const test::TinyModel&)> expected;
};

// What gtest prints for the parameter, and so the case name ctest shows.
void PrintTo(const CliCase& c, std::ostream* os) {
  *os << c.name;
}

const std::string kQb1 = "model.layers.1.self_attn.q_b_proj.weight";

const CliCase kCliCases[] = {
    {"TruncatedShard",
     [](const fs::path& dir, const test::TinyModel& m) {
       const fs::path shard = dir / m.shard_name(1);
       fs::resize_file(shard, fs::file_size(shard) - 6);
     },
     [](const fs::path& dir, const test::TinyModel& m) {
       return std::vector<std::string>{(dir / m.shard_name(1)).string(),
                                       "tensor '" + m.tensors.back().name + "'"};
     }},
    {"WrongShape",
     [](const fs::path& dir, const test::TinyModel& m) {
       test::rewrite_header(dir / m.shard_file(kQb1), [](test::json& h) {
         h[kQb1]["shape"] = {8, 12};
       });
     },
     [](const fs::path& dir, const test::TinyModel& m) {
       return std::vector<std::string>{(dir / m.shard_file(kQb1)).string(),
                                       "tensor '" + kQb1 + "' has shape [8, 12]"};
     }},
    {"ConfigMissingField",
     [](const fs::path& dir, const test::TinyModel&) {
       test::json config = test::read_json_file(dir / "config.json");
       config.erase("hidden_size");
       test::write_json_file(dir / "config.json", config);
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "'hidden_size'"};
     }},
};

class CliCorrupt : public ::testing::TestWithParam<CliCase> {};

TEST_P(CliCorrupt, ExitsNonZeroWithOneErrorLine) {
  const CliCase& c = GetParam();
  test::TempDir dir, scratch;
  const test::TinyModel model;
  model.write(dir.path());
  c.corrupt(dir.path(), model);
  const RunResult r = run_node(
      {"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "2"}, scratch.path());
  EXPECT_EQ(r.exit_code, 1) << r.err;
  const auto err_lines = lines(r.err);
  ASSERT_EQ(err_lines.size(), 1u) << r.err;
  EXPECT_THAT(err_lines[0], StartsWith("colibri-node: error: "));
  for (const auto& part : c.expected(dir.path(), model)) EXPECT_THAT(err_lines[0], HasSubstr(part));
  EXPECT_EQ(r.out, "") << "nothing generated";
}

INSTANTIATE_TEST_SUITE_P(Cli, CliCorrupt, ::testing::ValuesIn(kCliCases));

}  // namespace
}  // namespace colibri
