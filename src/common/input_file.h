// Input files (model files, configs, tokenizer, layouts, --score texts): only regular files are
// opened. A FIFO, device, socket or directory where a file belongs, a symlink loop or an unreadable
// path is refused with one Error "PATH: <reason>", never opened in a way that could block.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace colibri {

// Whether something exists at `path` (lstat: a dangling symlink or a symlink loop exists, and
// opening it then reports why it cannot be read). "No such file" and "not a directory" on the
// way are false; any other failure (EACCES on a parent, ...) is an Error naming `what`.
bool path_present(const std::filesystem::path& path, std::string_view what);

// Opens `path` read-only (O_CLOEXEC) and returns the descriptor; the caller closes it. The open
// does not block on a FIFO (O_NONBLOCK, cleared again), and anything but a regular file is
// refused: "PATH: cannot open <what>: <strerror>" or "PATH: <what> is a FIFO, not a regular file".
int open_regular_file(const std::filesystem::path& path, std::string_view what);

// Checks that `path` names a readable regular file, as open_regular_file would.
void check_regular_file(const std::filesystem::path& path, std::string_view what);

// The whole content of a regular file; read errors are reported with their errno text.
std::string read_regular_file(const std::filesystem::path& path, std::string_view what);

// Checks that `path` is a directory whose entries can be listed (a model directory).
void check_readable_directory(const std::filesystem::path& path, std::string_view what);

// "a directory", "a FIFO", "a character device", ... for an st_mode.
const char* file_kind_name(unsigned mode);

}  // namespace colibri
