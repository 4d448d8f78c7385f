# Writes OUT, a C++ file whose python_script_runner() returns IN (rollout/sandbox_runner.py) from its first
# blank line on, byte for byte; the header comment above that line stays out. Run by rollout/CMakeLists.txt
# at build time: cmake -DIN=<.py> -DOUT=<.cpp> -P sandbox_runner.cmake. It checks nothing of the Python.
file(READ "${IN}" text)
string(FIND "${text}" "\n\n" header_end)
if(header_end LESS 0)
  message(FATAL_ERROR "${IN}: no blank line ends the header comment")
endif()
string(SUBSTRING "${text}" 0 ${header_end} header)
if(NOT header MATCHES "^#[^\n]*(\n#[^\n]*)*$")
  message(FATAL_ERROR "${IN}: every line above the first blank line must be a comment")
endif()
math(EXPR body_start "${header_end} + 2")
string(SUBSTRING "${text}" ${body_start} -1 body)
# The raw string's delimiter must not occur in the program.
set(delimiter "RLT_RUNNER")
string(FIND "${body}" ")${delimiter}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN}: the program contains the raw string's end, ')${delimiter}\"'")
endif()
file(WRITE "${OUT}.tmp"
     "// Generated from rollout/sandbox_runner.py by rollout/sandbox_runner.cmake: edit the .py instead.\n"
     "#include \"rollout/sandbox.h\"\n\n"
     "namespace rlt {\n\n"
     "const char* python_script_runner() {\n"
     "  return R\"${delimiter}(${body})${delimiter}\";\n"
     "}\n\n"
     "}  // namespace rlt\n")
# Only a changed program touches OUT, so rebuilding the same .py recompiles nothing.
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
