# Tests that run inside the Soft-RoCE VM (test/rxe/rxe_vm.sh): a qemu VM with a real RDMA verbs
# device, rxe0, where this repository's source and build folders appear at their host paths.
#
# pdlib_add_vm_test(NAME <ctest name> COMMAND <command> [<arg>...] [TIMEOUT <s>]
#                   [DEPENDS <target>...] [ENVIRONMENT NAME=VALUE...] [RELEASE_ONLY])
#   Registers ctest <name>, which boots the VM, runs COMMAND there (generator expressions such as
#   $<TARGET_FILE:my_test> work; the working directory is this folder's build folder) and passes
#   on its exit status and output. TIMEOUT (default 90) bounds the whole run, boot included; the
#   command itself is stopped 15 s earlier. DEPENDS names the targets the command runs (each must
#   exist; the default build builds them). ENVIRONMENT is set for the command in the VM, besides
#   the host's ASAN_/UBSAN_/LSAN_/TSAN_OPTIONS, UCX_* and PDLIB_* variables.
#   Where the VM cannot run (no qemu, no kernel with rdma_rxe, PDLIB_RXE_VM=off, ...), ctest
#   reports the test as skipped and its output says why. The tests carry the label rxe_vm
#   (`ctest -L rxe_vm`) and one resource lock: two VMs on two cores would only slow each other.
#   In ThreadSanitizer builds UCX_MEM_EVENTS=n is set for the command, as for pdlib_add_test.
#   RELEASE_ONLY: under a sanitizer the test only says it skipped, and why (CI time: the emulated
#   VM runs sanitized code several times slower; what it checks of pdlib's own code runs under the
#   sanitizers elsewhere).
#
#   pdlib_add_vm_test(NAME verbs_rxe_write COMMAND $<TARGET_FILE:verbs_test> DEPENDS verbs_test)
# Cache entries, not plain variables: pdlib_add_vm_test is also called from folders outside the
# one that includes this file (bench/transfer).
set(PDLIB_RXE_VM_SCRIPT "${PROJECT_SOURCE_DIR}/test/rxe/rxe_vm.sh" CACHE INTERNAL "")
set(PDLIB_RXE_VM_SKIP_CODE 77 CACHE INTERNAL "")  # rxe_vm.sh's exit status for "cannot run here"

function(pdlib_add_vm_test)
  cmake_parse_arguments(ARG "RELEASE_ONLY" "NAME;TIMEOUT" "COMMAND;DEPENDS;ENVIRONMENT" ${ARGN})
  if(ARG_RELEASE_ONLY AND PDLIB_SANITIZE)
    add_test(NAME ${ARG_NAME} COMMAND sh -c
      "echo 'SKIP: ${ARG_NAME} runs in the release build only (the emulated VM under ${PDLIB_SANITIZE} would cost CI minutes)'; exit 77")
    set_tests_properties(${ARG_NAME} PROPERTIES SKIP_RETURN_CODE 77 LABELS rxe_vm)
    return()
  endif()
  if(NOT ARG_NAME OR NOT ARG_COMMAND)
    message(FATAL_ERROR "pdlib_add_vm_test: NAME and COMMAND are required")
  endif()
  if(ARG_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "pdlib_add_vm_test(${ARG_NAME}): unknown arguments ${ARG_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 90)
  endif()
  set(env_args "")
  foreach(var IN LISTS ARG_ENVIRONMENT)
    list(APPEND env_args --env "${var}")
  endforeach()
  if(PDLIB_SANITIZE MATCHES "thread")
    list(APPEND env_args --env UCX_MEM_EVENTS=n)
  endif()
  foreach(target IN LISTS ARG_DEPENDS)
    if(NOT TARGET ${target})
      message(FATAL_ERROR "pdlib_add_vm_test(${ARG_NAME}): DEPENDS ${target} is not a target")
    endif()
  endforeach()
  if(ARG_DEPENDS)
    if(NOT TARGET pdlib_vm_test_deps)
      add_custom_target(pdlib_vm_test_deps ALL)
    endif()
    add_dependencies(pdlib_vm_test_deps ${ARG_DEPENDS})
  endif()
  add_test(NAME ${ARG_NAME}
    COMMAND ${PDLIB_RXE_VM_SCRIPT} --timeout ${ARG_TIMEOUT} --cache-dir ${PROJECT_BINARY_DIR}/rxe-vm
      --share ${PROJECT_SOURCE_DIR} --share ${PROJECT_BINARY_DIR} ${env_args} -- ${ARG_COMMAND})
  math(EXPR ctest_timeout "${ARG_TIMEOUT} + 30")  # the script reports its own timeout first
  # COST: ctest starts costlier tests first. Without it a fresh build folder (CI's) runs the VM
  # tests, which hold one lock, one after another at the end with the other core idle; started
  # first, their chain overlaps the rest of the suite.
  set_tests_properties(${ARG_NAME} PROPERTIES
    SKIP_RETURN_CODE ${PDLIB_RXE_VM_SKIP_CODE}
    TIMEOUT ${ctest_timeout}
    COST ${ARG_TIMEOUT}
    LABELS rxe_vm
    RESOURCE_LOCK pdlib_rxe_vm)
endfunction()
