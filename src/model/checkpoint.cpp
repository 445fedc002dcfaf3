#include "model/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/input_file.h"
#include "cpu/linear.h"

namespace colibri {

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

namespace {

std::vector<std::filesystem::path> shards_from_index(
    const std::filesystem::path& index_path,
    std::unordered_map<std::string, std::string>& weight_map) {
  const std::string text = read_regular_file(index_path, "the shard index");
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", index_path.string(), e.what());
  }
  if (!root.is_object() || !root.contains("weight_map") || !root["weight_map"].is_object())
    fail("{}: missing object 'weight_map'", index_path.string());
  std::set<std::string> files;
  for (auto& [tensor, file] : root["weight_map"].items()) {
    if (!file.is_string())
      fail("{}: weight_map['{}'] is not a file name", index_path.string(), tensor);
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "..")
      fail("{}: weight_map['{}'] = '{}' is not a file in the model directory", index_path.string(),
           tensor, name);
    weight_map[tensor] = name;
    files.insert(name);
  }
  std::vector<std::filesystem::path> paths;
  for (const auto& f : files) paths.push_back(index_path.parent_path() / f);
  return paths;
}

}  // namespace

Checkpoint::Checkpoint(const std::filesystem::path& model_dir,
                       std::optional<std::array<int, 2>> fp8_block,
                       std::optional<int> int4_group_size)
    : dir_(model_dir), fp8_block_(fp8_block) {
  check_readable_directory(dir_, "the model directory");
  std::vector<std::filesystem::path> paths;
  std::unordered_map<std::string, std::string> weight_map;
  const auto index_path = dir_ / "model.safetensors.index.json";
  if (path_present(index_path, "the shard index")) {
    paths = shards_from_index(index_path, weight_map);
  } else if (path_present(dir_ / "model.safetensors", "the checkpoint")) {
    paths.push_back(dir_ / "model.safetensors");
  } else {
    std::error_code ec;
    for (std::filesystem::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().extension() == ".safetensors") paths.push_back(it->path());
    if (ec) fail("{}: cannot list the model directory: {}", dir_.string(), ec.message());
    std::sort(paths.begin(), paths.end());
  }
  if (paths.empty()) fail("{}: no safetensors files", dir_.string());

  for (const auto& path : paths) {
    if (!path_present(path, "the shard")) fail("{}: shard is missing", path.string());
    shards_.push_back(std::make_unique<SafetensorsFile>(path));
    for (const auto& [name, view] : shards_.back()->tensors()) {
      auto [it, inserted] = tensors_.emplace(name, &view);
      if (!inserted)
        fail("{}: tensor '{}' also appears in {}", path.string(), name, it->second->file->string());
    }
  }
  for (const auto& [tensor, file] : weight_map) {
    const TensorView* view = find(tensor);
    if (!view)
      fail("{}: tensor '{}' listed in the index is missing", (dir_ / file).string(), tensor);
    if (view->file->filename() != file)
      fail("{}: tensor '{}' is in {} but the index says {}", index_path.string(), tensor,
           view->file->string(), file);
  }
  index_packed_int4(int4_group_size);
  index_nvfp4();
}

void Checkpoint::index_nvfp4() {
  constexpr std::string_view kScale = "_scale", kScale2 = "_scale_2";
  for (const auto& [tensor, view] : tensors_) {
    if (tensor.find("nvfp4_csf") != std::string::npos)
      fail(
          "{}: tensor '{}' holds CSF-encoded NVFP4 block scales, which are not read (plain E4M3 "
          "'weight_scale' tensors only)",
          view->file->string(), tensor);
    // A weight is found by its block scales (F8_E4M3; compressed-tensors' `_scale` are wider) or
    // its second-level scale.
    std::string name;
    if (tensor.ends_with(".weight_scale_2"))
      name = tensor.substr(0, tensor.size() - kScale2.size());
    else if (tensor.ends_with(".weight_scale") && view->dtype == Dtype::F8_E4M3)
      name = tensor.substr(0, tensor.size() - kScale.size());
    else
      continue;
    if (nvfp4_.count(name)) continue;
    const std::string scale_name = name + "_scale", global_name = name + "_scale_2";
    const std::string module = name.substr(0, name.size() - std::string_view(".weight").size());
    const std::string input_name = module + ".input_scale";
    const TensorView* weight = find(name);
    if (!weight)
      fail("{}: tensor '{}' is an NVFP4 scale, but its weight '{}' is missing",
           view->file->string(), tensor, name);
    const std::string file = weight->file->string();
    if (weight->dtype != Dtype::U8 || weight->shape.size() != 2 || weight->shape[0] < 1 ||
        weight->shape[1] < 1)
      fail(
          "{}: tensor '{}' has dtype {} and shape {}, expected U8 [out, in / 2] (NVFP4: two E2M1 "
          "codes a byte)",
          file, name, dtype_name(weight->dtype), shape_string(weight->shape));
    if (find(name + kQuantScaleSuffix))
      fail("{}: tensor '{}' has both NVFP4 scales ('{}') and container scales ('{}{}')", file, name,
           tensor, name, kQuantScaleSuffix);
    const int64_t rows = weight->shape[0], cols = 2 * weight->shape[1];
    const TensorView* scale = find(scale_name);
    const TensorView* global = find(global_name);
    if (!scale || !global)
      fail("{}: NVFP4 tensor '{}' has no '{}'", file, name, scale ? global_name : scale_name);
    const std::string scale_file = scale->file->string();
    if (scale->dtype != Dtype::F8_E4M3 || scale->shape.size() != 2)
      fail("{}: tensor '{}' has dtype {} and shape {}, expected F8_E4M3 [{}, {}] for '{}'",
           scale_file, scale_name, dtype_name(scale->dtype), shape_string(scale->shape), rows,
           cols / 16, name);
    if (scale->shape[0] != rows || scale->shape[1] * 16 != cols) {
      const int64_t blocks = scale->shape[1];
      if (scale->shape[0] == rows && blocks > 0 && cols % blocks == 0)
        fail(
            "{}: tensor '{}' has shape {}: blocks of {} columns of '{}' [{}, {}], but NVFP4 "
            "reads blocks of 16",
            scale_file, scale_name, shape_string(scale->shape), cols / blocks, name, rows, cols);
      fail("{}: tensor '{}' has shape {}, expected [{}, {}] for '{}' [{}, {}] in blocks of 16",
           scale_file, scale_name, shape_string(scale->shape), rows, cols / 16, name, rows, cols);
    }
    for (const auto& [scalar_name, scalar] :
         {std::pair{global_name, global}, std::pair{input_name, find(input_name)}}) {
      if (scalar && (scalar->dtype != Dtype::F32 || scalar->numel() != 1))
        fail("{}: tensor '{}' has dtype {} and shape {}, expected an F32 scalar",
             scalar->file->string(), scalar_name, dtype_name(scalar->dtype),
             shape_string(scalar->shape));
    }
    nvfp4_.emplace(name, Nvfp4Tensors{weight, scale, global, find(input_name), rows, cols});
  }
}

const Checkpoint::Nvfp4Tensors* Checkpoint::nvfp4_tensors(const std::string& name) const {
  const auto it = nvfp4_.find(name);
  return it == nvfp4_.end() ? nullptr : &it->second;
}

Nvfp4Matrix Checkpoint::load_nvfp4(const std::string& name, int64_t rows, int64_t cols,
                                   int64_t row_begin, int64_t row_end) const {
  const Nvfp4Tensors* t = nvfp4_tensors(name);
  if (!t) fail("{}: tensor '{}' is not an NVFP4 weight", dir_.string(), name);
  const std::string file = t->weight->file->string();
  if (t->rows != rows || t->cols != cols)
    fail("{}: NVFP4 tensor '{}' is [{}, {}] (U8 {}), expected [{}, {}]", file, name, t->rows,
         t->cols, shape_string(t->weight->shape), rows, cols);
  if (row_end < 0) row_end = rows;
  if (row_begin < 0 || row_end <= row_begin || row_end > rows)
    fail("{}: rows {}..{} of NVFP4 tensor '{}' [{}, {}]", file, row_begin, row_end, name, rows,
         cols);
  Nvfp4Matrix m;
  const auto read_scalar = [this](const TensorView& v) {
    float value = 0;
    shard_of(v).read(v, &value);
    return value;
  };
  m.global = read_scalar(*t->global);
  if (!std::isfinite(m.global) || m.global < 0)
    fail("{}: tensor '{}_scale_2' is {}, expected a finite scale >= 0", t->global->file->string(),
         name, m.global);
  if (t->input_scale) {
    const float input = read_scalar(*t->input_scale);
    if (!std::isfinite(input) || !(input > 0))
      fail("{}: tensor '{}' is {}, expected a finite scale > 0", t->input_scale->file->string(),
           t->input_scale->name, input);
  }
  const auto code_row = size_t(cols / 2), scale_row = size_t(cols / 16);
  const auto n = size_t(row_end - row_begin);
  m.codes.resize(n * code_row);
  shard_of(*t->weight)
      .read(*t->weight, size_t(row_begin) * code_row, m.codes.size(), m.codes.data());
  m.scales.resize(n * scale_row);
  shard_of(*t->scale).read(*t->scale, size_t(row_begin) * scale_row, m.scales.size(),
                           m.scales.data());
  for (size_t i = 0; i < m.scales.size(); ++i)
    if ((m.scales[i] & 0x7F) == 0x7F)
      fail("{}: tensor '{}_scale' has a NaN (byte {:#04x}) at [{}, {}]", t->scale->file->string(),
           name, m.scales[i], row_begin + int64_t(i / scale_row), i % scale_row);
  bytes_loaded_ +=
      m.codes.size() + m.scales.size() + sizeof(float) + (t->input_scale ? sizeof(float) : 0);
  return m;
}

void Checkpoint::index_packed_int4(std::optional<int> int4_group_size) {
  static_assert(std::endian::native == std::endian::little,
                "compressed-tensors int32 words are read as little-endian bytes");
  constexpr std::string_view kPacked = "_packed";
  for (const auto& [packed_name, packed] : tensors_) {
    if (!packed_name.ends_with(".weight_packed")) continue;
    const std::string name = packed_name.substr(0, packed_name.size() - kPacked.size());
    const std::string file = packed->file->string();
    if (find(name)) fail("{}: tensor '{}' is stored both as it is and packed", file, name);
    if (const TensorView* g_idx = find(name + "_g_idx"))
      fail(
          "{}: tensor '{}_g_idx' is not supported: compressed-tensors INT4 weights are read in "
          "stored order (no activation order)",
          g_idx->file->string(), name);
    if (packed->dtype != Dtype::I32 || packed->shape.size() != 2)
      fail("{}: tensor '{}' has dtype {} and shape {}, expected I32 [rows, ceil(cols / 8)]", file,
           packed_name, dtype_name(packed->dtype), shape_string(packed->shape));
    const std::string scale_name = name + "_scale", shape_name = name + "_shape";
    const TensorView* scale = find(scale_name);
    const TensorView* shape = find(shape_name);
    if (!scale || !shape)
      fail("{}: tensor '{}' has no '{}'", file, packed_name, scale ? shape_name : scale_name);
    if (!is_float_dtype(scale->dtype) || scale->dtype == Dtype::F8_E4M3 || scale->shape.size() != 2)
      fail("{}: tensor '{}' has dtype {} and shape {}, expected BF16, F16 or F32 [rows, groups]",
           scale->file->string(), scale_name, dtype_name(scale->dtype), shape_string(scale->shape));
    if ((shape->dtype != Dtype::I64 && shape->dtype != Dtype::I32) ||
        shape->shape != std::vector<int64_t>{2})
      fail("{}: tensor '{}' has dtype {} and shape {}, expected I64 [2]", shape->file->string(),
           shape_name, dtype_name(shape->dtype), shape_string(shape->shape));
    int64_t dims[2];
    if (shape->dtype == Dtype::I64) {
      shard_of(*shape).read(*shape, dims);
    } else {
      int32_t d32[2];
      shard_of(*shape).read(*shape, d32);
      dims[0] = d32[0], dims[1] = d32[1];
    }
    const int64_t rows = dims[0], cols = dims[1];
    if (rows <= 0 || cols <= 0 || packed->shape[0] != rows || packed->shape[1] != (cols + 7) / 8)
      fail("{}: tensor '{}' has shape {}, but '{}' says [{}, {}] (expected [{}, {}])", file,
           packed_name, shape_string(packed->shape), shape_name, rows, cols, rows, (cols + 7) / 8);
    const int64_t groups = scale->shape[1];
    if (scale->shape[0] != rows || groups < 1)
      fail("{}: tensor '{}' has shape {}, expected [{}, groups] for [{}, {}]",
           scale->file->string(), scale_name, shape_string(scale->shape), rows, rows, cols);
    // The group size: the config's when given, else the one container size that fits.
    int group_size = 0;
    const auto groups_of = [&](int g) { return g == 0 ? 1 : (cols + g - 1) / g; };
    if (int4_group_size) {
      if (groups_of(*int4_group_size) != groups)
        fail(
            "{}: tensor '{}' has {} groups a row, expected {} for [{}, {}] in groups of {} "
            "(config.json quantization_config)",
            scale->file->string(), scale_name, groups, groups_of(*int4_group_size), rows, cols,
            *int4_group_size);
      group_size = groups == 1 ? 0 : *int4_group_size;
    } else if (groups > 1) {
      std::vector<int> fits;
      for (int g = 1; g <= 256; ++g)
        if (kernels::is_valid_group_size(g) && groups_of(g) == groups) fits.push_back(g);
      // compressed-tensors' quantizer writes only group sizes that divide the columns.
      if (fits.size() > 1 &&
          std::count_if(fits.begin(), fits.end(), [&](int g) { return cols % g == 0; }) == 1)
        fits = {*std::find_if(fits.begin(), fits.end(), [&](int g) { return cols % g == 0; })};
      if (fits.size() != 1)
        fail(
            "{}: tensor '{}' has {} groups a row for [{}, {}]: {} of the container's group sizes "
            "fit ({})",
            scale->file->string(), scale_name, groups, rows, cols, fits.size(),
            fmt::join(fits, ", "));
      group_size = fits[0];
    }
    // Zero points (asymmetric): pack_to_int32 along the rows, zp + 8 of row r and group g at
    // bits 4(r % 8) of word [r / 8, g]. Every nibble is a zero point in [-8, 7].
    const std::string zero_name = name + "_zero_point";
    const TensorView* zero = find(zero_name);
    if (zero &&
        (zero->dtype != Dtype::I32 || zero->shape != std::vector<int64_t>{(rows + 7) / 8, groups}))
      fail(
          "{}: tensor '{}' has dtype {} and shape {}, expected I32 [{}, {}] (zero points of "
          "'{}' [{}, {}] in {} groups a row, packed 8 rows a word)",
          zero->file->string(), zero_name, dtype_name(zero->dtype), shape_string(zero->shape),
          (rows + 7) / 8, groups, packed_name, rows, cols, groups);
    packed_int4_.emplace(name, PackedInt4{packed, scale, zero, rows, cols, group_size});
  }
}

const TensorView* Checkpoint::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [name, view] : tensors_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

void Checkpoint::read_f32(const TensorView& view, float* out) const {
  // pread, not the mapping: a file truncated or changed under a running process is then a read
  // error naming the file, not a SIGBUS.
  if (view.dtype == Dtype::F32) {
    shard_of(view).read(view, out);
  } else {
    std::vector<std::byte> bytes(view.nbytes);
    shard_of(view).read(view, bytes.data());
    convert_to_f32(view.dtype, bytes.data(), size_t(view.numel()), out);
  }
  bytes_loaded_ += view.nbytes;
}

std::vector<float> Checkpoint::load_f32(const std::string& name,
                                        const std::vector<int64_t>& shape) const {
  const TensorView* view = find(name);
  if (is_packed_int4(name)) {
    if (shape.size() != 2)
      fail("{}: tensor '{}' is quantized (INT4) but a float tensor of shape {} is expected",
           dir_.string(), name, shape_string(shape));
    const QuantMatrix q = load_quant(name, shape[0], shape[1]);
    std::vector<float> out(size_t(shape[0] * shape[1]));
    kernels::dequantize(q.view(), out.data());
    return out;
  }
  if (!view) fail("{}: tensor '{}' is missing", dir_.string(), name);
  const std::string file = view->file->string();
  if (is_nvfp4(name)) {
    if (shape.size() != 2)
      fail("{}: tensor '{}' is quantized (NVFP4) but a float tensor of shape {} is expected", file,
           name, shape_string(shape));
    const Nvfp4Matrix m = load_nvfp4(name, shape[0], shape[1]);
    std::vector<float> out(size_t(shape[0] * shape[1]));
    kernels::dequantize_nvfp4({m.codes.data(), m.scales.data(), m.global, shape[0], shape[1]},
                              out.data());
    return out;
  }
  if (view->dtype == Dtype::U8) {
    if (shape.size() != 2)
      fail("{}: tensor '{}' is quantized (U8) but a float tensor of shape {} is expected", file,
           name, shape_string(shape));
    const QuantMatrix q = load_quant(name, shape[0], shape[1]);
    std::vector<float> out(size_t(shape[0] * shape[1]));
    kernels::dequantize(q.view(), out.data());
    return out;
  }
  if (view->shape != shape)
    fail("{}: tensor '{}' has shape {}, expected {}", file, name, shape_string(view->shape),
         shape_string(shape));
  if (!is_float_dtype(view->dtype))
    fail("{}: tensor '{}' has dtype {}, expected a float type", file, name,
         dtype_name(view->dtype));
  std::vector<float> out(size_t(view->numel()));
  read_f32(*view, out.data());
  if (view->dtype != Dtype::F8_E4M3) return out;

  // DeepSeek-style block scales: W[i, j] *= scale_inv[i / block_rows, j / block_cols].
  if (shape.size() != 2) fail("{}: F8_E4M3 tensor '{}' must be 2-D", file, name);
  const Fp8Matrix blocks = fp8_scales(name, shape[0], shape[1]);
  const int64_t rows = shape[0], cols = shape[1];
  const int64_t scale_cols = (cols + blocks.block_cols - 1) / blocks.block_cols;
  for (int64_t i = 0; i < rows; ++i) {
    const float* scale_row = &blocks.scales[size_t((i / blocks.block_rows) * scale_cols)];
    float* row = &out[size_t(i * cols)];
    for (int64_t j = 0; j < cols; ++j) row[j] *= scale_row[j / blocks.block_cols];
  }
  return out;
}

Fp8Matrix Checkpoint::fp8_scales(const std::string& name, int64_t rows, int64_t cols) const {
  const std::string scale_name = name + "_scale_inv";
  const TensorView* scale = find(scale_name);
  if (!scale)
    fail("{}: F8_E4M3 tensor '{}' has no '{}'", find(name)->file->string(), name, scale_name);
  const auto [block_rows, block_cols] = fp8_block_.value_or(std::array<int, 2>{128, 128});
  const std::vector<int64_t> scale_shape = {(rows + block_rows - 1) / block_rows,
                                            (cols + block_cols - 1) / block_cols};
  if (scale->shape != scale_shape)
    fail("{}: tensor '{}' has shape {}, expected {} for {}x{} blocks of '{}'",
         scale->file->string(), scale_name, shape_string(scale->shape), shape_string(scale_shape),
         block_rows, block_cols, name);
  if (!is_float_dtype(scale->dtype))
    fail("{}: tensor '{}' has dtype {}, expected a float type", scale->file->string(), scale_name,
         dtype_name(scale->dtype));
  Fp8Matrix out;
  out.block_rows = block_rows;
  out.block_cols = block_cols;
  out.scales.resize(size_t(scale->numel()));
  read_f32(*scale, out.scales.data());
  return out;
}

bool Checkpoint::is_fp8(const std::string& name) const {
  const TensorView* view = find(name);
  return view && view->dtype == Dtype::F8_E4M3;
}

Fp8Matrix Checkpoint::load_fp8(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorView* view = find(name);
  if (!view) fail("{}: tensor '{}' is missing", dir_.string(), name);
  const std::string file = view->file->string();
  if (view->dtype != Dtype::F8_E4M3)
    fail("{}: tensor '{}' has dtype {}, expected F8_E4M3", file, name, dtype_name(view->dtype));
  if (shape.size() != 2 || view->shape != shape)
    fail("{}: tensor '{}' has shape {}, expected {}", file, name, shape_string(view->shape),
         shape_string(shape));
  Fp8Matrix out = fp8_scales(name, shape[0], shape[1]);
  for (size_t i = 0; i < out.scales.size(); ++i)
    if (!std::isfinite(out.scales[i]))
      fail("{}: tensor '{}_scale_inv' has a non-finite scale {} at index {}", file, name,
           out.scales[i], i);
  out.bits.resize(view->nbytes);
  shard_of(*view).read(*view, out.bits.data());
  bytes_loaded_ += view->nbytes;
  for (size_t i = 0; i < out.bits.size(); ++i)
    if ((out.bits[i] & 0x7F) == 0x7F)
      fail("{}: tensor '{}' has a NaN (byte {:#04x}) at [{}, {}]", file, name, out.bits[i],
           int64_t(i) / shape[1], int64_t(i) % shape[1]);
  return out;
}

bool Checkpoint::is_bf16(const std::string& name) const {
  const TensorView* view = find(name);
  return view && view->dtype == Dtype::BF16;
}

std::vector<uint16_t> Checkpoint::load_bf16(const std::string& name,
                                            const std::vector<int64_t>& shape) const {
  const TensorView* view = find(name);
  if (!view) fail("{}: tensor '{}' is missing", dir_.string(), name);
  if (view->dtype != Dtype::BF16)
    fail("{}: tensor '{}' has dtype {}, expected BF16", view->file->string(), name,
         dtype_name(view->dtype));
  if (view->shape != shape)
    fail("{}: tensor '{}' has shape {}, expected {}", view->file->string(), name,
         shape_string(view->shape), shape_string(shape));
  std::vector<uint16_t> out(size_t(view->numel()));
  shard_of(*view).read(*view, out.data());  // little-endian BF16 as stored
  bytes_loaded_ += view->nbytes;
  return out;
}

bool Checkpoint::is_quantized(const std::string& name) const {
  const TensorView* view = find(name);
  return (view && view->dtype == Dtype::U8 && !is_nvfp4(name)) || is_packed_int4(name);
}

std::optional<Checkpoint::PackedInt4Shape> Checkpoint::packed_int4_shape(
    const std::string& name) const {
  const auto it = packed_int4_.find(name);
  if (it == packed_int4_.end()) return std::nullopt;
  const PackedInt4& p = it->second;
  const kernels::QuantFormat format =
      p.group_size ? kernels::QuantFormat::kInt4Grouped : kernels::QuantFormat::kInt4Row;
  return PackedInt4Shape{p.rows, p.cols, {format, p.group_size}};
}

std::string Checkpoint::quant_scale_name(const std::string& name) const {
  return is_packed_int4(name) ? name + "_scale" : name + kQuantScaleSuffix;
}

uint64_t Checkpoint::quant_bytes(const std::string& name, int64_t rows, int64_t cols) const {
  if (const auto p = packed_int4_shape(name)) {
    const uint64_t scales =
        uint64_t(kernels::scale_count(p->spec.format, p->rows, p->cols, p->spec.group_size));
    // Zero points are held as one fp32 offset per scale.
    return uint64_t(kernels::packed_bytes(p->spec.format, p->rows, p->cols)) + 4 * scales +
           (has_zero_points(name) ? 4 * scales : 0);
  }
  const TensorView* w = find(name);
  const TensorView* qs = find(name + kQuantScaleSuffix);
  if (!w || !qs)
    fail("{}: tensor '{}' is not a quantized weight [{}, {}]", dir_.string(), name, rows, cols);
  return w->nbytes + qs->nbytes;
}

const SafetensorsFile& Checkpoint::shard_of(const TensorView& view) const {
  for (const auto& shard : shards_)
    if (view.file == &shard->path()) return *shard;
  fail("{}: tensor '{}' belongs to no open shard", dir_.string(), view.name);
}

QuantMatrix Checkpoint::load_quant(const std::string& name, int64_t rows, int64_t cols,
                                   int64_t row_begin, int64_t row_end) const {
  if (const auto it = packed_int4_.find(name); it != packed_int4_.end())
    return load_packed_int4(name, it->second, rows, cols, row_begin, row_end);
  const TensorView* view = find(name);
  if (!view) fail("{}: tensor '{}' is missing", dir_.string(), name);
  const std::string file = view->file->string();
  if (view->dtype != Dtype::U8)
    fail("{}: tensor '{}' has dtype {}, expected U8 (a quantized weight)", file, name,
         dtype_name(view->dtype));
  const std::string scale_name = name + kQuantScaleSuffix;
  const TensorView* scale = find(scale_name);
  if (!scale) fail("{}: quantized tensor '{}' has no scales '{}'", file, name, scale_name);
  if (scale->dtype != Dtype::F32)
    fail("{}: tensor '{}' has dtype {}, expected F32 scales of '{}'", scale->file->string(),
         scale_name, dtype_name(scale->dtype), name);
  const QuantResolution r = resolve_quant_format(int64_t(view->nbytes), scale->numel(), rows, cols);
  if (!r.ok())
    fail("{}: quantized tensor '{}' ({} bytes, {} scales, expected [{}, {}]): {}", file, name,
         view->nbytes, scale->numel(), rows, cols, r.error);
  if (row_end < 0) row_end = rows;
  if (row_begin < 0 || row_end <= row_begin || row_end > rows)
    fail("{}: rows {}..{} of quantized tensor '{}' [{}, {}]", file, row_begin, row_end, name, rows,
         cols);
  QuantMatrix q;
  q.format = r.spec.format;
  q.rows = row_end - row_begin;
  q.cols = cols;
  q.group_size = r.spec.group_size;
  // pread into owned buffers: an expert rank reads each expert it loads with one request per
  // tensor instead of faulting the mapping in page by page. Rows are contiguous in the stored
  // layout, their scales too.
  const auto row_bytes = size_t(kernels::row_bytes(q.format, cols));
  const auto scale_at = [&](int64_t row) {
    return size_t(kernels::scale_count(q.format, row, cols, q.group_size));
  };
  q.data.resize(size_t(q.rows) * row_bytes);
  shard_of(*view).read(*view, size_t(row_begin) * row_bytes, q.data.size(), q.data.data());
  q.scales.resize(scale_at(row_end) - scale_at(row_begin));
  shard_of(*scale).read(*scale, scale_at(row_begin) * sizeof(float),
                        q.scales.size() * sizeof(float), q.scales.data());
  bytes_loaded_ += q.data.size() + q.scales.size() * sizeof(float);
  return q;
}

QuantMatrix Checkpoint::load_packed_int4(const std::string& name, const PackedInt4& p, int64_t rows,
                                         int64_t cols, int64_t row_begin, int64_t row_end) const {
  const std::string file = p.packed->file->string();
  if (p.rows != rows || p.cols != cols)
    fail("{}: tensor '{}_shape' is [{}, {}], expected [{}, {}]", file, name, p.rows, p.cols, rows,
         cols);
  if (row_end < 0) row_end = rows;
  if (row_begin < 0 || row_end <= row_begin || row_end > rows)
    fail("{}: rows {}..{} of quantized tensor '{}' [{}, {}]", file, row_begin, row_end, name, rows,
         cols);
  QuantMatrix q;
  q.format = p.group_size ? kernels::QuantFormat::kInt4Grouped : kernels::QuantFormat::kInt4Row;
  q.rows = row_end - row_begin;
  q.cols = cols;
  q.group_size = p.group_size;
  // A stored row is whole int32 words; the container's row is its first ceil(cols / 2) bytes.
  const auto stored_row = size_t(p.packed->shape[1]) * 4;
  const auto row_bytes = size_t(kernels::row_bytes(q.format, cols));
  std::vector<uint8_t> words(size_t(q.rows) * stored_row);
  shard_of(*p.packed).read(*p.packed, size_t(row_begin) * stored_row, words.size(), words.data());
  q.data.resize(size_t(q.rows) * row_bytes);
  for (int64_t r = 0; r < q.rows; ++r) {
    uint8_t* row = q.data.data() + size_t(r) * row_bytes;
    std::copy_n(words.data() + size_t(r) * stored_row, row_bytes, row);
    if (cols % 2) row[row_bytes - 1] = uint8_t((row[row_bytes - 1] & 0x0F) | 0x80);  // padding
  }
  const auto groups = size_t(p.scale->shape[1]);
  const size_t elem = dtype_size(p.scale->dtype);
  std::vector<std::byte> scale_bytes(size_t(q.rows) * groups * elem);
  shard_of(*p.scale).read(*p.scale, size_t(row_begin) * groups * elem, scale_bytes.size(),
                          scale_bytes.data());
  q.scales.resize(size_t(q.rows) * groups);
  convert_to_f32(p.scale->dtype, scale_bytes.data(), q.scales.size(), q.scales.data());
  bytes_loaded_ += words.size() + scale_bytes.size();
  if (p.zero_point) {
    // offset = -zp * s: with the nibbles' q * s, exactly (q - zp) * s (both products and their
    // sum are exact in fp32 for BF16 and F16 scales).
    const int64_t w0 = row_begin / 8, w1 = (row_end + 7) / 8;
    std::vector<uint32_t> zero_words(size_t(w1 - w0) * groups);
    shard_of(*p.zero_point)
        .read(*p.zero_point, size_t(w0) * groups * 4, zero_words.size() * 4, zero_words.data());
    q.offsets.resize(q.scales.size());
    for (int64_t r = 0; r < q.rows; ++r) {
      const int64_t row = row_begin + r;
      for (size_t g = 0; g < groups; ++g) {
        const uint32_t word = zero_words[size_t(row / 8 - w0) * groups + g];
        const int zp = int((word >> (4 * (row % 8))) & 15) - 8;
        q.offsets[size_t(r) * groups + g] = float(-zp) * q.scales[size_t(r) * groups + g];
      }
    }
    bytes_loaded_ += zero_words.size() * 4;
  }
  return q;
}

}  // namespace colibri
