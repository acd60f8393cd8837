# Install rules (docs/install.md): the layer and engine libraries, the public
# headers (docs/stability.md), the meshtrain command, a CMake package with
# exported targets (find_package(meshtrain), engines as components) and a
# pkg-config file. Included by CMakeLists.txt after every layer is defined.
#
#   cmake --install build/release --prefix /tmp/meshtrain     # or: make deb (cmake/Package.cmake)
#
#   <prefix>/bin/meshtrain
#   <prefix>/include/meshtrain/<layer>/*.h, meshtrain/version.h
#   <prefix>/lib/libmeshtrain_<layer>.a
#   <prefix>/lib/cmake/meshtrain/meshtrain{Config,ConfigVersion,Targets}.cmake
#   <prefix>/lib/pkgconfig/meshtrain.pc
#   <prefix>/share/doc/meshtrain/ (README, install and stability pages, examples/consumer)
include(CMakePackageConfigHelpers)

# The engines this build has: the package's components.
set(MESHTRAIN_INSTALLED_ENGINES threads)
if(MESHTRAIN_HAVE_MPI)
  list(APPEND MESHTRAIN_INSTALLED_ENGINES mpi)
endif()
if(MESHTRAIN_HAVE_GLOO)
  list(APPEND MESHTRAIN_INSTALLED_ENGINES gloo)
endif()

# Every installed library, in link order: each before the libraries it uses
# (the order of the pkg-config file's -l flags; checked below).
set(meshtrain_libraries
  meshtrain_train meshtrain_train_config meshtrain_train_models meshtrain_text
  meshtrain_data meshtrain_train_io meshtrain_parallel meshtrain_optim meshtrain_nn meshtrain_config
  meshtrain_plan meshtrain_layout meshtrain_checkpoint meshtrain_sharding meshtrain_mesh meshtrain_agent
  meshtrain_launch)
foreach(engine ${MESHTRAIN_INSTALLED_ENGINES})
  list(APPEND meshtrain_libraries meshtrain_comm_${engine})
endforeach()
list(APPEND meshtrain_libraries meshtrain_comm meshtrain_core)

# meshtrain::meshtrain: every layer at once (static libraries: a program
# gets only the objects it uses).
add_library(meshtrain_all INTERFACE)
target_link_libraries(meshtrain_all INTERFACE ${meshtrain_libraries})
set_target_properties(meshtrain_all PROPERTIES EXPORT_NAME meshtrain)

# The imported targets the libraries link (PUBLIC, or PRIVATE: a static
# library's private dependencies are in its link interface), which the
# package config finds again (cmake/meshtrainConfig.cmake.in knows each of
# these names) and the pkg-config file lists.
set(meshtrain_known_dependencies Threads::Threads fmt::fmt CLI11::CLI11 BLAS::BLAS DNNL::dnnl OpenMP::OpenMP_CXX
    tomlplusplus::tomlplusplus nlohmann_json::nlohmann_json ZLIB::ZLIB PkgConfig::SENTENCEPIECE MPI::MPI_C gloo)
# Fallbacks that are plain INTERFACE targets of this build (exported with it).
set(meshtrain_exported_helpers "")
foreach(helper meshtrain_tomlplusplus meshtrain_sentencepiece)
  if(TARGET ${helper})
    list(APPEND meshtrain_exported_helpers ${helper})
  endif()
endforeach()

set(MESHTRAIN_PACKAGE_DEPS "")
set(position 0)
foreach(lib ${meshtrain_libraries})
  math(EXPR position "${position} + 1")
  get_target_property(links ${lib} LINK_LIBRARIES)
  if(NOT links)
    set(links "")
  endif()
  foreach(item ${links})
    string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" item "${item}")
    if(item MATCHES "^meshtrain_")
      if(item IN_LIST meshtrain_exported_helpers)
        continue()
      endif()
      list(FIND meshtrain_libraries ${item} at)
      if(at LESS position)
        message(FATAL_ERROR "cmake/Install.cmake: ${lib} links ${item}, which is not after it in meshtrain_libraries "
                            "(the link order): move ${item} after ${lib}")
      endif()
    elseif(item IN_LIST meshtrain_known_dependencies)
      list(APPEND MESHTRAIN_PACKAGE_DEPS ${item})
    else()
      message(FATAL_ERROR "cmake/Install.cmake: ${lib} links '${item}', which the installed package cannot find "
                          "again: add it to meshtrain_known_dependencies and find it in cmake/meshtrainConfig.cmake.in")
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES MESHTRAIN_PACKAGE_DEPS)

install(TARGETS ${meshtrain_libraries} meshtrain_all ${meshtrain_exported_helpers}
  EXPORT meshtrainTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS meshtrain RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Public headers: each layer's own; internal/ folders, the engines' folders
# (reached by name through comm/launch.h) and test support stay out.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/meshtrain/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshtrain
  FILES_MATCHING PATTERN "*.h"
  REGEX "/internal(/|$)" EXCLUDE
  REGEX "/comm/(threads|mpi|gloo|nccl)(/|$)" EXCLUDE
  REGEX "/testing(/|$)" EXCLUDE
  REGEX "_test_util\\.h$" EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/include/meshtrain/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/meshtrain)

# The CMake package.
set(MESHTRAIN_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/meshtrain)
install(EXPORT meshtrainTargets NAMESPACE meshtrain:: DESTINATION ${MESHTRAIN_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/meshtrainConfig.cmake.in
  ${PROJECT_BINARY_DIR}/package/meshtrainConfig.cmake
  INSTALL_DESTINATION ${MESHTRAIN_CMAKE_DIR})
# 0.x: a minor version may break the API, so 0.1.2 satisfies a request for
# 0.1 or 0.1.1 and nothing else (docs/stability.md).
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/meshtrainConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/meshtrainConfig.cmake ${PROJECT_BINARY_DIR}/package/meshtrainConfigVersion.cmake
  DESTINATION ${MESHTRAIN_CMAKE_DIR})

# The pkg-config file: meshtrain's libraries in link order, then what they
# link, as the libraries this build found (absolute paths), pkg-config
# modules where CMake found them through pkg-config. Relocatable: the
# prefix is taken from the file's own place (${pcfiledir}).
list(TRANSFORM meshtrain_libraries PREPEND "-l" OUTPUT_VARIABLE pc_libs)
list(JOIN pc_libs " " MESHTRAIN_PC_LIBS)
set_property(GLOBAL PROPERTY meshtrain_pc_dep_libs "")
set_property(GLOBAL PROPERTY meshtrain_pc_requires "")
# Appends what linking `dep` takes to the global properties above.
function(meshtrain_pc_add dep)
  if(dep MATCHES "^PkgConfig::(.+)$")
    set_property(GLOBAL APPEND PROPERTY meshtrain_pc_requires "${${CMAKE_MATCH_1}_MODULE_NAME}")
  elseif(TARGET ${dep})
    get_target_property(type ${dep} TYPE)
    if(NOT type STREQUAL "INTERFACE_LIBRARY")
      set_property(GLOBAL APPEND PROPERTY meshtrain_pc_dep_libs "$<TARGET_LINKER_FILE:${dep}>")
    endif()
    get_target_property(options ${dep} INTERFACE_LINK_OPTIONS)
    if(options)
      set_property(GLOBAL APPEND PROPERTY meshtrain_pc_dep_libs ${options})
    endif()
    get_target_property(links ${dep} INTERFACE_LINK_LIBRARIES)
    foreach(link ${links})
      if(link)
        string(REGEX REPLACE "^\\$<LINK_ONLY:(.*)>$" "\\1" link "${link}")
        meshtrain_pc_add(${link})
      endif()
    endforeach()
  elseif(dep MATCHES "::")
    message(FATAL_ERROR "cmake/Install.cmake: the pkg-config file needs the target ${dep}, not visible here: "
                        "find its package in cmake/Dependencies.cmake")
  elseif(dep MATCHES "/libpthread\\.(a|so)$")
    # -pthread, which the file gives anyway.
  elseif(dep MATCHES "^-" OR IS_ABSOLUTE "${dep}")
    set_property(GLOBAL APPEND PROPERTY meshtrain_pc_dep_libs "${dep}")
  else()
    set_property(GLOBAL APPEND PROPERTY meshtrain_pc_dep_libs "-l${dep}")
  endif()
endfunction()
foreach(dep ${MESHTRAIN_PACKAGE_DEPS} ${meshtrain_exported_helpers})
  meshtrain_pc_add(${dep})
endforeach()
get_property(pc_dep_libs GLOBAL PROPERTY meshtrain_pc_dep_libs)
get_property(pc_requires GLOBAL PROPERTY meshtrain_pc_requires)
list(REMOVE_DUPLICATES pc_dep_libs)
list(REMOVE_DUPLICATES pc_requires)
list(JOIN pc_dep_libs " " MESHTRAIN_PC_DEP_LIBS)
list(JOIN pc_requires ", " MESHTRAIN_PC_REQUIRES)
list(JOIN MESHTRAIN_INSTALLED_ENGINES " " MESHTRAIN_PC_ENGINES)
file(RELATIVE_PATH MESHTRAIN_PC_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
string(REGEX REPLACE "/$" "" MESHTRAIN_PC_PREFIX "${MESHTRAIN_PC_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/meshtrain.pc.in ${PROJECT_BINARY_DIR}/package/meshtrain.pc.in @ONLY)
# Evaluates the $<TARGET_LINKER_FILE:...> of the dependencies.
file(GENERATE OUTPUT ${PROJECT_BINARY_DIR}/package/meshtrain.pc INPUT ${PROJECT_BINARY_DIR}/package/meshtrain.pc.in)
install(FILES ${PROJECT_BINARY_DIR}/package/meshtrain.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# Documentation and the consumer example, for a packaged install.
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/install.md ${PROJECT_SOURCE_DIR}/docs/stability.md
  DESTINATION ${CMAKE_INSTALL_DOCDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/examples/consumer DESTINATION ${CMAKE_INSTALL_DOCDIR}/examples)
