// Input and output files at the edges of the program: only regular files are read, only regular
// or new files are written (atomically, nothing left behind), NaN/Inf are found wherever they are.
// Every refusal names the path and the reason; nothing here may block on a FIFO.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/finite.h"
#include "common/input_file.h"
#include "common/output_file.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/weights.h"
#include "model_writer.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

// The message of the Error `fn` throws; fails the test when it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  const auto start = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const Error& e) {
    // A refusal is immediate: nothing may wait on a FIFO or a device.
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
    return e.what();
  }
  ADD_FAILURE() << "expected an Error";
  return {};
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

bool is_root() {
  return ::geteuid() == 0;
}

// ---- input files ---------------------------------------------------------------------------

// A checkpoint truncated after it was opened (a disk tier reading experts while someone rewrites
// the file) is a read error naming the file and tensor, not a SIGBUS.
TEST(InputFile, ACheckpointTruncatedUnderTheReaderIsAnError) {
  const fs::path source = fs::path(COLIBRI_TEST_DATA) / "parity" / "glm5" / "model";
  const fs::path dir = fs::temp_directory_path() / fmt::format("colibri-trunc-{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const auto& entry : fs::directory_iterator(source))
    fs::copy_file(entry.path(), dir / entry.path().filename());
  const ModelConfig config = load_model_config(dir);
  const Checkpoint checkpoint(dir, config.fp8_block);
  int layer = 0;
  while (!config.layer_is_moe[size_t(layer)]) ++layer;
  const MlpWeights before = load_routed_expert(config, checkpoint, layer, 0);
  EXPECT_FALSE(before.empty());
  fs::resize_file(dir / "model.safetensors", 64);  // past the header: every tensor is gone
  const std::string what =
      error_of([&] { load_routed_expert(config, checkpoint, layer, config.n_routed_experts - 1); });
  EXPECT_THAT(what, AllOf(HasSubstr("model.safetensors"), HasSubstr("unexpected end of file")));
  fs::remove_all(dir);
}

TEST(InputFile, ReadsARegularFileAndThroughASymlink) {
  test::TempDir dir;
  test::write_file_bytes(dir.path() / "a.json", "{\"x\": 1}");
  fs::create_symlink(dir.path() / "a.json", dir.path() / "link.json");
  EXPECT_EQ(read_regular_file(dir.path() / "a.json", "the config"), "{\"x\": 1}");
  EXPECT_EQ(read_regular_file(dir.path() / "link.json", "the config"), "{\"x\": 1}");
  test::write_file_bytes(dir.path() / "empty", "");
  EXPECT_EQ(read_regular_file(dir.path() / "empty", "the config"), "");
}

TEST(InputFile, RefusesEveryKindButARegularFileWithoutBlocking) {
  test::TempDir dir;
  const fs::path fifo = dir.path() / "fifo", sub = dir.path() / "sub";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_directory(sub);
  fs::create_symlink(sub, dir.path() / "link_to_dir");
  fs::create_symlink(fifo, dir.path() / "link_to_fifo");
  fs::create_symlink(dir.path() / "loop_b", dir.path() / "loop_a");
  fs::create_symlink(dir.path() / "loop_a", dir.path() / "loop_b");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "dangling");
  const struct {
    fs::path path;
    const char* reason;
  } cases[] = {
      {fifo, "is a FIFO (named pipe), not a regular file"},
      {dir.path() / "link_to_fifo", "is a FIFO (named pipe), not a regular file"},
      {sub, "is a directory, not a regular file"},
      {dir.path() / "link_to_dir", "is a directory, not a regular file"},
      {"/dev/null", "is a character device, not a regular file"},  // stat only, never opened
      {dir.path() / "loop_a", "Too many levels of symbolic links"},
      {dir.path() / "dangling", "No such file or directory"},
      {dir.path() / "missing", "No such file or directory"},
      {dir.path() / "fifo" / "below", "Not a directory"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path.string());
    EXPECT_THAT(
        error_of([&] { read_regular_file(c.path, "the tokenizer"); }),
        AllOf(HasSubstr(c.path.string() + ": "), HasSubstr("the tokenizer"), HasSubstr(c.reason)));
    EXPECT_THAT(error_of([&] { check_regular_file(c.path, "the --score file"); }),
                HasSubstr(c.reason));
  }
  // Nothing was changed by looking.
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
}

TEST(InputFile, UnreadableFileAndDirectoryNameTheReason) {
  if (is_root()) GTEST_SKIP() << "root reads files whatever their mode";
  test::TempDir dir;
  const fs::path file = dir.path() / "config.json", sub = dir.path() / "model";
  test::write_file_bytes(file, "{}");
  fs::create_directory(sub);
  fs::permissions(file, fs::perms::none);
  fs::permissions(sub, fs::perms::none);
  EXPECT_THAT(error_of([&] { read_regular_file(file, "the model config"); }),
              HasSubstr("Permission denied"));
  EXPECT_THAT(error_of([&] { check_readable_directory(sub, "the model directory"); }),
              HasSubstr("Permission denied"));
  EXPECT_THAT(error_of([&] { path_present(sub / "config.json", "the model config"); }),
              HasSubstr("Permission denied"));
  fs::permissions(sub, fs::perms::owner_all);
}

TEST(InputFile, DirectoryChecks) {
  test::TempDir dir;
  test::write_file_bytes(dir.path() / "file", "x");
  EXPECT_NO_THROW(check_readable_directory(dir.path(), "the model directory"));
  EXPECT_THAT(error_of([&] { check_readable_directory(dir.path() / "file", "the --model dir"); }),
              HasSubstr("is a regular file, not a directory"));
  EXPECT_THAT(error_of([&] { check_readable_directory(dir.path() / "no", "the --model dir"); }),
              HasSubstr("No such file or directory"));
  EXPECT_TRUE(path_present(dir.path() / "file", "x"));
  EXPECT_FALSE(path_present(dir.path() / "missing", "x"));
  EXPECT_FALSE(path_present(dir.path() / "file" / "below", "x"));
}

// ---- output files --------------------------------------------------------------------------

TEST(OutputFile, RefusesEverythingButARegularOrNewFile) {
  test::TempDir dir;
  const fs::path fifo = dir.path() / "fifo", sub = dir.path() / "sub";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_directory(sub);
  test::write_file_bytes(dir.path() / "file", "keep");
  fs::create_symlink(sub, dir.path() / "link_to_dir");
  fs::create_symlink(fifo, dir.path() / "link_to_fifo");
  fs::create_symlink("/dev/null", dir.path() / "link_to_null");
  fs::create_symlink(dir.path() / "nowhere", dir.path() / "dangling");
  fs::create_symlink(dir.path() / "loop_b", dir.path() / "loop_a");
  fs::create_symlink(dir.path() / "loop_a", dir.path() / "loop_b");
  const auto before = entries(dir.path());
  const struct {
    fs::path path;
    const char* reason;
  } cases[] = {
      {"/dev/null", "is a character device"},
      {dir.path() / "link_to_null", "is a character device"},
      {sub, "is a directory"},
      {dir.path() / "link_to_dir", "is a directory"},
      {fifo, "is a FIFO"},
      {dir.path() / "link_to_fifo", "is a FIFO"},
      {dir.path() / "dangling", "No such file or directory"},
      {dir.path() / "loop_a", "Too many levels of symbolic links"},
      {dir.path() / "missing_dir" / "out.npy", "No such file or directory"},
      {dir.path() / "file" / "out.npy", "Not a directory"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path.string());
    EXPECT_THAT(error_of([&] { check_output_path(c.path, "--logits-out"); }),
                AllOf(HasSubstr("--logits-out " + c.path.string() + ": "), HasSubstr(c.reason)));
    EXPECT_THAT(
        error_of([&] { write_file_atomically(c.path, [](std::FILE* f) { std::fputs("x", f); }); }),
        AllOf(HasSubstr(c.path.string()), HasSubstr(c.reason)));
  }
  // Nothing destroyed, nothing created.
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_EQ(test::read_file_bytes(dir.path() / "file"), "keep");
  EXPECT_EQ(entries(dir.path()), before);
  EXPECT_TRUE(fs::is_empty(sub));
}

TEST(OutputFile, AcceptsNewExistingAndSymlinkedRegularFiles) {
  test::TempDir dir;
  test::write_file_bytes(dir.path() / "old.json", "old");
  fs::create_symlink(dir.path() / "old.json", dir.path() / "link.json");
  for (const char* name : {"new.json", "old.json", "link.json"})
    EXPECT_NO_THROW(check_output_path(dir.path() / name, "--trace")) << name;
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"link.json", "old.json"}));
}

TEST(OutputFile, UnwritableDirectoryOrFileIsRefused) {
  if (is_root()) GTEST_SKIP() << "root writes files whatever their mode";
  test::TempDir dir;
  const fs::path sub = dir.path() / "ro";
  fs::create_directory(sub);
  test::write_file_bytes(dir.path() / "ro_file", "keep");
  fs::permissions(dir.path() / "ro_file", fs::perms::owner_read);
  fs::permissions(sub, fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_THAT(error_of([&] { check_output_path(sub / "out.json", "--profile-json"); }),
              AllOf(HasSubstr("--profile-json"), HasSubstr("Permission denied")));
  EXPECT_THAT(error_of([&] { check_output_path(dir.path() / "ro_file", "--trace"); }),
              AllOf(HasSubstr("not writable"), HasSubstr("Permission denied")));
  fs::permissions(sub, fs::perms::owner_all);
}

TEST(OutputFile, WritesAtomicallyAndKeepsTheModeAndTheSymlink) {
  test::TempDir dir;
  const fs::path target = dir.path() / "out.json", link = dir.path() / "link.json";
  write_file_atomically(target, [](std::FILE* f) { std::fputs("first", f); });
  EXPECT_EQ(test::read_file_bytes(target), "first");
  fs::permissions(target, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  fs::create_symlink(target, link);
  write_file_atomically(link, [](std::FILE* f) { std::fputs("second", f); });
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(test::read_file_bytes(target), "second");
  EXPECT_EQ(fs::status(target).permissions(),
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"link.json", "out.json"}));
}

TEST(OutputFile, AFailingWriterLeavesTheTargetAndNoTemporaryFile) {
  test::TempDir dir;
  const fs::path target = dir.path() / "out.npy";
  test::write_file_bytes(target, "intact");
  EXPECT_THROW(write_file_atomically(target,
                                     [](std::FILE* f) {
                                       std::fputs("half", f);
                                       throw Error("serialisation failed");
                                     }),
               Error);
  EXPECT_EQ(test::read_file_bytes(target), "intact");
  EXPECT_EQ(entries(dir.path()), std::vector<std::string>{"out.npy"});
}

// A write error from the file system (here EFBIG from RLIMIT_FSIZE, in a child so the limit stays
// there) is reported with its errno text; the old file stays and no temporary file is left.
TEST(OutputFile, AWriteErrorIsReportedWithErrnoText) {
  test::TempDir dir;
  const fs::path target = dir.path() / "out.npy", message = dir.path() / "message";
  test::write_file_bytes(target, "intact");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    std::string text = "no error";
    try {
      write_file_atomically(target, [](std::FILE* f) {
        const std::vector<char> block(1 << 16, 'x');
        std::fwrite(block.data(), 1, block.size(), f);
      });
    } catch (const Error& e) {
      text = e.what();
    }
    const int fd = ::open(message.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    (void)!::write(fd, text.data(), text.size());
    ::close(fd);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_THAT(test::read_file_bytes(message),
              AllOf(HasSubstr(target.string()), HasSubstr("write failed: File too large")));
  EXPECT_EQ(test::read_file_bytes(target), "intact");
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{"message", "out.npy"}));
}

// ---- NaN / Inf -----------------------------------------------------------------------------

TEST(Finite, FindsTheFirstNonFiniteValueAnywhere) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> values(10'000, 0.5f);
  values[7] = std::numeric_limits<float>::max();  // large but finite
  values[8] = std::numeric_limits<float>::denorm_min();
  EXPECT_FALSE(find_non_finite(values));
  EXPECT_NO_THROW(check_finite(values, "x"));
  for (size_t at : {size_t(0), size_t(4095), size_t(4096), size_t(9999)})
    for (float bad : {nan, inf, -inf, -nan}) {
      std::vector<float> v = values;
      v[at] = bad;
      v[9999 - at / 2] = bad;  // a later one does not hide the first
      EXPECT_EQ(find_non_finite(v), std::min(at, 9999 - at / 2));
    }
  EXPECT_FALSE(find_non_finite({}));
}

TEST(Finite, CheckFiniteNamesWhatAndWhere) {
  std::vector<float> v(100, 1.0f);
  v[42] = std::numeric_limits<float>::infinity();
  v[50] = std::nanf("");
  EXPECT_THAT(error_of([&] { check_finite(v, "f.safetensors: tensor 'model.norm.weight'"); }),
              AllOf(HasSubstr("f.safetensors: tensor 'model.norm.weight': inf at index 42"),
                    HasSubstr("2 of 100 values")));
}

}  // namespace
}  // namespace colibri
