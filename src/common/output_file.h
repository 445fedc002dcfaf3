// Output files (--logits-out, --profile-json, --trace): only a regular file or a new file in a
// writable directory is written, never a device, FIFO, socket or directory (nor a symlink to one).
// Paths are checked at start-up, before any work, and written atomically: into a temporary file
// beside the target, renamed over it once complete. On any failure the temporary file is removed
// and the target is left as it was.
#pragma once

#include <cstdio>
#include <filesystem>
#include <functional>
#include <string_view>

namespace colibri {

// Refuses, with an Error naming `flag` and `path` and the reason (errno text where there is one),
// anything that write_file_atomically would not write: a path that exists and is not a regular
// file (after following symlinks), a dangling symlink, an existing file that is not writable, or a
// parent that is not a writable directory. Creates nothing.
void check_output_path(const std::filesystem::path& path, std::string_view flag);

// Writes `path` through `body`, atomically: a temporary file in the target's directory (the
// symlink's target when `path` is a symlink to a regular file) gets the bytes, is flushed to disk
// and renamed over the target. The new file keeps an existing target's permission bits (else
// 0666 less the umask). Every failure, of `body` included (std::system_error from fmt::print, a
// failed fwrite seen through ferror), is an Error naming the path with the errno text.
void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(std::FILE*)>& body);

// Flushes stdout and turns a failed write (a full disk, a closed pipe, /dev/full) into an Error
// naming stdout and the errno text.
void flush_stdout_or_fail();

}  // namespace colibri
