// What exchange tests share: this rank's identity on one host, and a fake expert rank that
// answers every request with partials computed by a given rule, in closed form.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <vector>

#include "common/buffer.h"
#include "transport/mpi_check.h"
#include "transport/transport.h"

namespace colibri::test {

// rank_identity() for this rank of `comm`, every rank on this host.
inline void set_one_host_identity(MPI_Comm comm) {
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  char host[256] = "?";
  gethostname(host, sizeof(host) - 1);
  RankIdentity& me = rank_identity();
  me.rank = rank;
  me.size = size;
  me.host = host;
  me.hosts.assign(size_t(size), host);
}

// Answers every request until shutdown: partial[row][j] is the sum over the request's pairs of
// contribution(x[row][j], pair) in pair order. A `silent` rank computes its first partial and
// never replies.
template <class Contribution>
void serve_requests(ExpertChannel& channel, int hidden, Contribution contribution,
                    bool silent = false) {
  ExpertRequest request;
  std::vector<float> rows, partial;
  while (channel.receive(request)) {
    const size_t values = size_t(request.n_rows) * size_t(hidden);
    rows.resize(values);
    to_f32(request.rows, rows.data());
    partial.assign(values, 0.0f);
    for (const RoutedPair& p : request.pairs)
      for (int j = 0; j < hidden; ++j)
        partial[size_t(p.row) * hidden + j] += contribution(rows[size_t(p.row) * hidden + j], p);
    if (silent) {
      std::this_thread::sleep_for(std::chrono::seconds(600));
      return;
    }
    channel.reply(host_f32(partial.data(), values));
  }
}

}  // namespace colibri::test
