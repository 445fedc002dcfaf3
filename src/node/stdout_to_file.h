// --output: stdout goes to an unnamed temporary file until the run ends, then its bytes are written
// to the target atomically (common/output_file.h). On an error the target is left as it was.
#pragma once

#include <cstdio>
#include <filesystem>

namespace colibri {

class StdoutToFile {
 public:
  explicit StdoutToFile(std::filesystem::path target);
  ~StdoutToFile();
  StdoutToFile(const StdoutToFile&) = delete;
  StdoutToFile& operator=(const StdoutToFile&) = delete;

  // Everything printed so far goes to the target, and stdout is the terminal's again.
  void commit();

 private:
  void restore();

  std::filesystem::path target_;
  std::FILE* temp_ = nullptr;
  int saved_ = -1;
};

}  // namespace colibri
