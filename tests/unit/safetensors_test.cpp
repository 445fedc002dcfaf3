// SafetensorsFile: a valid file is read exactly; every malformed one is refused with an Error
// naming the file and the tensor or field at fault, with nothing leaked.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/safetensors.h"
#include "model_writer.h"

namespace colibri {
namespace {

using test::json;
using ::testing::HasSubstr;

std::string bytes_of(const TensorView& view) {
  return std::string(reinterpret_cast<const char*>(view.data), view.nbytes);
}

TEST(Safetensors, ReadsEveryTensorAndTheMetadata) {
  test::TempDir dir;
  const auto path = dir.path() / "mixed.safetensors";
  const test::Tensor f32 = test::make_tensor("a.f32", {3, 5}, "F32");
  const test::Tensor bf16 = test::make_tensor("b.bf16", {7}, "BF16");
  const test::Tensor fp8{"c.fp8", "F8_E4M3", {2, 3}, {0x38, 0x40, 0x7e, 0x01, 0x80, 0xb8}, {}};
  const test::Tensor i64{"d.i64", "I64", {2}, {1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0}, {}};
  const test::Tensor scalar{"e.scalar", "F32", {}, {0, 0, 0x80, 0x3f}, {}};
  test::write_safetensors(path, {&f32, &bf16, &fp8, &i64, &scalar});

  const SafetensorsFile file(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.file_bytes(), std::filesystem::file_size(path));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.find("missing"), nullptr);

  for (const test::Tensor* t : {&f32, &bf16, &fp8, &i64, &scalar}) {
    SCOPED_TRACE(t->name);
    const TensorView* view = file.find(t->name);
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(view->name, t->name);
    EXPECT_EQ(dtype_name(view->dtype), t->dtype);
    EXPECT_EQ(view->shape, t->shape);
    EXPECT_EQ(view->numel(), t->numel());
    ASSERT_EQ(view->nbytes, t->bytes.size());
    EXPECT_EQ(bytes_of(*view), std::string(t->bytes.begin(), t->bytes.end()));
    ASSERT_NE(view->file, nullptr);
    EXPECT_EQ(*view->file, path);
  }
  float one = 0;
  std::memcpy(&one, file.find("e.scalar")->data, 4);
  EXPECT_EQ(one, 1.0f);
}

TEST(Safetensors, ReadsATensorOrARangeOfItsBytes) {
  test::TempDir dir;
  const auto path = dir.path() / "one.safetensors";
  const test::Tensor a = test::make_tensor("before", {3}, "F32");
  const test::Tensor t = test::make_tensor("t", {4, 6}, "F32");
  test::write_safetensors(path, {&a, &t});
  const SafetensorsFile file(path);
  const TensorView& view = *file.find("t");
  std::string all(view.nbytes, '\0'), part(40, '\0');
  file.read(view, all.data());
  EXPECT_EQ(all, std::string(t.bytes.begin(), t.bytes.end()));
  file.read(view, 24, 40, part.data());
  EXPECT_EQ(part, all.substr(24, 40));
  try {
    file.read(view, 90, 8, part.data());
    ADD_FAILURE() << "a range past the tensor's end was read";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 't': bytes 90..98 are outside its 96 bytes"));
  }
}

TEST(Safetensors, EmptyHeaderObjectIsAnEmptyFile) {
  test::TempDir dir;
  const auto path = dir.path() / "empty.safetensors";
  test::write_file_bytes(path, test::encode_safetensors(json::object(), ""));
  const SafetensorsFile file(path);
  EXPECT_TRUE(file.tensors().empty());
}

// torch saves zero-element tensors with begin == end; one may share its offset with the next
// tensor's begin, whatever the order of names in the header.
TEST(Safetensors, ZeroSizeTensorSharingAnOffsetIsNotAnOverlap) {
  test::TempDir dir;
  for (const auto& [empty_name, full_name] :
       {std::pair{"a.empty", "b.full"}, std::pair{"b.empty", "a.full"}}) {
    SCOPED_TRACE(empty_name);
    const auto path = dir.path() / (std::string(empty_name) + ".safetensors");
    const json header = {
        {empty_name, {{"dtype", "F32"}, {"shape", {0, 4}}, {"data_offsets", {0, 0}}}},
        {full_name, {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
    };
    test::write_file_bytes(path, test::encode_safetensors(header, std::string(8, '\0')));
    const SafetensorsFile file(path);
    EXPECT_EQ(file.find(empty_name)->nbytes, 0u);
    EXPECT_EQ(file.find(full_name)->nbytes, 8u);
  }
}

int count_open_descriptors() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd"))
    ++n;
  return n;
}

int count_mappings_of(const std::filesystem::path& path) {
  const std::string maps = test::read_file_bytes("/proc/self/maps");
  int n = 0;
  for (size_t pos = maps.find(path.string()); pos != std::string::npos;
       pos = maps.find(path.string(), pos + 1))
    ++n;
  return n;
}

// A file refused after it was opened and mapped must give back its descriptor and mapping.
TEST(Safetensors, RefusedFileReleasesDescriptorAndMapping) {
  test::TempDir dir;
  const auto path = dir.path() / "bad-offsets.safetensors";
  const json header = {{"w", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 64}}}}};
  test::write_file_bytes(path, test::encode_safetensors(header, std::string(16, '\0')));
  const int descriptors_before = count_open_descriptors();
  for (int i = 0; i < 20; ++i) EXPECT_THROW(SafetensorsFile{path}, Error);
  EXPECT_EQ(count_open_descriptors(), descriptors_before);
  EXPECT_EQ(count_mappings_of(path), 0);
}

// ---- malformed files -----------------------------------------------------------------------

struct BadFile {
  const char* name;
  std::function<std::string()> bytes;  // the whole file
  std::vector<std::string> expected;   // substrings of the error besides the file name
};

// What gtest prints for the parameter, and so the case name ctest shows.
void PrintTo(const BadFile& c, std::ostream* os) {
  *os << c.name;
}

json entry(const char* dtype, json shape, json offsets) {
  return {{"dtype", dtype}, {"shape", std::move(shape)}, {"data_offsets", std::move(offsets)}};
}

std::string file_with(json header, size_t data_bytes = 64) {
  return test::encode_safetensors(header, std::string(data_bytes, '\x11'));
}

std::string file_with_header_text(const std::string& text, size_t data_bytes = 16) {
  return test::encode_safetensors_raw(text.size(), text, std::string(data_bytes, '\0'));
}

const BadFile kBadFiles[] = {
    {"Empty", [] { return std::string(); }, {"truncated", "0 bytes"}},
    {"SevenBytes", [] { return std::string(7, '\0'); }, {"truncated", "8-byte header length"}},
    {"HeaderLengthOnly",
     [] { return test::encode_safetensors_raw(2, "", ""); },
     {"header length 2", "runs past the end"}},
    {"HeaderLengthBeyondFile",
     [] { return test::encode_safetensors_raw(1000, "{}", std::string(10, ' ')); },
     {"header length 1000", "runs past the end"}},
    {"HeaderLengthOver100MB",
     [] { return test::encode_safetensors_raw((100ull << 20) + 1, "{}", ""); },
     {"header length 104857601", "exceeds"}},
    {"HeaderLengthMaxU64",
     [] { return test::encode_safetensors_raw(~0ull, "{}", std::string(64, ' ')); },
     {"header length 18446744073709551615", "exceeds"}},
    {"ZeroHeaderLength",
     [] { return test::encode_safetensors_raw(0, "", std::string(8, ' ')); },
     {"header does not start with '{'"}},
    {"HeaderIsAList",
     [] { return file_with_header_text("[1, 2]   "); },
     {"header does not start with '{'"}},
    {"HeaderIsBinary",
     [] { return file_with_header_text(std::string("\x00\x01\x02\x03", 4)); },
     {"header does not start with '{'"}},
    {"HeaderNotJson",
     [] { return file_with_header_text("{\"w\": {\"dtype\": \"F32\",,}}"); },
     {"header is not valid JSON"}},
    {"HeaderCutShort",
     [] { return file_with_header_text("{\"w\": {\"dtype\": \"F3"); },
     {"header is not valid JSON"}},
    {"HeaderInvalidUtf8",
     [] { return file_with_header_text("{\"w\xff\xfe\": 1}"); },
     {"header is not valid JSON"}},
    {"MetadataNotObject",
     [] {
       return file_with({{"__metadata__", "pt"}});
     },
     {"__metadata__ is not an object"}},
    {"EntryNotObject",
     [] {
       return file_with({{"layer.w", 3}});
     },
     {"tensor 'layer.w'", "not an object"}},
    {"MissingDtype",
     [] {
       return file_with({{"layer.w", {{"shape", {2}}, {"data_offsets", {0, 8}}}}});
     },
     {"tensor 'layer.w'", "'dtype'"}},
    {"DtypeNotString",
     [] {
       return file_with({{"layer.w", {{"dtype", 32}, {"shape", {2}}, {"data_offsets", {0, 8}}}}});
     },
     {"tensor 'layer.w'", "non-string 'dtype'"}},
    {"MissingShape",
     [] {
       return file_with({{"layer.w", {{"dtype", "F32"}, {"data_offsets", {0, 8}}}}});
     },
     {"tensor 'layer.w'", "'shape'"}},
    {"ShapeNotArray",
     [] {
       return file_with({{"layer.w", entry("F32", 2, {0, 8})}});
     },
     {"tensor 'layer.w'", "'shape'"}},
    {"MissingOffsets",
     [] {
       return file_with({{"layer.w", {{"dtype", "F32"}, {"shape", {2}}}}});
     },
     {"tensor 'layer.w'", "'data_offsets'"}},
    {"ThreeOffsets",
     [] {
       return file_with({{"layer.w", entry("F32", {2}, {0, 4, 8})}});
     },
     {"tensor 'layer.w'", "'data_offsets' must be [begin, end]"}},
    {"UnknownDtype",
     [] {
       return file_with({{"layer.w", entry("F7", {2}, {0, 8})}});
     },
     {"tensor 'layer.w'", "unknown dtype 'F7'"}},
    {"NegativeShape",
     [] {
       return file_with({{"layer.w", entry("F32", {-2, 4}, {0, 8})}});
     },
     {"tensor 'layer.w'", "non-negative integers"}},
    {"FractionalShape",
     [] {
       return file_with({{"layer.w", entry("F32", {2.5}, {0, 8})}});
     },
     {"tensor 'layer.w'", "non-negative integers"}},
    {"HugeShape",
     [] {
       return file_with({{"layer.w", entry("F32", {1ull << 30, 1ull << 30}, {0, 8})}});
     },
     {"tensor 'layer.w'", "implausibly large"}},
    {"ShapeProductOverflows",
     [] {
       return file_with({{"layer.w", entry("F32", {1ull << 32, 1ull << 32, 1ull << 32}, {0, 8})}});
     },
     {"tensor 'layer.w'", "implausibly large"}},
    {"NegativeOffset",
     [] {
       return file_with({{"layer.w", entry("F32", {2}, {-8, 0})}});
     },
     {"tensor 'layer.w'", "data_offsets must be non-negative integers"}},
    {"StringOffset",
     [] {
       return file_with({{"layer.w", entry("F32", {2}, {"0", 8})}});
     },
     {"tensor 'layer.w'", "data_offsets must be non-negative integers"}},
    {"BeginAfterEnd",
     [] {
       return file_with({{"layer.w", entry("F32", {2}, {16, 8})}});
     },
     {"tensor 'layer.w'", "begin 16 > end 8"}},
    {"EndBeyondData",
     [] {
       return file_with({{"layer.w", entry("F32", {32}, {0, 128})}});
     },
     {"tensor 'layer.w'", "end 128 beyond the 64 byte data section"}},
    {"OffsetNearU64Max",
     [] {
       return file_with({{"layer.w", entry("F32", {2}, {~0ull - 7, ~0ull})}});
     },
     {"tensor 'layer.w'", "beyond the 64 byte data section"}},
    {"ByteCountNotDtypeTimesShape",
     [] {
       return file_with({{"layer.w", entry("BF16", {3, 4}, {0, 48})}});
     },
     {"tensor 'layer.w'", "48 bytes in data_offsets but dtype BF16 and shape need 24"}},
    {"Overlap",
     [] {
       return file_with(
           {{"first.w", entry("F32", {4}, {0, 16})}, {"second.w", entry("F32", {4}, {8, 24})}});
     },
     {"'first.w' and 'second.w' overlap"}},
    {"SameRangeTwice",
     [] {
       return file_with(
           {{"first.w", entry("F32", {4}, {16, 32})}, {"second.w", entry("F32", {4}, {16, 32})}});
     },
     {"'first.w' and 'second.w' overlap"}},
};

class BadSafetensors : public ::testing::TestWithParam<BadFile> {};

TEST_P(BadSafetensors, RefusedWithErrorNamingFileAndField) {
  const BadFile& bad = GetParam();
  test::TempDir dir;
  const auto path = dir.path() / (std::string(bad.name) + ".safetensors");
  test::write_file_bytes(path, bad.bytes());
  try {
    const SafetensorsFile file(path);
    FAIL() << "opened without error; " << file.tensors().size() << " tensors";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_THAT(message, HasSubstr(path.string()));
    for (const auto& part : bad.expected) EXPECT_THAT(message, HasSubstr(part));
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Safetensors, BadSafetensors, ::testing::ValuesIn(kBadFiles));

TEST(Safetensors, MissingFileAndDirectoryAreErrors) {
  test::TempDir dir;
  const auto missing = dir.path() / "absent.safetensors";
  EXPECT_THROW(
      {
        try {
          SafetensorsFile{missing};
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr(missing.string()));
          EXPECT_THAT(e.what(), HasSubstr("cannot open"));
          throw;
        }
      },
      Error);
  EXPECT_THROW(
      {
        try {
          SafetensorsFile{dir.path()};
        } catch (const Error& e) {
          EXPECT_THAT(e.what(), HasSubstr(dir.path().string()));
          EXPECT_THAT(e.what(), HasSubstr("not a regular file"));
          throw;
        }
      },
      Error);
}

}  // namespace
}  // namespace colibri
