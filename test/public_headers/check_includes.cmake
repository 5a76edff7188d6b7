# Fails when a header under HEADER_DIR includes anything but a C++ standard header (or, for the
# C API, stddef.h and stdint.h) or another
# pdlib header. Run: cmake -DHEADER_DIR=include/pdlib -P check_includes.cmake
set(std_headers
  algorithm any array atomic bit bitset cassert cctype cerrno cfloat chrono cinttypes climits
  cmath compare complex concepts condition_variable cstddef cstdint cstdio cstdlib cstring ctime
  deque exception functional initializer_list iosfwd iterator limits list map memory mutex new
  numeric optional ostream queue random ratio set shared_mutex span sstream stdexcept string
  string_view system_error thread tuple type_traits typeinfo unordered_map unordered_set utility
  variant vector version
  stddef.h stdint.h)  # the C API header (pdlib/c/pdlib.h) is C99: the C headers it needs
file(GLOB_RECURSE headers ${HEADER_DIR}/*.h)
list(LENGTH headers count)
if(count EQUAL 0)
  message(FATAL_ERROR "no headers found under ${HEADER_DIR}")
endif()
set(bad "")
foreach(h IN LISTS headers)
  file(STRINGS ${h} lines REGEX "^[ \t]*#[ \t]*include")
  foreach(line IN LISTS lines)
    if(line MATCHES "#[ \t]*include[ \t]*\"pdlib/[^\"]+\"")
      continue()
    elseif(line MATCHES "#[ \t]*include[ \t]*<([^>]+)>")
      list(FIND std_headers "${CMAKE_MATCH_1}" idx)
      if(NOT idx EQUAL -1)
        continue()
      endif()
    endif()
    list(APPEND bad "${h}: ${line}")
  endforeach()
endforeach()
if(bad)
  string(REPLACE ";" "\n  " bad "${bad}")
  message(FATAL_ERROR "public headers include non-standard, non-pdlib headers:\n  ${bad}")
endif()
message(STATUS "checked ${count} public headers: only the C++ standard library and pdlib/")
