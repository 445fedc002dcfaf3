// --kv-file (coordinator/kv_file.h) on the embedded model with a one-process engine: a
// conversation saved after its first turn and restored into another engine continues with
// bitwise the logits of the uninterrupted one; a torn or damaged turn is dropped with a note (the
// turns before it kept), a file of another model or a damaged header is refused.
#include "coordinator/kv_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "../unit/model_writer.h"
#include "common/error.h"
#include "local_model.h"

namespace colibri {
namespace {

namespace fs = std::filesystem;

testing::LocalModel& model() {
  static testing::LocalModel m(COLIBRI_EMBEDDED_MODEL);
  return m;
}

EngineOptions options() {
  EngineOptions eo;
  eo.max_rows = 64;
  eo.max_seqs = 2;
  eo.kv_tokens = 1024;
  return eo;
}

const ModelIdentity kIdentity{0x1234, 0x5678};
const std::vector<int> kTurn1 = {4086, 4087, 4091, 198, 1000, 2000, 300, 40, 4092, 198, 77, 78};
const std::vector<int> kTurn2 = {4091, 198, 500, 600, 700, 4092, 198};
const std::vector<int> kTurn3 = {4091, 198, 900, 901};

// Turns 1 and 2 in a file at `path` (turn 1 then turn 2 appended).
void save_two_turns(const fs::path& path) {
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  KvFile file(path, model().config, kIdentity);
  engine->forward(seq, kTurn1);
  file.append(engine->kv(), seq, 0, kTurn1);
  engine->forward(seq, kTurn2);
  file.append(engine->kv(), seq, int(kTurn1.size()), kTurn2);
}

// The logits of turn 3 after a conversation restored from `path`, and the restored ids.
std::vector<float> turn3_after_restore(const fs::path& path, std::vector<int>* ids,
                                       std::vector<std::string>* notes) {
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  KvFile file(path, model().config, kIdentity);
  *ids = file.restore(engine->kv(), seq, *notes);
  return engine->forward(seq, kTurn3);
}

TEST(KvFile, ARestoredConversationContinuesWithBitwiseTheLogitsOfAnUninterruptedOne) {
  test::TempDir dir;
  auto engine = model().engine(options());
  const int seq = engine->open_sequence();
  engine->forward(seq, kTurn1);
  engine->forward(seq, kTurn2);
  const std::vector<float> want = engine->forward(seq, kTurn3);

  save_two_turns(dir.path() / "chat.kv");
  std::vector<int> ids;
  std::vector<std::string> notes;
  const std::vector<float> got = turn3_after_restore(dir.path() / "chat.kv", &ids, &notes);
  EXPECT_TRUE(notes.empty());
  std::vector<int> both = kTurn1;
  both.insert(both.end(), kTurn2.begin(), kTurn2.end());
  EXPECT_EQ(ids, both);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0);
}

TEST(KvFile, ATornOrDamagedTurnIsDroppedWithANoteAndTheTurnsBeforeItKept) {
  test::TempDir dir;
  const fs::path path = dir.path() / "chat.kv";
  save_two_turns(path);
  const auto size = fs::file_size(path);
  // The same file cut inside turn 2, and with a byte of turn 2 flipped.
  for (const bool torn : {true, false}) {
    SCOPED_TRACE(torn ? "torn" : "flipped");
    save_two_turns(path);
    if (torn) {
      fs::resize_file(path, size - 100);
    } else {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(std::streamoff(size - 50));
      f.put('\x5a');
    }
    std::vector<int> ids;
    std::vector<std::string> notes;
    turn3_after_restore(path, &ids, &notes);
    EXPECT_EQ(ids, kTurn1);
    ASSERT_EQ(notes.size(), 1u);
    EXPECT_NE(notes[0].find(torn ? "turn 2 is torn" : "turn 2 fails its checksum"),
              std::string::npos)
        << notes[0];
    // The file was cut back to turn 1: a second restore needs no note.
    notes.clear();
    turn3_after_restore(path, &ids, &notes);
    EXPECT_TRUE(notes.empty());
    EXPECT_EQ(ids, kTurn1);
    fs::remove(path);
  }
}

TEST(KvFile, AnotherModelsFileADamagedHeaderOrNotARegularFileIsRefused) {
  test::TempDir dir;
  const fs::path path = dir.path() / "chat.kv";
  save_two_turns(path);
  const auto refused = [&](const fs::path& p, const ModelIdentity& identity) {
    try {
      KvFile file(p, model().config, identity);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refused(path, {0x1234, 0x9999}).find("another model"), std::string::npos);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2);
    f.put('X');
  }
  EXPECT_NE(refused(path, kIdentity).find("not a colibri-node KV file"), std::string::npos);
  EXPECT_NE(refused(dir.path(), kIdentity).find("not a regular file"), std::string::npos);
  fs::create_symlink(path, dir.path() / "link.kv");
  EXPECT_NE(refused(dir.path() / "link.kv", kIdentity).find("not a regular file"),
            std::string::npos);
  EXPECT_TRUE(fs::exists(path));  // a refused file is left alone
}

}  // namespace
}  // namespace colibri
