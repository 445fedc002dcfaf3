// --kv-cache-dir's files (coordinator/kv_cache_dir.h) on the embedded model with a one-process
// engine: a prefix saved by one engine and loaded by another (a restart) continues with bitwise
// the logits of the computed prompt; a cap evicts the later chunks of a prefix before the earlier
// ones, and the least recently used prefix first across a restart; a link at a file's name is
// left alone; another model's files live in another folder; a damaged chunk is refused with a
// line and the prefix ends before it.
#include "coordinator/kv_cache_dir.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "../unit/model_writer.h"
#include "coordinator/kv_record.h"
#include "local_model.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;
constexpr int kC = KvCacheDir::kChunkTokens;

testing::LocalModel& model() {
  static testing::LocalModel m(COLIBRI_EMBEDDED_MODEL);
  return m;
}

EngineOptions options() {
  EngineOptions eo;
  eo.max_rows = 256;
  eo.max_seqs = 2;
  eo.kv_tokens = 1024;
  return eo;
}

const ModelIdentity kIdentity{0x1234, 0x5678};

std::vector<int> ids(int n, int seed) {
  std::vector<int> out;
  for (int i = 0; i < n; ++i) out.push_back(100 + (i * 7919 + seed * 104729) % 3900);
  return out;
}

// A sequence of `tokens` computed and saved to `dir` (with `max_bytes` as the cap).
void save(const fs::path& dir, std::span<const int> tokens, uint64_t max_bytes = 0,
          const ModelIdentity& identity = kIdentity) {
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  engine->forward(seq, tokens, false);
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir, max_bytes, identity), model().config, notes);
  EXPECT_TRUE(notes.empty());
  cache.save(engine->kv(), seq, tokens);
  ASSERT_TRUE(cache.flush(30));
}

TEST(KvCacheDir, ALoadedPrefixContinuesWithBitwiseTheLogitsOfTheComputedPrompt) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(120, 1);
  save(dir.path(), std::span(prompt).first(100));  // 3 whole chunks

  auto computed = model().engine(options());
  const std::vector<float> want = computed->forward(computed->open_sequence(), prompt);

  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(cache.counters().files, 3u);
  const int held = cache.load(engine->kv(), seq, prompt, 0, int(prompt.size()) - 1, notes);
  ASSERT_EQ(held, 3 * kC);
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(cache.counters().tokens_loaded, uint64_t(3 * kC));
  const std::vector<float> got = engine->forward(seq, std::span(prompt).subspan(size_t(held)));
  const size_t vocab = size_t(model().config.vocab_size);
  ASSERT_EQ(got.size(), (prompt.size() - size_t(held)) * vocab);
  EXPECT_EQ(std::memcmp(got.data(), want.data() + size_t(held) * vocab, got.size() * sizeof(float)),
            0);
}

TEST(KvCacheDir, AnInMemoryPrefixIsExtendedFromDiskPastIt) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(120, 2);
  save(dir.path(), prompt);
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  engine->forward(seq, std::span(prompt).first(40), false);  // what memory holds
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
  EXPECT_EQ(cache.load(engine->kv(), seq, prompt, 40, 119, notes), 3 * kC);
  EXPECT_EQ(cache.counters().tokens_loaded, uint64_t(3 * kC - 40));
  auto computed = model().engine(options());
  const std::vector<float> want = computed->forward(computed->open_sequence(), prompt, false);
  const std::vector<float> got =
      engine->forward(seq, std::span(prompt).subspan(size_t(3 * kC)), false);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

TEST(KvCacheDir, ACapEvictsTheLaterChunksOfAPrefixFirst) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(5 * kC, 3);
  const uint64_t file_bytes = kv_record::header(model().config, kIdentity).size() +
                              kv_record::record_bytes(model().config, kC);
  save(dir.path(), prompt, 3 * file_bytes);
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 3 * file_bytes, kIdentity), model().config, notes);
  EXPECT_EQ(cache.counters().files, 3u);
  for (int k = 0; k < 5; ++k)
    EXPECT_EQ(fs::exists(cache.file_of(prompt, k)), k < 3) << "chunk " << k;
  auto engine = model().engine(options());
  EXPECT_EQ(cache.load(engine->kv(), engine->open_sequence(), prompt, 0, 5 * kC, notes), 3 * kC);
}

TEST(KvCacheDir, TheEvictionOrderOutlivesARestart) {
  test::TempDir dir;
  const std::vector<int> a = ids(3 * kC, 6), b = ids(2 * kC, 7);
  save(dir.path(), a);  // older
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  save(dir.path(), b);
  const uint64_t file_bytes = kv_record::header(model().config, kIdentity).size() +
                              kv_record::record_bytes(model().config, kC);
  // Restarted with a cap of three files: a's last two chunks go, then its first.
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 3 * file_bytes, kIdentity), model().config, notes);
  EXPECT_EQ(cache.counters().files, 3u);
  EXPECT_EQ(cache.counters().files_evicted, 2u);
  EXPECT_TRUE(fs::exists(cache.file_of(a, 0)));
  EXPECT_FALSE(fs::exists(cache.file_of(a, 1)));
  EXPECT_FALSE(fs::exists(cache.file_of(a, 2)));
  EXPECT_TRUE(fs::exists(cache.file_of(b, 0)));
  EXPECT_TRUE(fs::exists(cache.file_of(b, 1)));
}

TEST(KvCacheDir, NothingButARegularFileIsWrittenOver) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(kC, 8);
  fs::path name;
  {
    std::vector<std::string> notes;
    KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
    name = cache.file_of(prompt, 0);
  }
  const fs::path target = dir.path() / "elsewhere";
  std::ofstream(target) << "kept";
  fs::create_symlink(target, name);
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  engine->forward(seq, prompt, false);
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
  ASSERT_EQ(notes.size(), 1u);  // the link is not a cache file
  EXPECT_NE(notes[0].find("not a regular file"), std::string::npos) << notes[0];
  cache.save(engine->kv(), seq, prompt);
  ASSERT_TRUE(cache.flush(30));
  EXPECT_EQ(cache.counters().writes_failed, 1u);
  EXPECT_EQ(cache.counters().files_written, 0u);
  EXPECT_TRUE(fs::is_symlink(name));
  std::ifstream in(target);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "kept");
}

TEST(KvCacheDir, AnotherModelsFilesAreInAnotherFolder) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(70, 4);
  save(dir.path(), prompt, 0, {0x1234, 0x9999});
  std::vector<std::string> notes;
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
  EXPECT_EQ(cache.counters().files, 0u);
  auto engine = model().engine(options());
  EXPECT_EQ(cache.load(engine->kv(), engine->open_sequence(), prompt, 0, 69, notes), 0);
  EXPECT_TRUE(notes.empty());
}

TEST(KvCacheDir, ADamagedChunkIsRefusedWithALineAndThePrefixEndsBeforeIt) {
  test::TempDir dir;
  const std::vector<int> prompt = ids(100, 5);
  save(dir.path(), prompt);
  std::vector<std::string> notes;
  fs::path second;
  {
    KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
    second = cache.file_of(prompt, 1);
  }
  std::string bytes;
  {
    std::ifstream in(second, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  bytes[bytes.size() / 2] ^= 0x40;
  std::ofstream(second, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), std::streamsize(bytes.size()));
  KvCacheDir cache(KvCacheDirOptions(dir.path(), 0, kIdentity), model().config, notes);
  EXPECT_TRUE(notes.empty());  // found only when read
  auto engine = model().engine(options());
  EXPECT_EQ(cache.load(engine->kv(), engine->open_sequence(), prompt, 0, 99, notes), kC);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find(second.string()), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("fails its checksum"), std::string::npos) << notes[0];
  EXPECT_EQ(cache.counters().files_refused, 1u);
}

}  // namespace
}  // namespace colibri
