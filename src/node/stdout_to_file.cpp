#include "node/stdout_to_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/output_file.h"

namespace colibri {

StdoutToFile::StdoutToFile(std::filesystem::path target) : target_(std::move(target)) {
  std::fflush(stdout);
  temp_ = std::tmpfile();
  saved_ = ::dup(STDOUT_FILENO);
  if (!temp_ || saved_ < 0 || ::dup2(::fileno(temp_), STDOUT_FILENO) < 0)
    fail("--output {}: cannot hold the output in a temporary file: {}", target_.string(),
         std::strerror(errno));
}

StdoutToFile::~StdoutToFile() {
  restore();
  if (temp_) std::fclose(temp_);
}

void StdoutToFile::commit() {
  flush_stdout_or_fail();
  std::string bytes;
  std::rewind(temp_);
  char buffer[1 << 16];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, temp_)) > 0;) bytes.append(buffer, n);
  if (std::ferror(temp_))
    fail("--output {}: cannot read back the temporary file", target_.string());
  restore();
  write_file_atomically(target_,
                        [&](std::FILE* file) { std::fwrite(bytes.data(), 1, bytes.size(), file); });
}

void StdoutToFile::restore() {
  if (saved_ < 0) return;
  std::fflush(stdout);
  ::dup2(saved_, STDOUT_FILENO);
  ::close(saved_);
  saved_ = -1;
}

}  // namespace colibri
