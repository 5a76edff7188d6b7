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
#
# Cases tagged [long] run in the release build only: under a sanitizer they are not registered
# (CI runs every test three times on two cores and must stay under an hour; the same code paths
# run under the sanitizers through shorter cases), and one skipped test "<name>: [long] cases"
# names them. Tag a case [long] when it takes over ~20 s under TSan and a shorter case covers
# its code (docs/DEVELOPERS.md, "CI time").
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
  set(test_spec "")
  if(PDLIB_SANITIZE)
    # "~[.]" too: a spec made of exclusions alone would also list the hidden cases.
    set(test_spec TEST_SPEC "~[long]~[.]")
    set(has_long FALSE)
    foreach(source IN LISTS ARG_SOURCES)
      get_filename_component(path "${source}" ABSOLUTE)
      if(EXISTS "${path}")
        file(READ "${path}" text)
        string(FIND "${text}" "[long]" at)
        if(at GREATER -1)
          set(has_long TRUE)
        endif()
      endif()
    endforeach()
    if(has_long)
      add_test(NAME "${ARG_NAME}: [long] cases" COMMAND sh -c
        "echo 'SKIP: these cases run in the release build only (CI time under ${PDLIB_SANITIZE}):'; \"$1\" --list-test-names-only '[long]'; exit 77"
        sh $<TARGET_FILE:${ARG_NAME}>)
      set_tests_properties("${ARG_NAME}: [long] cases" PROPERTIES SKIP_RETURN_CODE 77
        LABELS "${ARG_LABELS}")
    endif()
  endif()
  # --warn NoTests: a case CTest cannot name exactly (a ';' in its name splits it in two) fails
  # instead of passing without running.
  catch_discover_tests(${ARG_NAME}
    ${test_spec}
    EXTRA_ARGS --warn NoTests
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
