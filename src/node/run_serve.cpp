// --serve: the OpenAI-compatible HTTP server on the coordinator (coordinator/http_server.h), built
// when cpp-httplib was found.
#include <cstdio>
#include <optional>

#include "coordinator/http_server.h"
#include "node/run_modes.h"

namespace colibri {

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
  options.scheduler.max_queue = args.max_queue;
  options.scheduler.prefix_cache = !args.no_prefix_cache;
  if (!args.kv_cache_dir.empty())
    options.scheduler.kv_cache_dir = KvCacheDirOptions(
        args.kv_cache_dir, uint64_t(args.kv_cache_dir_gb * 1e9), node.model_identity());
  options.thinking = parse_thinking(args.think);
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
