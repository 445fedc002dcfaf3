#include "coordinator/dashboard.h"

#include "coordinator/dashboard_page.h"  // generated from dashboard.html (src/CMakeLists.txt)

namespace colibri {

void reply_dashboard_page(httplib::Response& res, int status) {
  res.status = status;
  // Its script and style are inline; it talks to this server only and is framed by no one.
  res.set_header("Content-Security-Policy",
                 "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                 "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                 "frame-ancestors 'none'");
  res.set_header("X-Frame-Options", "DENY");
  res.set_header("Referrer-Policy", "no-referrer");
  res.set_header("Cache-Control", "no-store");
  if (status == 401) res.set_header("WWW-Authenticate", "Bearer");
  res.set_content(kDashboardPage, "text/html; charset=utf-8");
}

void add_dashboard_routes(httplib::Server& server, const ServeMetrics& metrics) {
  server.Get("/dashboard", [](const httplib::Request&, httplib::Response& res) {
    reply_dashboard_page(res, 200);
  });
  server.Get("/dashboard/state", [&metrics](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(metrics.dashboard_state(), "application/json");
  });
}

}  // namespace colibri
