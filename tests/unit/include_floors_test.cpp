// The floors of the source tree (docs/ARCHITECTURE.md, "Floors"): a file includes from its own
// folder or from a lower floor, never from a higher one or a neighbour on its own floor. An upward
// include that must stay for a while is listed below as a debt (none is); the test fails on any
// other, and on a listed one that is gone (so that the list only shrinks).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace colibri {
namespace {

namespace fs = std::filesystem;

// Folder (the first part of an include path) -> floor.
const std::map<std::string, int> kFloors = {
    {"common", 0},
    {"cpu", 0},
    {"cuda", 1},
    {"tokenizer", 1},
    {"model", 1},
    {"moe", 2},
    {"rank", 3},
    {"oracle", 3},
    {"transport", 4},
    {"coordinator", 5},
    {"tensor_parallel", 6},
    {"node", 7},
    {"tools", 7},
    {"plan", 8},
    {"", 9},  // src/main.cpp
};

// Upward includes still to remove: "file -> include" (none left).
const std::set<std::string> kDebts = {};

struct Include {
  std::string file, target;  // "src/rank/x.h", "transport/transport.h"
  std::string edge() const { return file + " -> " + target; }
};

// The folder of a file under src/ or kernels/: "rank", "cpu", or "" for src/main.cpp.
std::string folder_of(const fs::path& relative) {
  auto part = relative.begin();
  ++part;  // src or kernels
  const fs::path first = *part;
  return ++part == relative.end() ? "" : first.string();
}

// Every #include "folder/..." of the tree's .h, .cpp, .cu and .cuh files that goes to another
// folder not on a lower floor (unknown folders included).
std::vector<Include> upward_includes(const fs::path& root) {
  const std::regex include_line(R"(^\s*#\s*include\s*"([a-z_]+)/[^"]+")");
  std::vector<Include> found;
  for (const char* top : {"src", "kernels"}) {
    if (!fs::exists(root / top)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(root / top)) {
      const std::string ext = entry.path().extension().string();
      if (!entry.is_regular_file() ||
          (ext != ".h" && ext != ".cpp" && ext != ".cu" && ext != ".cuh"))
        continue;
      const fs::path relative = fs::relative(entry.path(), root);
      const std::string from = folder_of(relative);
      std::ifstream in(entry.path());
      std::string line;
      while (std::getline(in, line)) {
        std::smatch m;
        if (!std::regex_search(line, m, include_line)) continue;
        const std::string to = m[1];
        const auto floor_from = kFloors.find(from), floor_to = kFloors.find(to);
        const bool allowed =
            to == from || (floor_from != kFloors.end() && floor_to != kFloors.end() &&
                           floor_to->second < floor_from->second);
        if (!allowed) {
          std::string target = line.substr(line.find('"') + 1);
          target = target.substr(0, target.find('"'));
          found.push_back({relative.string(), target});
        }
      }
    }
  }
  return found;
}

TEST(IncludeFloors, NoFileIncludesFromAHigherFloorBeyondTheListedDebts) {
  std::set<std::string> seen;
  for (const Include& i : upward_includes(COLIBRI_SOURCE_DIR)) {
    seen.insert(i.edge());
    EXPECT_TRUE(kDebts.count(i.edge())) << i.edge() << ": an include from a higher floor";
  }
  for (const std::string& debt : kDebts)
    EXPECT_TRUE(seen.count(debt)) << debt << " is gone: remove it from the debts";
}

// The check finds what it is for: a deliberately upward include in a small tree.
TEST(IncludeFloors, AnUpwardIncludeIsFound) {
  const fs::path root = fs::path(::testing::TempDir()) / "include_floors";
  fs::remove_all(root);
  fs::create_directories(root / "src" / "model");
  fs::create_directories(root / "src" / "coordinator");
  std::ofstream(root / "src" / "model" / "a.h") << "#include \"common/error.h\"\n"
                                                << "#include \"model/b.h\"\n"
                                                << "#include \"coordinator/engine.h\"\n";
  std::ofstream(root / "src" / "coordinator" / "c.cpp") << "#include \"model/a.h\"\n";
  const std::vector<Include> found = upward_includes(root);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].edge(), "src/model/a.h -> coordinator/engine.h");
  fs::remove_all(root);
}

}  // namespace
}  // namespace colibri
