// Fuzz target: a .npy file read by read_npy_f32 (the parity tests' goldens). An accepted array has
// non-negative dimensions whose product is the number of values read.
#include <cstdint>

#include "common/npy.h"
#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static colibri::fuzz::InputFile file("array.npy");
  const std::filesystem::path& path = file.write(data, size);
  return colibri::fuzz::run_one([&] {
    const colibri::NpyArray array = colibri::read_npy_f32(path);
    uint64_t numel = 1;
    for (const int64_t d : array.shape) {
      fuzz_require(d >= 0, "non-negative dimension");
      numel *= uint64_t(d);
    }
    fuzz_require(array.data.size() == numel, "values match the shape");
    fuzz_require(array.data.size() * 4 <= size, "no more values than the file holds");
  });
}
