#include "tools/convert.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "common/error.h"
#include "common/safetensors.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/container.h"

namespace colibri {

namespace {

namespace fs = std::filesystem;
using kernels::QuantFormat;
using nlohmann::json;

// Files copied unchanged from the source directory when present.
constexpr const char* kCopiedFiles[] = {
    "config.json",           "generation_config.json",  "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "hf_quant_config.json"};

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// kNvfp4: an NVFP4 weight written as stored (its codes, block scales, second-level and input
// scales), read back as NVFP4 by the loader.
enum class Storage { kF32, kBF16, kQuant, kNvfp4 };

// How one source tensor is written.
struct Plan {
  std::string name;
  std::vector<int64_t> shape;  // source shape
  Storage storage = Storage::kF32;
  QuantSpec spec{QuantFormat::kInt8Row, 0};
  std::string expert;      // "model.layers.L.mlp.experts.E." for routed experts, else empty
  bool as_stored = false;  // a symmetric compressed-tensors INT4 weight, with its own numbers
  const Checkpoint::Nvfp4Tensors* nvfp4 = nullptr;  // Storage::kNvfp4: its tensors

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  uint64_t data_bytes() const {
    if (storage == Storage::kF32) return 4 * uint64_t(numel());
    if (storage == Storage::kBF16) return 2 * uint64_t(numel());
    if (storage == Storage::kNvfp4) return uint64_t(numel()) / 2;
    return uint64_t(kernels::packed_bytes(spec.format, shape[0], shape[1]));
  }
  uint64_t scale_bytes() const {
    return 4 * uint64_t(kernels::scale_count(spec.format, shape[0], shape[1], spec.group_size));
  }
};

// Tensors written together: a routed expert's gate, up and down (data of all three, then their
// scales, so that an expert is one contiguous read), or a single tensor.
using Unit = std::vector<Plan>;

Storage storage_for_bits(int bits) {
  return bits == 32 ? Storage::kF32 : bits == 16 ? Storage::kBF16 : Storage::kQuant;
}

QuantSpec spec_for_bits(int bits, int group_size, int64_t cols) {
  if (bits == 8) return {QuantFormat::kInt8Row, 0};
  if (group_size == 0 || (cols + group_size - 1) / group_size <= 1)
    return {QuantFormat::kInt4Row, 0};
  return {QuantFormat::kInt4Grouped, group_size};
}

// "model.layers.L.mlp.experts.E." for a routed expert's tensor, else empty.
std::string expert_of(const std::string& name) {
  const size_t at = name.find(".mlp.experts.");
  if (at == std::string::npos) return {};
  const size_t end = name.find('.', at + std::string_view(".mlp.experts.").size());
  return name.substr(0, end + 1);
}

// The planned output of a resolvable spec, else an Error naming the tensor.
void check_resolvable(const Plan& p, const TensorView& view) {
  const QuantResolution back = resolve_quant_format(
      int64_t(p.data_bytes()), int64_t(p.scale_bytes() / 4), p.shape[0], p.shape[1]);
  if (!back.ok() || back.spec.format != p.spec.format || back.spec.group_size != p.spec.group_size)
    fail("{}: tensor '{}' {}: {} would not be readable unambiguously ({}); {}", view.file->string(),
         p.name, shape_string(p.shape), quant_spec_name(p.spec),
         back.ok() ? "reads as " + quant_spec_name(back.spec) : back.error,
         p.as_stored ? "the container cannot hold its stored grouping"
                     : "choose another --group-size");
}

// The NVFP4 weight `name` belongs to as one of its scales (`<weight>_scale`, `<weight>_scale_2`,
// `<module>.input_scale`), or empty.
std::string nvfp4_weight_of_scale(const Checkpoint& checkpoint, const std::string& name) {
  for (const std::string_view suffix : {"_scale_2", "_scale"})
    if (ends_with(name, suffix)) {
      const std::string weight = name.substr(0, name.size() - suffix.size());
      if (checkpoint.is_nvfp4(weight)) return weight;
    }
  constexpr std::string_view kInput = ".input_scale";
  if (ends_with(name, kInput)) {
    const std::string weight = name.substr(0, name.size() - kInput.size()) + ".weight";
    if (checkpoint.is_nvfp4(weight)) return weight;
  }
  return {};
}

// The storage of the 2-D float weight p.name [p.shape] (read from `view`): the bits its kind
// is given (io, routed expert, dense).
void plan_weight_bits(Plan& p, const ConvertOptions& o, const TensorView& view) {
  int bits = o.dense_bits;
  if (p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight") {
    bits = o.io_bits;
  } else if (p.expert = expert_of(p.name); !p.expert.empty()) {
    bits = o.expert_bits;
  }
  p.storage = storage_for_bits(bits);
  if (p.storage != Storage::kQuant) return;
  p.spec = spec_for_bits(bits, o.group_size, p.shape[1]);
  check_resolvable(p, view);
}

std::optional<Plan> plan_tensor(const Checkpoint& checkpoint, const ConvertOptions& o,
                                const TensorView& view) {
  const std::string& name = view.name;
  // NVIDIA ModelOpt NVFP4: no container format holds its numbers (E2M1 times an E4M3 scale per 16
  // columns times a per-tensor scale), so by default it is written as stored, its scales with it,
  // and loaded as NVFP4 again; with nvfp4_as_stored false it is dequantized and quantized as a
  // float weight of its kind.
  if (!nvfp4_weight_of_scale(checkpoint, name).empty()) return std::nullopt;  // with its weight
  if (const Checkpoint::Nvfp4Tensors* t = checkpoint.nvfp4_tensors(name); t && o.nvfp4_as_stored) {
    Plan p;
    p.name = name;
    p.shape = {t->rows, t->cols};
    p.storage = Storage::kNvfp4;
    p.expert = expert_of(name);
    p.nvfp4 = t;
    return p;
  }
  // compressed-tensors INT4: `<weight>_packed` stands for the weight, its `_scale`, `_shape` and
  // `_zero_point` are read with it. Symmetric, its numbers are the container's: written as they
  // are, in its group size. Asymmetric, no container format holds (q - zp) * s: dequantized and
  // quantized (symmetric) as the float weights of its kind.
  for (const std::string_view suffix : {"_packed", "_scale", "_shape", "_zero_point"}) {
    if (!ends_with(name, suffix)) continue;
    const std::string weight = name.substr(0, name.size() - suffix.size());
    const auto packed = checkpoint.packed_int4_shape(weight);
    if (!packed) continue;
    if (suffix != "_packed") return std::nullopt;
    if (checkpoint.has_zero_points(weight)) {
      Plan p;
      p.name = weight;
      p.shape = {packed->rows, packed->cols};
      plan_weight_bits(p, o, view);
      return p;
    }
    Plan p;
    p.name = weight;
    p.shape = {packed->rows, packed->cols};
    p.storage = Storage::kQuant;
    p.spec = packed->spec;
    p.expert = expert_of(weight);
    p.as_stored = true;
    check_resolvable(p, view);
    return p;
  }
  if (ends_with(name, "_scale_inv")) {
    const TensorView* base =
        checkpoint.find(name.substr(0, name.size() - std::string_view("_scale_inv").size()));
    if (base && base->dtype == Dtype::F8_E4M3) return std::nullopt;  // folded into its weight
  }
  const bool nvfp4 = checkpoint.is_nvfp4(name);  // requantized: planned as its float values
  if (view.dtype == Dtype::U8 && !nvfp4)
    fail("{}: tensor '{}' is U8: the source is already quantized", view.file->string(), name);
  if (!is_float_dtype(view.dtype) && !nvfp4)
    fail("{}: tensor '{}' has dtype {}, expected a float type", view.file->string(), name,
         dtype_name(view.dtype));
  Plan p;
  p.name = name;
  p.shape = view.shape;
  if (nvfp4) p.shape = {checkpoint.nvfp4_tensors(name)->rows, checkpoint.nvfp4_tensors(name)->cols};
  // Norms, the router and its bias, biases and anything not a 2-D weight stay F32.
  if (view.shape.size() != 2 || !ends_with(name, ".weight") ||
      name.find("norm") != std::string::npos || ends_with(name, "mlp.gate.weight"))
    return p;
  plan_weight_bits(p, o, view);
  return p;
}

int proj_rank(const std::string& name) {
  if (name.find("gate_proj") != std::string::npos) return 0;
  if (name.find("up_proj") != std::string::npos) return 1;
  return 2;
}

std::vector<Unit> plan_shard(const Checkpoint& checkpoint, const ConvertOptions& o,
                             const std::vector<const TensorView*>& views) {
  std::vector<Unit> units;
  std::map<std::string, size_t> expert_unit;
  for (const TensorView* view : views) {
    std::optional<Plan> p = plan_tensor(checkpoint, o, *view);
    if (!p) continue;
    if (p->expert.empty()) {
      units.push_back({std::move(*p)});
      continue;
    }
    auto [it, inserted] = expert_unit.emplace(p->expert, units.size());
    if (inserted) units.emplace_back();
    units[it->second].push_back(std::move(*p));
  }
  for (Unit& unit : units)
    std::stable_sort(unit.begin(), unit.end(), [](const Plan& a, const Plan& b) {
      return proj_rank(a.name) < proj_rank(b.name);
    });
  return units;
}

std::vector<ShardSlot> slots_of(const std::vector<Unit>& units) {
  std::vector<ShardSlot> slots;
  for (const Unit& unit : units) {
    for (const Plan& p : unit) {
      if (p.storage == Storage::kNvfp4) {
        const Checkpoint::Nvfp4Tensors& t = *p.nvfp4;
        for (const TensorView* v : {t.weight, t.scale, t.global, t.input_scale})
          if (v) slots.push_back({v->name, std::string(dtype_name(v->dtype)), v->shape, v->nbytes});
      } else if (p.storage == Storage::kQuant)
        slots.push_back(quant_slots(p.name, p.spec, p.shape[0], p.shape[1])[0]);
      else
        slots.push_back(
            {p.name, p.storage == Storage::kF32 ? "F32" : "BF16", p.shape, p.data_bytes()});
    }
    for (const Plan& p : unit)
      if (p.storage == Storage::kQuant)
        slots.push_back(quant_slots(p.name, p.spec, p.shape[0], p.shape[1])[1]);
  }
  return slots;
}

uint16_t f32_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

class OutFile {
 public:
  explicit OutFile(const fs::path& path) : path_(path), file_(std::fopen(path.c_str(), "wb")) {
    if (!file_) fail("{}: cannot create", path.string());
  }
  ~OutFile() {
    if (file_) std::fclose(file_);
  }
  void write(const void* data, size_t bytes) {
    if (bytes && std::fwrite(data, 1, bytes, file_) != bytes)
      fail("{}: write failed", path_.string());
    written_ += bytes;
  }
  // Flushes to disk and closes.
  void finish() {
    if (std::fflush(file_) != 0 || ::fsync(::fileno(file_)) != 0)
      fail("{}: flush failed", path_.string());
    std::fclose(file_);
    file_ = nullptr;
  }
  uint64_t written() const { return written_; }

 private:
  fs::path path_;
  FILE* file_;
  uint64_t written_ = 0;
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open", path.string());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

json manifest_of(const ConvertOptions& o, const std::vector<fs::path>& shards) {
  json sources = json::array();
  for (const fs::path& s : shards) sources.push_back({s.filename().string(), fs::file_size(s)});
  json manifest = {{"container", "colibri int4/int8"},
                   {"expert_bits", o.expert_bits},
                   {"group_size", o.group_size},
                   {"dense_bits", o.dense_bits},
                   {"io_bits", o.io_bits},
                   {"source_shards", sources}};
  if (!o.nvfp4_as_stored) manifest["nvfp4"] = "requantize";
  return manifest;
}

}  // namespace

std::vector<ShardSlot> quant_slots(const std::string& name, QuantSpec spec, int64_t rows,
                                   int64_t cols) {
  const int64_t n_scales = kernels::scale_count(spec.format, rows, cols, spec.group_size);
  std::vector<int64_t> scale_shape = {rows};
  if (spec.format == QuantFormat::kInt4Grouped) scale_shape.push_back(n_scales / rows);
  const uint64_t n_bytes = uint64_t(kernels::packed_bytes(spec.format, rows, cols));
  return {{name, "U8", {rows, kernels::row_bytes(spec.format, cols)}, n_bytes},
          {name + kQuantScaleSuffix, "F32", scale_shape, 4 * uint64_t(n_scales)}};
}

std::string shard_header(const std::vector<ShardSlot>& slots, const std::string& producer) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"colibri.converter", producer}};
  uint64_t offset = 0;
  for (const ShardSlot& s : slots) {
    header[s.name] = {
        {"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, offset + s.bytes}}};
    offset += s.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

ShardWriter::ShardWriter(const fs::path& path, const std::vector<ShardSlot>& slots,
                         const std::string& producer)
    : path_(path), partial_(path.string() + ".partial") {
  fs::remove(partial_);
  file_ = std::fopen(partial_.c_str(), "wb");
  if (!file_) fail("{}: cannot create", partial_.string());
  const std::string header = shard_header(slots, producer);
  const uint64_t header_bytes = header.size();
  expected_ = 8 + header_bytes;
  for (const ShardSlot& s : slots) expected_ += s.bytes;
  write(&header_bytes, 8);
  write(header.data(), header.size());
}

ShardWriter::~ShardWriter() {
  if (file_) std::fclose(file_);
}

void ShardWriter::write(const void* data, size_t bytes) {
  if (bytes && std::fwrite(data, 1, bytes, file_) != bytes)
    fail("{}: write failed", partial_.string());
  written_ += bytes;
}

void ShardWriter::finish() {
  if (written_ != expected_)
    fail("{}: wrote {} bytes, the header describes {}", partial_.string(), written_, expected_);
  if (std::fflush(file_) != 0 || ::fsync(::fileno(file_)) != 0)
    fail("{}: flush failed", partial_.string());
  std::fclose(file_);
  file_ = nullptr;
  fs::rename(partial_, path_);
}

void write_text_atomically(const fs::path& path, const std::string& text) {
  const fs::path partial = path.string() + ".partial";
  {
    OutFile out(partial);
    out.write(text.data(), text.size());
    out.finish();
  }
  fs::rename(partial, path);
}

ConvertResult convert_checkpoint(const ConvertOptions& o) {
  if (o.expert_bits != 4 && o.expert_bits != 8)
    fail("--expert-bits {}: expected 4 or 8", o.expert_bits);
  if (o.group_size != 0 && !kernels::is_valid_group_size(o.group_size))
    fail("--group-size {}: expected 0 or one of 16, 32, 48, 64, 96, 128, 192, 256", o.group_size);
  if (o.dense_bits != 4 && o.dense_bits != 8 && o.dense_bits != 16 && o.dense_bits != 32)
    fail("--dense-bits {}: expected 4, 8, 16 or 32", o.dense_bits);
  if (o.io_bits != 8 && o.io_bits != 16 && o.io_bits != 32)
    fail("--io-bits {}: expected 8, 16 or 32", o.io_bits);
  std::error_code ec;
  const fs::file_status out_status = fs::status(o.output_dir, ec);
  if (fs::exists(out_status) && !fs::is_directory(out_status))
    fail("{}: the output is not a directory (it must be a new or an existing directory)",
         o.output_dir.string());
  if (fs::exists(o.output_dir) && fs::equivalent(o.input_dir, o.output_dir))
    fail("{}: output directory is the input directory", o.output_dir.string());

  const ModelConfig config = load_model_config(o.input_dir);
  const Checkpoint checkpoint(o.input_dir, config.fp8_block, config.int4_group_size);

  // Source tensors by shard, shards in path order, tensors in name order.
  std::map<fs::path, std::vector<const TensorView*>> by_shard;
  for (const std::string& name : checkpoint.names()) {
    const TensorView* view = checkpoint.find(name);
    by_shard[*view->file].push_back(view);
  }
  std::vector<fs::path> source_shards;
  for (const auto& [path, views] : by_shard) source_shards.push_back(path);

  // Plan every shard before touching the output, so that bad parameters leave nothing behind.
  struct ShardPlan {
    std::string out_name;
    std::vector<Unit> units;
    std::vector<ShardSlot> slots;
  };
  std::vector<ShardPlan> plans;
  json weight_map = json::object();
  uint64_t total_bytes = 0;
  for (const auto& [source, views] : by_shard) {
    ShardPlan plan;
    plan.units = plan_shard(checkpoint, o, views);
    if (plan.units.empty()) continue;
    plan.out_name = fmt::format("out-{:05d}.safetensors", plans.size() + 1);
    plan.slots = slots_of(plan.units);
    for (const ShardSlot& s : plan.slots) {
      weight_map[s.name] = plan.out_name;
      total_bytes += s.bytes;
    }
    plans.push_back(std::move(plan));
  }

  if (!fs::create_directories(o.output_dir, ec) && ec)
    fail("{}: cannot create the output directory: {}", o.output_dir.string(), ec.message());
  const json manifest = manifest_of(o, source_shards);
  const fs::path manifest_path = o.output_dir / kConvertManifest;
  if (fs::exists(manifest_path)) {
    json previous;
    try {
      previous = json::parse(read_text(manifest_path));
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", manifest_path.string(), e.what());
    }
    if (previous != manifest)
      fail(
          "{}: this directory was started with other parameters or another source ({} now {}); use "
          "a new "
          "output directory",
          manifest_path.string(), previous.dump(), manifest.dump());
  } else {
    for (const auto& entry : fs::directory_iterator(o.output_dir))
      if (entry.path().extension() == ".safetensors")
        fail("{}: has safetensors files but no {}; refusing to mix them with a new conversion",
             o.output_dir.string(), kConvertManifest);
    write_text_atomically(manifest_path, manifest.dump(2));
  }
  for (const char* file : kCopiedFiles)
    if (fs::exists(o.input_dir / file))
      fs::copy_file(o.input_dir / file, o.output_dir / file, fs::copy_options::overwrite_existing);

  ConvertResult result;
  int written_tensors = 0;
  auto last_report = std::chrono::steady_clock::now();
  auto report = [&](const std::string& line, bool always) {
    const auto now = std::chrono::steady_clock::now();
    if (!o.progress || (!always && now - last_report < std::chrono::seconds(2))) return;
    last_report = now;
    o.progress(line);
  };
  for (const ShardPlan& plan : plans) {
    const std::string& out_name = plan.out_name;
    const std::vector<Unit>& units = plan.units;
    const std::vector<ShardSlot>& slots = plan.slots;
    const fs::path out_path = o.output_dir / out_name;

    if (fs::exists(out_path)) {
      // Complete from an earlier run (only renamed once written): check it holds what we would
      // write.
      const SafetensorsFile done(out_path);
      bool same = done.tensors().size() == slots.size();
      for (const ShardSlot& s : slots)
        same = same && done.find(s.name) && done.find(s.name)->nbytes == s.bytes;
      if (!same)
        fail("{}: exists but does not hold the tensors this conversion writes", out_path.string());
      ++result.shards_skipped;
      report(fmt::format("{}: complete from an earlier run, kept", out_name), true);
      continue;
    }
    const fs::path partial = out_path.string() + ".partial";
    ShardWriter out(out_path, slots, "colibri-convert");
    size_t done_tensors = 0;
    const auto n_tensors = std::count_if(slots.begin(), slots.end(), [](const ShardSlot& s) {
      return !ends_with(s.name, kQuantScaleSuffix);
    });
    for (const Unit& unit : units) {
      std::vector<QuantMatrix> quantized;
      for (const Plan& p : unit) {
        if (o.stop_after_tensors >= 0 && written_tensors >= o.stop_after_tensors)
          fail("{}: stopped after {} tensors as asked", partial.string(), written_tensors);
        if (p.storage == Storage::kNvfp4) {
          // As stored, checked as the loader checks it (no NaN block scale, finite scales).
          const Nvfp4Matrix m = checkpoint.load_nvfp4(p.name, p.shape[0], p.shape[1]);
          out.write(m.codes.data(), m.codes.size());
          out.write(m.scales.data(), m.scales.size());
          out.write(&m.global, sizeof(float));
          if (const TensorView* input = p.nvfp4->input_scale) {
            float value = 0;
            checkpoint.shard_of(*input).read(*input, &value);
            out.write(&value, sizeof(float));
          }
          ++written_tensors;
          ++done_tensors;
          continue;
        }
        if (p.as_stored) {
          quantized.push_back(checkpoint.load_quant(p.name, p.shape[0], p.shape[1]));
          out.write(quantized.back().data.data(), quantized.back().data.size());
          ++written_tensors;
          ++done_tensors;
          continue;
        }
        const std::vector<float> w =
            checkpoint.load_f32(p.name, p.shape);  // [shape], one tensor at a time
        if (p.storage == Storage::kF32) {
          out.write(w.data(), w.size() * 4);
        } else if (p.storage == Storage::kBF16) {
          std::vector<uint16_t> bf(w.size());
          for (size_t i = 0; i < w.size(); ++i) bf[i] = f32_to_bf16(w[i]);
          out.write(bf.data(), bf.size() * 2);
        } else {
          quantized.push_back(quantize_matrix(p.name, p.spec, w.data(), p.shape[0], p.shape[1]));
          out.write(quantized.back().data.data(), quantized.back().data.size());
        }
        ++written_tensors;
        ++done_tensors;
      }
      for (const QuantMatrix& q : quantized) out.write(q.scales.data(), q.scales.size() * 4);
      report(fmt::format("{}: {}/{} tensors, {:.1f} MB", out_name, done_tensors, n_tensors,
                         double(out.written()) / 1e6),
             false);
    }
    result.bytes_written += out.written();
    out.finish();
    ++result.shards_written;
    report(fmt::format("{}: {} tensors, {:.1f} MB, complete", out_name, n_tensors,
                       double(out.written()) / 1e6),
           true);
  }
  write_text_atomically(
      o.output_dir / "model.safetensors.index.json",
      json{{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}}.dump(2));
  return result;
}

}  // namespace colibri
