#include "common/input_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace colibri {

const char* file_kind_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO (named pipe)";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    case S_IFLNK:
      return "a symbolic link";
  }
  return "not a regular file";
}

bool path_present(const std::filesystem::path& path, std::string_view what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT || errno == ENOTDIR) return false;
  fail("{}: cannot access {}: {}", path.string(), what, std::strerror(errno));
}

namespace {

[[noreturn]] void refuse_kind(const std::filesystem::path& path, std::string_view what,
                              unsigned mode) {
  fail("{}: {} is {}, not a regular file", path.string(), what, file_kind_name(mode));
}

}  // namespace

int open_regular_file(const std::filesystem::path& path, std::string_view what) {
  // stat first, so that a FIFO or a device is never opened; O_NONBLOCK covers a swap between the
  // two calls, and fstat checks what was opened.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail("{}: cannot open {}: {}", path.string(), what, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) refuse_kind(path, what, st.st_mode);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) fail("{}: cannot open {}: {}", path.string(), what, std::strerror(errno));
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int error = errno;
    ::close(fd);
    if (!S_ISREG(st.st_mode)) refuse_kind(path, what, st.st_mode);
    fail("{}: cannot open {}: {}", path.string(), what, std::strerror(error));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void check_regular_file(const std::filesystem::path& path, std::string_view what) {
  ::close(open_regular_file(path, what));
}

std::string read_regular_file(const std::filesystem::path& path, std::string_view what) {
  const int fd = open_regular_file(path, what);
  std::string text;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) text.reserve(size_t(st.st_size));
  char buffer[1 << 16];
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      fail("{}: read failed ({}): {}", path.string(), what, std::strerror(error));
    }
    if (got == 0) break;
    text.append(buffer, size_t(got));
  }
  ::close(fd);
  return text;
}

void check_readable_directory(const std::filesystem::path& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail("{}: cannot open {}: {}", path.string(), what, std::strerror(errno));
  if (!S_ISDIR(st.st_mode))
    fail("{}: {} is {}, not a directory", path.string(), what, file_kind_name(st.st_mode));
  DIR* dir = ::opendir(path.c_str());
  if (!dir) fail("{}: cannot list {}: {}", path.string(), what, std::strerror(errno));
  ::closedir(dir);
}

}  // namespace colibri
