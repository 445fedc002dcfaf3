# cmake -DINPUT=FILE -DOUTPUT=HEADER -P embed_text.cmake
# Writes HEADER declaring `kDashboardPage`, FILE's text as a raw string literal (the dashboard
# page of --serve, src/coordinator/dashboard.html). A file holding the literal's closing
# delimiter is refused.
file(READ "${INPUT}" text)
set(delimiter "colibri_embed")
string(FIND "${text}" ")${delimiter}\"" found)
if(NOT found EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw string delimiter )${delimiter}\"")
endif()
set(content "// Generated from ${INPUT} by cmake/embed_text.cmake; do not edit.\n#pragma once\n\nnamespace colibri {\ninline constexpr const char kDashboardPage[] = R\"${delimiter}(${text})${delimiter}\";\n}  // namespace colibri\n")
# Rewritten only when it changes, so that an unchanged page compiles nothing again.
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" old)
  if(old STREQUAL content)
    return()
  endif()
endif()
file(WRITE "${OUTPUT}" "${content}")
