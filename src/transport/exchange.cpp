#include "transport/exchange.h"

namespace colibri {
namespace {

std::unique_ptr<MpiTransport> make_mpi(const ExchangeContext& c) {
  return std::make_unique<MpiTransport>(c.comm, *c.placement, c.shape, c.coordinator, *c.profiler,
                                        c.options);
}

}  // namespace

std::unique_ptr<Dispatcher> make_dispatcher(const ExchangeContext& context) {
  return make_mpi(context);
}

std::unique_ptr<ExpertChannel> make_expert_channel(const ExchangeContext& context) {
  return make_mpi(context);
}

}  // namespace colibri
