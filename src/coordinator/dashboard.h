// The dashboard of --serve (docs/DASHBOARD.md): GET /dashboard, one HTML page with its script and
// style inline (src/coordinator/dashboard.html, built into the binary), which polls GET
// /dashboard/state, ServeMetrics' JSON of the numbers /metrics shows and the engine's view of the
// cluster, and has a chat box that talks to /v1/chat/completions.
//
// Authentication is the API's: with --api-key, /dashboard/state needs "Authorization: Bearer
// KEY" like every route. /dashboard holds no numbers; without the key it answers 401 with the
// same page, which asks for the key (or reads it from the URL's fragment, #key=KEY, which a
// browser never sends) and keeps it in the page's memory only, for its requests' headers.
#pragma once

#include <httplib.h>

#include "coordinator/serve_metrics.h"

namespace colibri {

// The page's response (status as given: 200, or 401 to a request without the key).
void reply_dashboard_page(httplib::Response& res, int status);

// Registers GET /dashboard and GET /dashboard/state (authentication is the pre-routing
// handler's, coordinator/http_server.cpp).
void add_dashboard_routes(httplib::Server& server, const ServeMetrics& metrics);

}  // namespace colibri
