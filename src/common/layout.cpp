#include "common/layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "common/error.h"
#include "common/input_file.h"

namespace colibri {

const char* role_name(Role role) {
  switch (role) {
    case Role::kCoordinator:
      return "coordinator";
    case Role::kGpuExpert:
      return "gpu-expert";
    case Role::kCpuExpert:
      return "cpu-expert";
  }
  return "unknown";
}

int Layout::coordinator() const {
  for (const RankSpec& spec : ranks)
    if (spec.role == Role::kCoordinator) return spec.rank;
  return -1;
}

std::vector<int> Layout::expert_ranks() const {
  std::vector<int> experts;
  for (const RankSpec& spec : ranks)
    if (spec.role != Role::kCoordinator) experts.push_back(spec.rank);
  std::sort(experts.begin(), experts.end());
  return experts;
}

bool Layout::coordinator_owns_experts() const {
  const int c = coordinator();
  return c >= 0 && (ranks.size() == 1 || ranks[size_t(c)].ram_gb > 0);
}

std::vector<int> Layout::owner_ranks() const {
  std::vector<int> owners = expert_ranks();
  if (coordinator_owns_experts()) owners.push_back(coordinator());
  std::sort(owners.begin(), owners.end());
  return owners;
}

namespace {

constexpr int kMaxColumns = 7;  // rank role gpu numa ram_gb vram_gb host

// One line of a layout file, for error messages: "source:line".
struct Where {
  const std::string& source;
  int line;
};

std::string at(const Where& where) {
  return fmt::format("{}:{}", where.source, where.line);
}

std::optional<int> to_int(std::string_view text) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

std::optional<double> to_double(std::string_view text) {
  double value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || !std::isfinite(value)) return std::nullopt;
  return value;
}

// A device index or NUMA node: '-' (unset, -1) or an integer >= 0.
int parse_index(std::string_view text, const char* field, const Where& where) {
  if (text == "-") return -1;
  const std::optional<int> value = to_int(text);
  if (!value) fail("{}: {} '{}' is not an integer or '-'", at(where), field, text);
  if (*value < 0) fail("{}: {} {} is negative", at(where), field, *value);
  return *value;
}

// A memory budget in GB: '-' (unset, 0) or a finite number >= 0.
double parse_budget(std::string_view text, const char* field, const Where& where) {
  if (text == "-") return 0;
  const std::optional<double> value = to_double(text);
  if (!value) fail("{}: {} '{}' is not a number or '-'", at(where), field, text);
  if (*value < 0) fail("{}: {} {} is negative", at(where), field, text);
  if (*value > kMaxBudgetGib)
    fail("{}: {} {} is larger than the {} GiB limit", at(where), field, text, kMaxBudgetGib);
  return *value;
}

Role parse_role(std::string_view text, const Where& where) {
  for (Role role : {Role::kCoordinator, Role::kGpuExpert, Role::kCpuExpert})
    if (text == role_name(role)) return role;
  fail("{}: role '{}' is unknown (expected coordinator, gpu-expert or cpu-expert)", at(where),
       text);
}

std::vector<std::string_view> split_columns(std::string_view line) {
  std::vector<std::string_view> columns;
  size_t pos = 0;
  while (true) {
    pos = line.find_first_not_of(" \t\r", pos);
    if (pos == std::string_view::npos) break;
    const size_t end = std::min(line.find_first_of(" \t\r", pos), line.size());
    columns.push_back(line.substr(pos, end - pos));
    pos = end;
  }
  return columns;
}

// "1, 2, 5" for at most `limit` values, then ", ...".
std::string list_ranks(const std::vector<int>& values, size_t limit = 8) {
  std::string out;
  for (size_t i = 0; i < values.size() && i < limit; ++i)
    out += fmt::format("{}{}", i ? ", " : "", values[i]);
  if (values.size() > limit) out += ", ...";
  return out;
}

}  // namespace

Layout parse_layout(const std::string& text, const std::string& source, int world_size) {
  if (world_size < 1) fail("{}: world size {} is not positive", source, world_size);
  Layout layout;
  layout.source = source;
  layout.ranks.resize(size_t(world_size));
  std::vector<int> line_of_rank(size_t(world_size), 0);  // 0 = not seen yet

  std::istringstream lines(text);
  std::string line;
  int line_number = 0;
  int coordinator_line = 0;
  int expert_count = 0;
  while (std::getline(lines, line)) {
    ++line_number;
    const Where where{source, line_number};
    std::string_view content(line);
    content = content.substr(0, content.find('#'));
    const std::vector<std::string_view> columns = split_columns(content);
    if (columns.empty()) continue;
    if (columns.size() > size_t(kMaxColumns))
      fail("{}: {} columns, expected at most {} (rank role gpu numa ram_gb vram_gb host)",
           at(where), columns.size(), kMaxColumns);
    if (columns.size() < 2) fail("{}: role is missing (expected at least 'rank role')", at(where));

    const std::optional<int> rank = to_int(columns[0]);
    if (!rank) fail("{}: rank '{}' is not an integer", at(where), columns[0]);
    if (*rank < 0 || *rank >= world_size)
      fail("{}: rank {} is out of range [0, {}) (the MPI world has {} ranks)", at(where), *rank,
           world_size, world_size);
    if (const int first = line_of_rank[size_t(*rank)])
      fail("{}: rank {} is a duplicate (first defined at line {})", at(where), *rank, first);
    line_of_rank[size_t(*rank)] = line_number;

    RankSpec spec;
    spec.rank = *rank;
    spec.role = parse_role(columns[1], where);
    if (columns.size() > 2) spec.gpu = parse_index(columns[2], "gpu", where);
    if (columns.size() > 3) spec.numa = parse_index(columns[3], "numa", where);
    if (columns.size() > 4) spec.ram_gb = parse_budget(columns[4], "ram_gb", where);
    if (columns.size() > 5) spec.vram_gb = parse_budget(columns[5], "vram_gb", where);
    if (columns.size() > 6 && columns[6] != "-") spec.host = std::string(columns[6]);

    switch (spec.role) {
      case Role::kCoordinator:
        if (coordinator_line)
          fail("{}: rank {} is a second coordinator (rank {} at line {} already is)", at(where),
               spec.rank, layout.coordinator(), coordinator_line);
        coordinator_line = line_number;
        if (spec.vram_gb > 0)
          fail("{}: vram_gb is set on the coordinator; its routed experts (ram_gb) run on its CPU",
               at(where));
        break;
      case Role::kGpuExpert:
        if (spec.gpu < 0) fail("{}: gpu is missing on gpu-expert rank {}", at(where), spec.rank);
        break;
      case Role::kCpuExpert:
        if (spec.gpu >= 0)
          fail("{}: gpu {} is set on cpu-expert rank {} (use gpu-expert, or '-')", at(where),
               spec.gpu, spec.rank);
        if (spec.vram_gb > 0)
          fail("{}: vram_gb is set on cpu-expert rank {}, which has no GPU", at(where), spec.rank);
        break;
    }
    if (spec.role != Role::kCoordinator) ++expert_count;
    layout.ranks[size_t(spec.rank)] = spec;
  }

  if (!coordinator_line) fail("{}: no coordinator (exactly one rank needs that role)", source);
  if (world_size > 1 && expert_count == 0)
    fail("{}: no expert rank; {} ranks need a coordinator and at least one expert rank", source,
         world_size);
  std::vector<int> missing;
  for (int r = 0; r < world_size; ++r)
    if (!line_of_rank[size_t(r)]) missing.push_back(r);
  if (!missing.empty())
    fail("{}: rank{} {} missing (every rank 0..{} needs a line)", source,
         missing.size() > 1 ? "s" : "", list_ranks(missing), world_size - 1);
  return layout;
}

void check_one_rank_per_gpu(const Layout& layout) {
  for (const RankSpec& a : layout.ranks)
    for (const RankSpec& b : layout.ranks)
      if (a.rank < b.rank && a.gpu >= 0 && a.gpu == b.gpu && a.host == b.host)
        fail("{}: ranks {} and {} both use GPU {} on host {} (one rank per GPU)", layout.source,
             a.rank, b.rank, a.gpu, a.host.empty() ? "(unnamed)" : a.host);
}

Layout load_layout(const std::filesystem::path& path, int world_size) {
  return parse_layout(read_regular_file(path, "the layout file"), path.string(), world_size);
}

Layout default_layout(int world_size, const std::vector<int>& local_rank,
                      const std::vector<int>& gpus_on_host, const std::vector<int>& host_index) {
  if (world_size < 1 || local_rank.size() != size_t(world_size) ||
      gpus_on_host.size() != size_t(world_size) || host_index.size() != size_t(world_size))
    throw std::invalid_argument(fmt::format(
        "default_layout: world size {} with {} local ranks, {} GPU counts, {} host indices",
        world_size, local_rank.size(), gpus_on_host.size(), host_index.size()));
  Layout layout;
  layout.source = "default";
  layout.ranks.resize(size_t(world_size));
  layout.ranks[0].rank = 0;
  layout.ranks[0].role = Role::kCoordinator;
  for (int r = 1; r < world_size; ++r) {
    RankSpec& spec = layout.ranks[size_t(r)];
    spec.rank = r;
    const int gpus = gpus_on_host[size_t(r)];
    if (gpus <= 0) {
      spec.role = Role::kCpuExpert;
      continue;
    }
    spec.role = Role::kGpuExpert;
    int slot = local_rank[size_t(r)];
    // On the coordinator's host the coordinator holds no GPU, so the expert ranks there count
    // from the one after it: local rank 1 takes GPU 0 when the coordinator is local rank 0.
    if (host_index[size_t(r)] == host_index[0] && slot > local_rank[0]) --slot;
    spec.gpu = slot % gpus;
  }
  return layout;
}

}  // namespace colibri
