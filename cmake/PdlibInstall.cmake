# cmake --install: headers, the static libraries (core, base, every enabled backend) and a
# package config, so an engine's CMake does find_package(pdlib CONFIG REQUIRED) and links
# pdlib::pdlib.
include(CMakePackageConfigHelpers)

get_property(backend_targets GLOBAL PROPERTY PDLIB_BACKEND_TARGETS)
install(TARGETS pdlib pdlib_c pdlib_base pdlib_control pdlib_proto pdlib_etcd_proto pdlib_planner pdlib_rails
        ${backend_targets}
        EXPORT pdlibTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/pdlib DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT pdlibTargets NAMESPACE pdlib::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pdlib)

get_property(PDLIB_INSTALLED_BACKENDS GLOBAL PROPERTY PDLIB_BACKENDS)
configure_package_config_file(cmake/pdlibConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/pdlibConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pdlib)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/pdlibConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/pdlibConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/pdlibConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/pdlib)
