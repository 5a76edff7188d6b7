# Helpers shared by every folder.

# pdlib_target_defaults(target): warnings and the project's include roots.
function(pdlib_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${PDLIB_WARNING_FLAGS}>)
endfunction()

# pdlib_add_backend(NAME name SOURCES ... [LIBS ...]): a transport backend as its own static
# library `pdlib_backend_<name>` exposing `void pdlib::Register<Name>Backend()`. The name is
# appended to the list from which lib/ generates the explicit registration calls.
function(pdlib_add_backend)
  cmake_parse_arguments(ARG "" "NAME;REGISTER_FN" "SOURCES;LIBS" ${ARGN})
  set(target pdlib_backend_${ARG_NAME})
  add_library(${target} STATIC ${ARG_SOURCES})
  add_library(pdlib::backend_${ARG_NAME} ALIAS ${target})
  target_link_libraries(${target} PUBLIC pdlib_base PRIVATE ${ARG_LIBS})
  set_target_properties(${target} PROPERTIES EXPORT_NAME backend_${ARG_NAME})
  pdlib_target_defaults(${target})
  set_property(GLOBAL APPEND PROPERTY PDLIB_BACKENDS ${ARG_NAME})
  set_property(GLOBAL APPEND PROPERTY PDLIB_BACKEND_REGISTER_FNS ${ARG_REGISTER_FN})
  set_property(GLOBAL APPEND PROPERTY PDLIB_BACKEND_TARGETS ${target})
endfunction()

# pdlib_add_test(NAME name SOURCES ... [LIBS ...] [LABELS ...]): a Catch2 test binary whose
# test cases are registered with CTest one by one. The ctest names start with the binary name,
# so `ctest -R <name>` selects a whole file.
function(pdlib_add_test)
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE pdlib_test_main ${ARG_LIBS})
  pdlib_target_defaults(${ARG_NAME})
  # ThreadSanitizer builds: UCX's memory hooks (libucm, installed when libucs loads unless
  # UCX_MEM_EVENTS=n) crash threads that exit under TSan; see backends/ucx/ucx_transport.cc.
  set(test_env "")
  if(PDLIB_SANITIZE MATCHES "thread")
    set(test_env ENVIRONMENT "UCX_MEM_EVENTS=n")
  endif()
  catch_discover_tests(${ARG_NAME}
    TEST_PREFIX "${ARG_NAME}: "
    PROPERTIES TIMEOUT ${ARG_TIMEOUT} ${test_env} LABELS "${ARG_LABELS}")
endfunction()

function(pdlib_print_summary)
  get_property(backends GLOBAL PROPERTY PDLIB_BACKENDS)
  string(REPLACE ";" " " backends "${backends}")
  message(STATUS "pdlib ${PROJECT_VERSION}: backends built: ${backends}")
  message(STATUS "pdlib:   UCX ${PDLIB_WITH_UCX} -> ${PDLIB_HAVE_UCX}; verbs ${PDLIB_WITH_VERBS} -> ${PDLIB_HAVE_VERBS}; CUDA kernels ${PDLIB_WITH_CUDA} -> ${PDLIB_HAVE_CUDA}")
  message(STATUS "pdlib:   Python package ${PDLIB_WITH_PYTHON} -> ${PDLIB_HAVE_PYTHON} (${Python3_EXECUTABLE})")
  foreach(skipped IN LISTS PDLIB_BACKENDS_NOT_IN_TREE)
    message(STATUS "pdlib:   ${skipped}: dependency found but backends/${skipped} is not in this tree yet")
  endforeach()
  if(PDLIB_SANITIZE)
    message(STATUS "pdlib:   sanitizers: ${PDLIB_SANITIZE}")
  endif()
endfunction()
