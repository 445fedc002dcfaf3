#include "common/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>

#include "common/error.h"
#include "common/input_file.h"

namespace colibri {
namespace {

std::filesystem::path directory_of(const std::filesystem::path& path) {
  const std::filesystem::path parent = path.parent_path();
  return parent.empty() ? std::filesystem::path(".") : parent;
}

// Why files cannot be created in `dir`, or an empty string when they can.
std::string directory_problem(const std::filesystem::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    return fmt::format("directory {}: {}", dir.string(), std::strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return fmt::format("{} is {}, not a directory", dir.string(), file_kind_name(st.st_mode));
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return fmt::format("cannot create files in directory {}: {}", dir.string(),
                       std::strerror(errno));
  return {};
}

// The process umask without changing it (umask(2) would, for every thread): /proc/self/status.
mode_t current_umask() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Umask:", 0) == 0) return mode_t(std::strtoul(line.c_str() + 6, nullptr, 8));
  return 022;
}

}  // namespace

void check_output_path(const std::filesystem::path& path, std::string_view flag) {
  const std::string where = fmt::format("{} {}", flag, path.string());
  if (path.empty()) fail("{}: the path is empty", flag);
  std::filesystem::path target = path;
  struct stat link_st {};
  if (::lstat(path.c_str(), &link_st) != 0) {
    if (errno != ENOENT) fail("{}: cannot access: {}", where, std::strerror(errno));
  } else {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      fail("{}: cannot follow the symbolic link: {}", where, std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      fail("{}: is {}; only a regular file or a new file is written", where,
           file_kind_name(st.st_mode));
    if (::access(path.c_str(), W_OK) != 0)
      fail("{}: not writable: {}", where, std::strerror(errno));
    if (S_ISLNK(link_st.st_mode)) {
      std::error_code ec;
      target = std::filesystem::canonical(path, ec);
      if (ec) fail("{}: cannot resolve the symbolic link: {}", where, ec.message());
    }
  }
  const std::string problem = directory_problem(directory_of(target));
  if (!problem.empty()) fail("{}: {}", where, problem);
}

void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(std::FILE*)>& body) {
  // Checked again here: the path may have changed since start-up.
  std::filesystem::path target = path;
  mode_t mode = 0666 & ~current_umask();
  struct stat link_st {};
  if (::lstat(path.c_str(), &link_st) == 0) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      fail("{}: cannot follow the symbolic link: {}", path.string(), std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      fail("{}: is {}; only a regular file or a new file is written", path.string(),
           file_kind_name(st.st_mode));
    mode = st.st_mode & 07777;
    if (S_ISLNK(link_st.st_mode)) {
      std::error_code ec;
      target = std::filesystem::canonical(path, ec);
      if (ec) fail("{}: cannot resolve the symbolic link: {}", path.string(), ec.message());
    }
  } else if (errno != ENOENT) {
    fail("{}: cannot access: {}", path.string(), std::strerror(errno));
  }

  const std::filesystem::path dir = directory_of(target);
  std::string temp = (dir / (target.filename().string() + ".XXXXXX.partial")).string();
  const int fd = ::mkostemps(temp.data(), int(std::strlen(".partial")), O_CLOEXEC);
  if (fd < 0)
    fail("{}: cannot create a temporary file in {}: {}", path.string(), dir.string(),
         std::strerror(errno));
  std::FILE* file = ::fdopen(fd, "wb");
  if (!file) {
    const int error = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    fail("{}: cannot write: {}", path.string(), std::strerror(error));
  }
  // Ends every failure below: the temporary file goes, the target stays as it was.
  const auto abandon = [&](int error, const std::string& what) {
    if (file) std::fclose(file);
    ::unlink(temp.c_str());
    fail("{}: write failed: {}", path.string(), error ? std::strerror(error) : what.c_str());
  };
  try {
    errno = 0;
    body(file);
  } catch (const std::system_error& e) {  // fmt::print reports a failed write this way
    abandon(e.code().category() == std::generic_category() ||
                    e.code().category() == std::system_category()
                ? e.code().value()
                : 0,
            e.what());
  } catch (...) {
    std::fclose(file);
    ::unlink(temp.c_str());
    throw;
  }
  int error = errno;
  if (std::ferror(file)) abandon(error, "I/O error");
  if (std::fflush(file) != 0) abandon(errno, "I/O error");
  if (::fchmod(fd, mode) != 0) abandon(errno, "chmod");
  if (::fsync(fd) != 0 && errno != EINVAL) abandon(errno, "fsync");
  error = std::fclose(file) != 0 ? errno : 0;
  file = nullptr;
  if (error) abandon(error, "close");
  if (::rename(temp.c_str(), target.c_str()) != 0) {
    error = errno;
    ::unlink(temp.c_str());
    fail("{}: cannot rename {} into place: {}", path.string(), temp, std::strerror(error));
  }
}

void flush_stdout_or_fail() {
  errno = 0;
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout);
  if (failed) {
    const int error = errno;
    std::clearerr(stdout);
    fail("stdout: write failed: {}", error ? std::strerror(error) : "I/O error");
  }
}

}  // namespace colibri
