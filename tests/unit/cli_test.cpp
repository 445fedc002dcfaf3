// The colibri-node binary on tiny model directories: a valid one runs, a corrupted one ends with
// a non-zero status and exactly one error line naming the file and tensor or field at fault.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "model_writer.h"
#include "node/command_line.h"

extern char** environ;

namespace colibri {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;

struct RunResult {
  int exit_code = -1;  // -1: killed by a signal or timed out
  std::string out, err;
  double elapsed_s = 0;
};

// Runs colibri-node with `args`, stdout and stderr captured in files under `scratch` (stdout to
// `stdout_path` instead when given, e.g. /dev/full).
RunResult run_node(const std::vector<std::string>& args, const fs::path& scratch,
                   const fs::path& stdout_path = {}) {
  const fs::path out_path = stdout_path.empty() ? scratch / "stdout.txt" : stdout_path;
  const fs::path err_path = scratch / "stderr.txt";
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
  const auto start = std::chrono::steady_clock::now();
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
  result.elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (stdout_path.empty()) result.out = test::read_file_bytes(out_path);
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

// A refusal comes at start-up or at load, in well under a second on this tiny model; the bound is
// loose for a loaded machine and still far below a hang.
constexpr double kQuickSeconds = 20;

// Sets value `index` of F32 tensor `name` in its shard.
void poke_f32(const fs::path& dir, const test::TinyModel& m, const std::string& name, size_t index,
              float value) {
  const fs::path file = dir / m.shard_file(name);
  test::SafetensorsParts parts = test::split_safetensors(file);
  const uint64_t begin = parts.header[name]["data_offsets"][0].get<uint64_t>();
  std::memcpy(parts.data.data() + begin + 4 * index, &value, 4);
  test::write_file_bytes(file, test::encode_safetensors(parts.header, parts.data));
}

// Replaces `path` with a FIFO (a writer never comes: reading it would block forever).
void make_fifo(const fs::path& path) {
  fs::remove(path);
  if (::mkfifo(path.c_str(), 0644) != 0) throw std::runtime_error("mkfifo " + path.string());
}

void edit_config(const fs::path& dir, const std::function<void(test::json&)>& edit) {
  test::json config = test::read_json_file(dir / "config.json");
  edit(config);
  test::write_json_file(dir / "config.json", config);
}

const std::string kEmbed = "model.embed_tokens.weight";
const std::string kExpert = "model.layers.1.mlp.experts.2.up_proj.weight";
const std::string kNorm = "model.layers.0.input_layernorm.weight";

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
    // An error quoting a string from the input stays one line: its newline is escaped.
    {"ConfigStringWithANewline",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) {
         const char* key = c.contains("rope_parameters") ? "rope_parameters" : "rope_scaling";
         c[key] = {{"rope_type", "yarn\nfactor: 1"}, {"factor", 2.0}};
       });
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(),
                                       "rope type 'yarn\\nfactor: 1'"};
     }},
    // ---- numbers in config.json
    {"RoutedScalingFactorZero",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) { c["routed_scaling_factor"] = 0.0; });
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "'routed_scaling_factor'",
                                       "must be > 0"};
     }},
    {"RoutedScalingFactorNegative",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) { c["routed_scaling_factor"] = -2.5; });
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "'routed_scaling_factor'"};
     }},
    {"RmsNormEpsOverflowsToInf",
     [](const fs::path& dir, const test::TinyModel&) {
       std::string text = test::read_file_bytes(dir / "config.json");
       const size_t at = text.find("1e-06");
       if (at == std::string::npos) throw std::runtime_error("rms_norm_eps not found");
       text.replace(at, 5, "1e999");
       test::write_file_bytes(dir / "config.json", text);
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "overflow", "1e999"};
     }},
    // ---- a checkpoint that does not match its config
    {"FewerLayersInConfigThanInCheckpoint",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) {
         c["num_hidden_layers"] = 1;
         c["mlp_layer_types"] = {"dense"};
         c["indexer_types"] = {"full"};
       });
     },
     [](const fs::path&, const test::TinyModel&) {
       return std::vector<std::string>{"tensor 'model.layers.1.", "belongs to layer 1",
                                       "num_hidden_layers = 1"};
     }},
    {"SharedExpertTensorsWithNSharedExpertsZero",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) { c["n_shared_experts"] = 0; });
     },
     [](const fs::path&, const test::TinyModel&) {
       return std::vector<std::string>{"tensor 'model.layers.1.mlp.shared_experts.",
                                       "n_shared_experts = 0"};
     }},
    {"MoreRoutedExpertsInCheckpointThanInConfig",
     [](const fs::path& dir, const test::TinyModel&) {
       edit_config(dir, [](test::json& c) {
         c["n_routed_experts"] = 2;
         c["n_group"] = 1;
       });
     },
     [](const fs::path&, const test::TinyModel&) {
       return std::vector<std::string>{"tensor 'model.layers.1.mlp.experts.2.",
                                       "n_routed_experts = 2"};
     }},
    // ---- NaN / Inf in weights, refused at load naming the tensor
    {"NanInEmbeddings",
     [](const fs::path& dir, const test::TinyModel& m) {
       poke_f32(dir, m, kEmbed, 37, std::nanf(""));
     },
     [](const fs::path& dir, const test::TinyModel& m) {
       return std::vector<std::string>{(dir / m.shard_file(kEmbed)).string(),
                                       "tensor '" + kEmbed + "'", "nan at index 37"};
     }},
    {"InfInANorm",
     [](const fs::path& dir, const test::TinyModel& m) { poke_f32(dir, m, kNorm, 3, -INFINITY); },
     [](const fs::path&, const test::TinyModel&) {
       return std::vector<std::string>{"tensor '" + kNorm + "'", "-inf at index 3"};
     }},
    {"NanInARoutedExpert",
     [](const fs::path& dir, const test::TinyModel& m) {
       poke_f32(dir, m, kExpert, 100, std::nanf(""));
     },
     [](const fs::path&, const test::TinyModel&) {
       return std::vector<std::string>{"tensor '" + kExpert + "'", "nan at index 100"};
     }},
    // ---- file kinds: a FIFO never blocks, a directory is not "invalid JSON"
    {"ConfigIsAFifo",
     [](const fs::path& dir, const test::TinyModel&) { make_fifo(dir / "config.json"); },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "FIFO",
                                       "not a regular file"};
     }},
    {"ConfigIsADirectory",
     [](const fs::path& dir, const test::TinyModel&) {
       fs::remove(dir / "config.json");
       fs::create_directory(dir / "config.json");
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(), "is a directory"};
     }},
    {"ConfigIsASymlinkLoop",
     [](const fs::path& dir, const test::TinyModel&) {
       fs::remove(dir / "config.json");
       fs::create_symlink(dir / "loop", dir / "config.json");
       fs::create_symlink(dir / "config.json", dir / "loop");
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "config.json").string(),
                                       "Too many levels of symbolic links"};
     }},
    {"GenerationConfigIsAFifo",
     [](const fs::path& dir, const test::TinyModel&) { make_fifo(dir / "generation_config.json"); },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "generation_config.json").string(), "FIFO"};
     }},
    {"ShardIsAFifo",
     [](const fs::path& dir, const test::TinyModel& m) { make_fifo(dir / m.shard_name(1)); },
     [](const fs::path& dir, const test::TinyModel& m) {
       return std::vector<std::string>{(dir / m.shard_name(1)).string(), "FIFO"};
     }},
    {"ShardIsADirectory",
     [](const fs::path& dir, const test::TinyModel& m) {
       fs::remove(dir / m.shard_name(0));
       fs::create_directory(dir / m.shard_name(0));
     },
     [](const fs::path& dir, const test::TinyModel& m) {
       return std::vector<std::string>{(dir / m.shard_name(0)).string(), "is a directory"};
     }},
    {"IndexIsAFifo",
     [](const fs::path& dir, const test::TinyModel&) {
       make_fifo(dir / "model.safetensors.index.json");
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "model.safetensors.index.json").string(), "FIFO"};
     }},
    {"IndexIsASymlinkLoop",
     [](const fs::path& dir, const test::TinyModel&) {
       const fs::path index = dir / "model.safetensors.index.json";
       fs::remove(index);
       fs::create_symlink(index, index);
     },
     [](const fs::path& dir, const test::TinyModel&) {
       return std::vector<std::string>{(dir / "model.safetensors.index.json").string(),
                                       "Too many levels of symbolic links"};
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
  EXPECT_LT(r.elapsed_s, kQuickSeconds);
  const auto err_lines = lines(r.err);
  ASSERT_EQ(err_lines.size(), 1u) << r.err;
  EXPECT_THAT(err_lines[0], StartsWith("colibri-node: error: "));
  for (const auto& part : c.expected(dir.path(), model)) EXPECT_THAT(err_lines[0], HasSubstr(part));
  EXPECT_EQ(r.out, "") << "nothing generated";
}

INSTANTIATE_TEST_SUITE_P(Cli, CliCorrupt, ::testing::ValuesIn(kCliCases));

// The embedded model (it has a tokenizer; the tiny test model has none).
const fs::path kEmbeddedModel =
    fs::path(COLIBRI_TEST_DATA) / ".." / ".." / "models" / "glm5-tiny-kjv";

// One error line "colibri-node: error: ..." holding every part, exit 1, quickly, nothing on stdout
// (refusals after start-up follow the ranks' "memory: " lines).
void expect_refused(const RunResult& r, const std::vector<std::string>& parts) {
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.elapsed_s, kQuickSeconds);
  auto err_lines = lines(r.err);
  std::erase_if(err_lines, [](const std::string& line) { return line.rfind("memory: ", 0) == 0; });
  ASSERT_EQ(err_lines.size(), 1u) << r.err;
  EXPECT_THAT(err_lines[0], StartsWith("colibri-node: error: "));
  for (const auto& part : parts) EXPECT_THAT(err_lines[0], HasSubstr(part));
  EXPECT_EQ(r.out, "");
}

// ---- numbers and flag combinations ---------------------------------------------------------

struct ArgsCase {
  const char* name;
  std::vector<std::string> args;
  std::vector<std::string> expected;
};
void PrintTo(const ArgsCase& c, std::ostream* os) {
  *os << c.name;
}

const ArgsCase kArgsCases[] = {
    {"RankTimeoutNan", {"--rank-timeout", "nan"}, {"--rank-timeout nan", "(0, "}},
    {"RankTimeoutInf", {"--rank-timeout", "inf"}, {"--rank-timeout inf"}},
    {"RankTimeoutAbsurd", {"--rank-timeout", "1e300"}, {"--rank-timeout"}},
    {"RamGbNan", {"--ram-gb", "nan"}, {"--ram-gb nan"}},
    {"RamGbOverflows", {"--ram-gb", "1e300"}, {"--ram-gb", "GiB in [0, 1048576]"}},
    {"PinGbInf", {"--ram-gb", "1", "--pin-gb", "inf"}, {"--pin-gb inf"}},
    {"PinLargerThanRam", {"--ram-gb", "1", "--pin-gb", "2"}, {"--pin-gb 2", "--ram-gb 1"}},
    {"PinWithoutRam", {"--pin-gb", "0.5"}, {"--pin-gb 0.5 needs --ram-gb"}},
    {"PcieGbpsZero", {"--pcie-gbps", "0"}, {"--pcie-gbps 0", "GB/s in (0, 10000]"}},
    {"CpuExpertGbpsNan", {"--cpu-expert-gbps", "nan"}, {"--cpu-expert-gbps nan"}},
    {"SeedNegative", {"--seed", "-1"}, {"--seed '-1'"}},
    {"SeedPastUint64", {"--seed", "18446744073709551616"}, {"--seed '18446744073709551616'"}},
    {"SeedNotAnInteger", {"--seed", "1.5"}, {"--seed '1.5'"}},
    {"SeedPlusSign", {"--seed", "+3"}, {"--seed '+3'"}},
    {"TempNan", {"--temp", "nan"}, {"--temp nan"}},
    {"TempNegative", {"--temp", "-0.5"}, {"--temp -0.5"}},
    {"TopPZero", {"--top-p", "0"}, {"--top-p 0", "(0, 1]"}},
    {"TopPAboveOne", {"--top-p", "1.5"}, {"--top-p 1.5"}},
    {"TopPNan", {"--top-p", "nan"}, {"--top-p nan"}},
    {"ThinkWithoutChat",
     {"--think", "off"},
     {"--think off needs --chat, --chat-format or --serve"}},
    {"ChatFormatWithPromptIds", {"--chat-format"}, {"--chat-format", "--prompt-ids"}},
    {"KvFileWithoutChat", {"--kv-file", "c.kv"}, {"--kv-file c.kv needs --chat"}},
    {"LogitsOutWithScore",
     {"--score", "x.txt", "--logits-out", "l.npy"},
     {"--logits-out", "--score"}},
    {"ReplicasWithoutHeat", {"--replicas", "2"}, {"--replicas 2 needs --placement heat"}},
    {"RepinAlone", {"--placement", "heat", "--repin-every", "8"}, {"--repin-every", "mpirun"}},
    {"TransportNcclAlone", {"--transport", "nccl"}, {"--transport nccl", "a single process"}},
    {"ThinkEmpty", {"--think", ""}, {"--think is given an empty value"}},
    {"LayoutEmpty", {"--layout", ""}, {"--layout is given an empty value"}},
};

class CliArgs : public ::testing::TestWithParam<ArgsCase> {};

TEST_P(CliArgs, RefusedAtStartWithTheFlagNamed) {
  const ArgsCase& c = GetParam();
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  std::vector<std::string> args = {"--model", dir.path().string(), "--ngen", "2"};
  // --score takes the place of --prompt-ids (they exclude each other).
  const bool score = std::find(c.args.begin(), c.args.end(), "--score") != c.args.end();
  if (!score) args.insert(args.end(), {"--prompt-ids", "1,2"});
  args.insert(args.end(), c.args.begin(), c.args.end());
  expect_refused(run_node(args, scratch.path()), c.expected);
}

INSTANTIATE_TEST_SUITE_P(Cli, CliArgs, ::testing::ValuesIn(kArgsCases));

TEST(CliArgs, EmptyPromptIsRefusedNotReplacedByTheDefault) {
  test::TempDir scratch;
  expect_refused(
      run_node({"--model", kEmbeddedModel.string(), "--prompt", "", "--ngen", "2"}, scratch.path()),
      {"--prompt is empty"});
}

TEST(CliArgs, EmptyPromptIdsAreRefusedNotReplacedByTheDefaultPrompt) {
  test::TempDir scratch;
  expect_refused(run_node({"--model", kEmbeddedModel.string(), "--prompt-ids", "", "--ngen", "2"},
                          scratch.path()),
                 {"--prompt-ids is given an empty value"});
}

// Every flag the table gives to one kind of run (generation from the command line, --serve, a run
// with a GPU), given for another, is refused naming it: it would be ignored.
TEST(CliArgs, AFlagForAnotherKindOfRunIsRefused) {
  const std::map<std::string, std::string> values = {{"--prompt", "x"},
                                                     {"--prompt-ids", "1,2"},
                                                     {"--chat", ""},
                                                     {"--score", "x.txt"},
                                                     {"--chat-format", ""},
                                                     {"--ngen", "2"},
                                                     {"--temp", "0.5"},
                                                     {"--top-p", "0.9"},
                                                     {"--seed", "3"},
                                                     {"--ignore-eos", ""},
                                                     {"--summary", ""},
                                                     {"--kv-file", "c.kv"},
                                                     {"--logits-out", "l.npy"},
                                                     {"--output", "out.txt"},
                                                     {"--sequences", "2"},
                                                     {"--host", "127.0.0.1"},
                                                     {"--port", "8081"},
                                                     {"--api-key", "k"},
                                                     {"--max-batch-tokens", "64"},
                                                     {"--max-itl-ms", "20"},
                                                     {"--max-queue", "8"},
                                                     {"--max-body-mb", "2"},
                                                     {"--no-prefix-cache", ""},
                                                     {"--kv-cache-dir", "kv"},
                                                     {"--kv-cache-dir-gb", "1"},
                                                     {"--vram-gb", "1"},
                                                     {"--pcie-gbps", "20"},
                                                     {"--cpu-expert-gbps", "5"},
                                                     {"--max-connections", "8"},
                                                     {"--max-client-connections", "4"},
                                                     {"--request-timeout", "5"}};
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  int checked = 0;
  for (const FlagRow& row : flag_table()) {
    if (row.use == FlagUse::kAny) continue;
    const auto value = values.find(row.name);
    if (value == values.end()) {
      ADD_FAILURE() << row.name << ": no value to try it with";
      continue;
    }
    std::vector<std::string> args = {"--model", dir.path().string()};
    std::string expected;
    if (row.use == FlagUse::kOffline) {
      args.push_back("--serve");
      expected = "does not apply to --serve";
    } else {
      args.insert(args.end(), {"--prompt-ids", "1,2", "--ngen", "2"});
      expected = row.use == FlagUse::kServe ? "is a --serve flag" : "applies to a run with a GPU";
    }
    args.push_back(row.name);
    if (!value->second.empty()) args.push_back(value->second);
    SCOPED_TRACE(row.name);
    expect_refused(run_node(args, scratch.path()), {row.name + " " + expected});
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

// Sets an environment variable for one scope (the colibri-node started inherits it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedEnv() { ::unsetenv(name_); }

 private:
  const char* name_;
};

TEST(CliArgs, EmptyApiKeyIsRefusedNotAnOpenServer) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  expect_refused(
      run_node({"--model", dir.path().string(), "--serve", "--api-key", ""}, scratch.path()),
      {"--api-key is empty"});
  const ScopedEnv empty("COLIBRI_API_KEY", "");
  expect_refused(run_node({"--model", dir.path().string(), "--serve"}, scratch.path()),
                 {"COLIBRI_API_KEY is set but empty"});
}

// --split-linears and --coordinator-gpu move the KV cache off the coordinator's CPU copy that
// the files hold.
TEST(CliArgs, KvFilesAreRefusedWhereTheKvCacheIsNotTheCoordinatorsCpuCopy) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const std::string kv = (scratch.path() / "kv").string();
  expect_refused(
      run_node({"--model", dir.path().string(), "--serve", "--kv-cache-dir", kv, "--split-linears"},
               scratch.path()),
      {"--kv-cache-dir", "--split-linears"});
  expect_refused(run_node({"--model", dir.path().string(), "--serve", "--kv-cache-dir-gb", "2"},
                          scratch.path()),
                 {"--kv-cache-dir-gb", "give the directory"});
}

TEST(CliArgs, ConnectionLimitsOutOfRangeAreRefused) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const auto serve = [&](const std::vector<std::string>& more) {
    std::vector<std::string> args = {"--model", dir.path().string(), "--serve"};
    args.insert(args.end(), more.begin(), more.end());
    return run_node(args, scratch.path());
  };
  expect_refused(serve({"--request-timeout", "0"}), {"--request-timeout 0", "(0, 3600]"});
  expect_refused(serve({"--request-timeout", "nan"}), {"--request-timeout nan"});
  // Ranges checked by the option parser: its usage exit code, one line naming the flag.
  for (const auto& [flag, value] :
       {std::pair{"--max-connections", "0"}, std::pair{"--max-client-connections", "-1"}}) {
    const RunResult r = serve({flag, value});
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, HasSubstr(std::string("colibri-node: error: ") + flag)) << r.err;
  }
}

TEST(CliArgs, AnItlBoundOutOfRangeIsRefused) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  for (const char* value : {"-1", "nan", "inf"}) {
    const RunResult r = run_node({"--model", dir.path().string(), "--serve", "--max-itl-ms", value},
                                 scratch.path());
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, HasSubstr("--max-itl-ms")) << r.err;
  }
}

TEST(CliArgs, MicroBatchesOutOfRangeAreRefused) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  for (const auto& [flag, value] :
       {std::pair{"--micro-batches", "3"}, std::pair{"--micro-batches", "0"},
        std::pair{"--micro-batch-rows", "3"}}) {
    const RunResult r = run_node(
        {"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "1", flag, value},
        scratch.path());
    EXPECT_NE(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.err, HasSubstr(std::string("colibri-node: error: ") + flag)) << r.err;
  }
}

TEST(CliArgs, EnvironmentKnobsAreCheckedAtStart) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const std::vector<std::string> args = {"--model", dir.path().string(), "--prompt-ids", "1,2"};
  {
    const ScopedEnv isa("COLIBRI_ISA", "sse9");
    expect_refused(run_node(args, scratch.path()),
                   {"COLIBRI_ISA=sse9: expected scalar, avx2 or avx512"});
  }
  {
    const ScopedEnv fp4_mma("COLIBRI_FP4_MMA", "on");
    expect_refused(run_node(args, scratch.path()),
                   {"COLIBRI_FP4_MMA='on' must be 0 (off) or 1 (on)"});
  }
  const ScopedEnv vnni("COLIBRI_VNNI", "yes");
  expect_refused(run_node(args, scratch.path()), {"COLIBRI_VNNI='yes' must be 0 (off) or 1 (on)"});
}

TEST(CliArgs, LargestSeedIsAccepted) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const RunResult r = run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen",
                                "2", "--temp", "1", "--seed", "18446744073709551615", "--quiet"},
                               scratch.path());
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// ---- outputs -------------------------------------------------------------------------------

TEST(CliOutputs, OnlyRegularOrNewFilesAreWrittenAndNothingIsDestroyed) {
  test::TempDir dir, scratch, out;
  test::TinyModel().write(dir.path());
  const fs::path fifo = out.path() / "fifo", sub = out.path() / "sub", file = out.path() / "file";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_directory(sub);
  test::write_file_bytes(file, "keep");
  fs::create_symlink(sub, out.path() / "link_to_dir");
  fs::create_symlink("/dev/null", out.path() / "link_to_null");
  const struct {
    fs::path path;
    const char* reason;
  } kinds[] = {
      {"/dev/null", "is a character device"},
      {out.path() / "link_to_null", "is a character device"},
      {sub, "is a directory"},
      {out.path() / "link_to_dir", "is a directory"},
      {fifo, "is a FIFO"},
      {out.path() / "missing" / "x.json", "No such file or directory"},
      {file / "x.json", "Not a directory"},
  };
  for (const char* flag : {"--logits-out", "--profile-json", "--trace"})
    for (const auto& kind : kinds) {
      SCOPED_TRACE(std::string(flag) + " " + kind.path.string());
      const RunResult r = run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen",
                                    "2", flag, kind.path.string()},
                                   scratch.path());
      expect_refused(r, {std::string(flag) + " " + kind.path.string(), kind.reason});
    }
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/null is no longer a character device";
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_TRUE(fs::is_empty(sub));
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_EQ(test::read_file_bytes(file), "keep");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out.path()))
    names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names,
            (std::vector<std::string>{"fifo", "file", "link_to_dir", "link_to_null", "sub"}));
}

TEST(CliOutputs, TwoFlagsNamingOneFileAreRefused) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const std::string same = (scratch.path() / "p.json").string();
  expect_refused(run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "2",
                           "--profile-json", same, "--trace", same},
                          scratch.path()),
                 {"--trace " + same, "the same file as --profile-json"});
}

TEST(CliOutputs, ExistingOutputIsIntactWhenTheRunFailsBeforeWriting) {
  test::TempDir dir, scratch, out;
  const test::TinyModel model;
  model.write(dir.path());
  poke_f32(dir.path(), model, kEmbed, 0, std::nanf(""));  // refused at load, after the check
  const fs::path logits = out.path() / "logits.npy";
  test::write_file_bytes(logits, "precious");
  const RunResult r = run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen",
                                "2", "--logits-out", logits.string()},
                               scratch.path());
  expect_refused(r, {"tensor '" + kEmbed + "'"});
  EXPECT_EQ(test::read_file_bytes(logits), "precious");
  EXPECT_EQ(std::distance(fs::directory_iterator(out.path()), fs::directory_iterator()), 1);
}

// Routing statistics: learned beside the model by default and merged run after run; a file named
// with --routing-stats that is damaged or was learned on other weights is refused in one line,
// the automatic one is set aside with a warning and replaced; `off` writes nothing.
TEST(CliRoutingStats, LearnedAcrossRunsRefusedWhenDamagedOrForeign) {
  test::TempDir dir, other, scratch, files;
  const test::TinyModel model;
  model.write(dir.path());
  const std::vector<std::string> run = {"--prompt-ids", "1,2,3", "--ngen", "3", "--quiet"};
  const auto with = [&](const fs::path& model_dir, std::vector<std::string> more) {
    std::vector<std::string> args = {"--model", model_dir.string()};
    args.insert(args.end(), run.begin(), run.end());
    args.insert(args.end(), more.begin(), more.end());
    return args;
  };
  const fs::path automatic = dir.path() / "colibri-routing.stats";
  RunResult r = run_node(with(dir.path(), {}), scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(fs::exists(automatic));
  const std::string first = test::read_file_bytes(automatic);
  EXPECT_EQ(first.substr(0, 8), "CNROUTES");
  r = run_node(with(dir.path(), {}), scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(test::read_file_bytes(automatic), first);  // this run's routes merged in
  EXPECT_EQ(test::read_file_bytes(automatic).size(), first.size());

  // Named and damaged, or a directory: refused before any work.
  const fs::path named = files.path() / "named.stats";
  test::write_file_bytes(named, "not statistics");
  expect_refused(run_node(with(dir.path(), {"--routing-stats", named.string()}), scratch.path()),
                 {named.string(), "routing statistics", "not a colibri-node routing statistics"});
  EXPECT_EQ(test::read_file_bytes(named), "not statistics");
  expect_refused(
      run_node(with(dir.path(), {"--routing-stats", files.path().string()}), scratch.path()),
      {"--routing-stats", files.path().string()});

  // Learned on this model, read for another one with other weights: refused.
  test::TinyModel changed;
  changed.write(other.path());
  poke_f32(other.path(), changed, kEmbed, 3, 0.5f);
  fs::copy_file(automatic, named, fs::copy_options::overwrite_existing);
  expect_refused(run_node(with(other.path(), {"--routing-stats", named.string()}), scratch.path()),
                 {named.string(), "learned on another model"});

  // The automatic file damaged: a warning, the run goes on, the file is replaced.
  test::write_file_bytes(automatic, "damaged");
  r = run_node(with(dir.path(), {}), scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("warning: " + automatic.string() + ": routing statistics:"));
  EXPECT_EQ(test::read_file_bytes(automatic).substr(0, 8), "CNROUTES");

  // off: nothing read or written.
  fs::remove(automatic);
  r = run_node(with(dir.path(), {"--routing-stats", "off"}), scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(automatic));
}

TEST(CliOutputs, OutputsAreWrittenThroughASymlinkWithNothingLeftBehind) {
  test::TempDir dir, scratch, out;
  test::TinyModel().write(dir.path());
  const fs::path target = out.path() / "logits.npy", link = out.path() / "link.npy";
  test::write_file_bytes(target, "old");
  fs::create_symlink(target, link);
  const RunResult r =
      run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "2", "--quiet",
                "--logits-out", link.string(), "--profile-json", (out.path() / "p.json").string()},
               scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(test::read_file_bytes(target).substr(0, 6), "\x93NUMPY");
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(out.path()))
    names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"link.npy", "logits.npy", "p.json"}));
}

TEST(CliOutputs, FullStdoutIsAnErrorForIdsTextAndScore) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  test::write_file_bytes(scratch.path() / "text.txt", "In the beginning God created the heaven.");
  const std::vector<std::vector<std::string>> runs = {
      {"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "3"},
      {"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "0"},
      {"--model", kEmbeddedModel.string(), "--prompt", "And God", "--ngen", "3"},
      {"--model", kEmbeddedModel.string(), "--score", (scratch.path() / "text.txt").string()},
  };
  for (const auto& args : runs) {
    SCOPED_TRACE(args[2] + " " + args[3]);
    std::vector<std::string> quiet = args;
    quiet.push_back("--quiet");
    const RunResult r = run_node(quiet, scratch.path(), "/dev/full");
    EXPECT_EQ(r.exit_code, 1) << r.err;
    EXPECT_LT(r.elapsed_s, kQuickSeconds);
    EXPECT_THAT(r.err,
                HasSubstr("colibri-node: error: stdout: write failed: No space left on device"));
  }
}

// ---- input file kinds ------------------------------------------------------------------------

TEST(CliInputs, ModelDirectoryKinds) {
  test::TempDir dir, scratch;
  test::write_file_bytes(dir.path() / "file", "x");
  ASSERT_EQ(::mkfifo((dir.path() / "fifo").c_str(), 0644), 0);
  fs::create_symlink(dir.path() / "loop", dir.path() / "loop");
  const struct {
    fs::path path;
    const char* reason;
  } cases[] = {
      {dir.path() / "file", "is a regular file, not a directory"},
      {dir.path() / "fifo", "is a FIFO (named pipe), not a directory"},
      {dir.path() / "loop", "Too many levels of symbolic links"},
      {dir.path() / "missing", "No such file or directory"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path.string());
    expect_refused(run_node({"--model", c.path.string(), "--prompt-ids", "1,2"}, scratch.path()),
                   {c.path.string(), "the --model directory", c.reason});
  }
}

TEST(CliInputs, ScoreAndLayoutFileKinds) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const fs::path fifo = scratch.path() / "fifo", sub = scratch.path() / "sub";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_directory(sub);
  for (const fs::path& bad : {fifo, sub}) {
    const char* reason = bad == fifo ? "FIFO" : "is a directory";
    expect_refused(
        run_node({"--model", kEmbeddedModel.string(), "--score", bad.string()}, scratch.path()),
        {bad.string(), "the --score file", reason});
    expect_refused(
        run_node({"--model", dir.path().string(), "--prompt-ids", "1,2", "--layout", bad.string()},
                 scratch.path()),
        {bad.string(), "the layout file", reason});
  }
}

TEST(CliInputs, TokenizerFifoDoesNotBlock) {
  test::TempDir dir, scratch;
  for (const auto& entry : fs::directory_iterator(kEmbeddedModel))
    if (entry.path().filename() != "tokenizer.json")
      fs::create_symlink(fs::absolute(entry.path()), dir.path() / entry.path().filename());
  make_fifo(dir.path() / "tokenizer.json");
  expect_refused(
      run_node({"--model", dir.path().string(), "--prompt", "And", "--ngen", "2"}, scratch.path()),
      {(dir.path() / "tokenizer.json").string(), "FIFO"});
}

TEST(CliInputs, Bf16WeightWithNanIsRefusedAtLoad) {
  test::TempDir dir, scratch;
  test::TinyModelOptions options;
  options.dtype = "BF16";
  const test::TinyModel model(options);
  model.write(dir.path());
  const fs::path file = dir.path() / model.shard_file("lm_head.weight");
  test::SafetensorsParts parts = test::split_safetensors(file);
  const uint64_t begin = parts.header["lm_head.weight"]["data_offsets"][0].get<uint64_t>();
  parts.data[begin + 2 * 5] = char(0xc0);  // bf16 0x7fc0: NaN
  parts.data[begin + 2 * 5 + 1] = char(0x7f);
  test::write_file_bytes(file, test::encode_safetensors(parts.header, parts.data));
  expect_refused(run_node({"--model", dir.path().string(), "--prompt-ids", "1,2"}, scratch.path()),
                 {file.string(), "tensor 'lm_head.weight'", "nan at index 5"});
}

// Sets every value of F32 tensor `name` in its shard.
void fill_f32(const fs::path& dir, const test::TinyModel& m, const std::string& name, float value) {
  const fs::path file = dir / m.shard_file(name);
  test::SafetensorsParts parts = test::split_safetensors(file);
  const uint64_t begin = parts.header[name]["data_offsets"][0].get<uint64_t>();
  const uint64_t end = parts.header[name]["data_offsets"][1].get<uint64_t>();
  for (uint64_t at = begin; at < end; at += 4) std::memcpy(parts.data.data() + at, &value, 4);
  test::write_file_bytes(file, test::encode_safetensors(parts.header, parts.data));
}

// Finite weights whose products overflow: the first logits are refused, naming where, and no
// token is sampled from them.
TEST(CliInputs, LogitsThatOverflowAreRefusedNotSampled) {
  test::TempDir dir, scratch;
  const test::TinyModel model;
  model.write(dir.path());
  fill_f32(dir.path(), model, "model.norm.weight", 1e20f);
  fill_f32(dir.path(), model, "lm_head.weight", 1e20f);
  const RunResult r = run_node(
      {"--model", dir.path().string(), "--prompt-ids", "1,2", "--ngen", "3", "--temp", "1"},
      scratch.path());
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("the lm_head made the logits non-finite"));
  EXPECT_THAT(r.err, HasSubstr("at sequence 0 position 1"));
  EXPECT_EQ(r.out, "");
}

// ---- context limits (the tiny model has max_position_embeddings 256) -----------------------

std::string ids_arg(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += (i ? "," : "") + std::to_string(2 + i % 20);
  return out;
}

TEST(CliContext, PromptOrGenerationPastTheContextIsRefusedWithTheCounts) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const std::string model = dir.path().string();
  expect_refused(run_node({"--model", model, "--prompt-ids", ids_arg(257)}, scratch.path()),
                 {"prompt has 257 tokens", "context of 256", "max_position_embeddings"});
  // 3 + 255 - 1 = 257 positions: one too many; the last token is fed back only with logits kept.
  expect_refused(
      run_node({"--model", model, "--prompt-ids", ids_arg(3), "--ngen", "255"}, scratch.path()),
      {"--ngen 255", "prompt of 3 tokens", "257 positions", "context of 256",
       "at most --ngen 254"});
  expect_refused(run_node({"--model", model, "--prompt-ids", ids_arg(3), "--ngen", "254",
                           "--logits-out", (scratch.path() / "l.npy").string()},
                          scratch.path()),
                 {"--ngen 254", "257 positions", "at most --ngen 253"});
  EXPECT_FALSE(fs::exists(scratch.path() / "l.npy"));
}

// A batch whose sequences do not all fit the KV pool at once runs as many as fit and admits the
// rest as blocks free (each reserves its prompt and new tokens when admitted, so none runs out
// part-way); a sequence that cannot fit the whole pool is refused before any work.
TEST(CliContext, ABatchLargerThanTheKvPoolWaitsAndOneThatCannotFitIsRefused) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const std::vector<std::string> args = {
      "--model", dir.path().string(), "--prompt-ids", "1,2,3,4", "--ngen",
      "12",      "--ignore-eos",      "--quiet"};
  const RunResult alone = run_node(args, scratch.path());
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  std::vector<std::string> batch = args;
  batch.insert(batch.end(), {"--sequences", "6", "--kv-tokens", "48"});  // 3 blocks: 3 at once
  const RunResult r = run_node(batch, scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto out_lines = lines(r.out);
  ASSERT_EQ(out_lines.size(), 6u) << r.out;
  std::string tokens = alone.out;
  while (!tokens.empty() && (tokens.back() == ' ' || tokens.back() == '\n')) tokens.pop_back();
  for (size_t i = 0; i < out_lines.size(); ++i)
    EXPECT_EQ(out_lines[i], "[sequence " + std::to_string(i) + "] " + tokens);

  const std::vector<std::string> too_long = {"--model",      dir.path().string(),
                                             "--prompt-ids", "1,2,3,4,5",
                                             "--ngen",       "12",
                                             "--sequences",  "2",
                                             "--kv-tokens",  "16"};
  expect_refused(run_node(too_long, scratch.path()),
                 {"sequence 0: 5 prompt tokens and 12 new ones need 2 KV blocks of 16 tokens, "
                  "more than the pool's 1 (--kv-tokens 16)"});
}

TEST(CliContext, GenerationUpToTheContextRuns) {
  test::TempDir dir, scratch;
  test::TinyModel().write(dir.path());
  const RunResult r = run_node({"--model", dir.path().string(), "--prompt-ids", ids_arg(3),
                                "--ngen", "254", "--ignore-eos", "--quiet"},
                               scratch.path());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  int tokens = 0;
  for (char ch : r.out) tokens += ch == ' ';
  EXPECT_EQ(tokens, 254);
}

TEST(CliContext, TextPromptAndScoreFilePastTheContextAreRefused) {
  test::TempDir scratch;
  std::string text;
  for (int i = 0; i < 800; ++i) text += "And God said, ";  // about 3,200 tokens; context 2,048
  test::write_file_bytes(scratch.path() / "long.txt", text);
  const RunResult score = run_node(
      {"--model", kEmbeddedModel.string(), "--score", (scratch.path() / "long.txt").string()},
      scratch.path());
  expect_refused(score, {(scratch.path() / "long.txt").string(), "tokens need", "context of 2048",
                         "max_position_embeddings"});
  const RunResult prompt =
      run_node({"--model", kEmbeddedModel.string(), "--prompt", text}, scratch.path());
  expect_refused(prompt, {"the prompt has", "context of 2048"});
}

}  // namespace
}  // namespace colibri
