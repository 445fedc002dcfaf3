// Fuzz target: a whole .safetensors file (8-byte header length, JSON header, data section), opened
// with SafetensorsFile as the loader opens a checkpoint shard. Accepted files must describe
// tensors that lie inside the file, with sizes that match dtype and shape, and read back in full.
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "common/safetensors.h"
#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static colibri::fuzz::InputFile file("model.safetensors");
  const std::filesystem::path& path = file.write(data, size);
  return colibri::fuzz::run_one([&] {
    const colibri::SafetensorsFile st(path);
    fuzz_require(st.file_bytes() == size, "file size as written");
    std::vector<std::byte> copy;
    for (const auto& [name, view] : st.tensors()) {
      fuzz_require(view.name == name, "tensor named by its key");
      uint64_t numel = 1;
      for (const int64_t d : view.shape) {
        fuzz_require(d >= 0, "non-negative dimension");
        numel *= uint64_t(d);
      }
      fuzz_require(uint64_t(view.numel()) == numel, "numel is the product of the shape");
      fuzz_require(view.nbytes == numel * colibri::dtype_size(view.dtype), "bytes match the shape");
      // The tensor's bytes lie inside the file, after the header: read them both ways.
      fuzz_require(view.nbytes <= size, "tensor no larger than the file");
      copy.resize(view.nbytes);
      st.read(view, copy.data());
      if (view.nbytes > 0)
        fuzz_require(std::memcmp(copy.data(), view.data, view.nbytes) == 0,
                     "pread and the mapping agree");
      fuzz_require(st.find(name) == &view, "find returns the tensor");
    }
  });
}
