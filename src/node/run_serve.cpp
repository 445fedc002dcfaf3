// --serve: the OpenAI-compatible HTTP server on the coordinator (coordinator/http_server.h), built
// when cpp-httplib was found.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "coordinator/http_server.h"
#include "node/run_modes.h"

namespace colibri {
namespace {

// Each rank of the layout for the dashboard: where it keeps its routed experts (a gpu-expert
// rank's VRAM, over its RAM and disk when they do not all fit; a RAM budget over the disk; or all
// resident in RAM).
std::vector<RankInfo> rank_infos(const Node& node) {
  const Layout& layout = node.layout();
  const std::vector<int> owners = layout.owner_ranks();
  std::vector<RankInfo> ranks;
  for (const RankSpec& spec : layout.ranks) {
    RankInfo info;
    info.rank = spec.rank;
    info.host = spec.host;
    info.role = role_name(spec.role);
    const bool owner = std::find(owners.begin(), owners.end(), spec.rank) != owners.end();
    const double ram_gb = spec.ram_gb > 0 ? spec.ram_gb : node.options().ram_gb;
    if (!owner)
      info.tier = "none";
    else if (spec.role == Role::kGpuExpert)
      info.tier = "vram";
    else
      info.tier = ram_gb > 0 ? "ram+disk" : "ram";
    ranks.push_back(std::move(info));
  }
  return ranks;
}

}  // namespace

int run_serve(Node& node, const CommandLine& args) {
  const Tokenizer tokenizer = load_tokenizer(args.node.model_dir);
  ServeOptions options;
  options.host = args.host;
  options.port = args.port;
  options.api_key = args.api_key;
  options.max_body_bytes = size_t(args.max_body_mb * 1024 * 1024);
  options.connections.max_connections = args.max_connections;
  options.connections.max_per_client = args.max_client_connections;
  options.connections.request_timeout_s = args.request_timeout;
  options.model_name = std::filesystem::weakly_canonical(args.node.model_dir).filename().string();
  options.multi_rank = node.size() > 1;
  options.scheduler.max_batch_tokens = args.max_batch_tokens;
  options.scheduler.max_itl_s = args.max_itl_ms * 1e-3;
  options.scheduler.max_queue = args.max_queue;
  options.scheduler.prefix_cache = !args.no_prefix_cache;
  if (!args.kv_cache_dir.empty())
    options.scheduler.kv_cache_dir = KvCacheDirOptions(
        args.kv_cache_dir, uint64_t(args.kv_cache_dir_gb * 1e9), node.model_identity());
  options.thinking = parse_thinking(args.think);
  options.ranks = rank_infos(node);
  options.scheduler.live_counters = [&node] { return node.live_counters(); };
  const int code = serve(node.engine(), tokenizer, options);
  node.shutdown();
  const std::vector<RankReport> reports = node.gather_reports();
  if (!args.quiet) print_profile(stderr, reports, std::nullopt);  // the requests are in /metrics
  print_repin(node, args.quiet);
  if (!args.profile_json.empty()) write_profile_json(args.profile_json, reports, {});
  if (!args.trace.empty()) write_trace(args.trace, reports);
  return code;
}

}  // namespace colibri
