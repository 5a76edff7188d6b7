# pdlib_add_proto_library(TARGET name IMPORT_ROOT dir PROTOS file.proto... [GRPC])
#
# A static library of the C++ messages (and, with GRPC, the gRPC stubs) generated from PROTOS.
# Generated under ${CMAKE_CURRENT_BINARY_DIR}/gen with IMPORT_ROOT (the repository root) as the
# import root, so that code includes "<path from the root>/x.pb.h" and the descriptor pool sees
# unique names. Generated code is compiled without pdlib's warning flags: it is not ours to fix,
# and CI's -Werror must not trip on it. The one protoc rule of the tree: lib/proto, the examples
# and the fuzzers (a CMake project of its own, which includes this file) all use it.
function(pdlib_add_proto_library)
  cmake_parse_arguments(ARG "GRPC" "TARGET;IMPORT_ROOT" "PROTOS" ${ARGN})
  if(NOT ARG_TARGET OR NOT ARG_IMPORT_ROOT OR NOT ARG_PROTOS)
    message(FATAL_ERROR "pdlib_add_proto_library: TARGET, IMPORT_ROOT and PROTOS are required")
  endif()
  set(gen_dir "${CMAKE_CURRENT_BINARY_DIR}/gen")
  set(sources "")
  foreach(proto IN LISTS ARG_PROTOS)
    get_filename_component(abs "${proto}" ABSOLUTE)
    file(RELATIVE_PATH rel "${ARG_IMPORT_ROOT}" "${abs}")
    string(REGEX REPLACE "\\.proto$" "" out "${gen_dir}/${rel}")
    set(outputs "${out}.pb.cc" "${out}.pb.h")
    set(grpc_args "")
    if(ARG_GRPC)
      list(APPEND outputs "${out}.grpc.pb.cc" "${out}.grpc.pb.h")
      set(grpc_args --grpc_out=${gen_dir} --plugin=protoc-gen-grpc=${GRPC_CPP_PLUGIN})
    endif()
    add_custom_command(
      OUTPUT ${outputs}
      COMMAND ${CMAKE_COMMAND} -E make_directory "${gen_dir}"
      COMMAND protobuf::protoc --proto_path=${ARG_IMPORT_ROOT} --cpp_out=${gen_dir} ${grpc_args}
              "${abs}"
      DEPENDS "${abs}" protobuf::protoc
      COMMENT "protoc: ${rel}"
      VERBATIM)
    list(APPEND sources ${outputs})
  endforeach()
  add_library(${ARG_TARGET} STATIC ${sources})
  target_include_directories(${ARG_TARGET} PUBLIC $<BUILD_INTERFACE:${gen_dir}>)
  target_link_libraries(${ARG_TARGET} PUBLIC protobuf::libprotobuf)
  if(ARG_GRPC)
    target_link_libraries(${ARG_TARGET} PUBLIC gRPC::grpc++)
  endif()
endfunction()
