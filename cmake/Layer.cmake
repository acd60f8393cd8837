# meshtrain_layer(NAME SOURCES ... DEPS ...): one static library per layer.
# Include paths are the repository root only, and a layer links just the
# layers it names, so including a header from a layer to the right fails to
# link (and, for engine headers, to compile). Installed (cmake/Install.cmake),
# the same headers sit under <prefix>/include/meshtrain/<layer>/ and the
# target is exported as meshtrain::<NAME without "meshtrain_">.
function(meshtrain_layer name)
  cmake_parse_arguments(L "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${L_SOURCES})
  # The build's generated headers (meshtrain/version.h) sit beside the sources'.
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  # The public headers are C++20: a program that links a layer compiles as C++20 too.
  target_compile_features(${name} PUBLIC cxx_std_20)
  target_link_libraries(${name} PUBLIC ${L_DEPS} PRIVATE ${L_PRIVATE_DEPS})
  string(REGEX REPLACE "^meshtrain_" "" export_name "${name}")
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${export_name})
endfunction()

# meshtrain_test(NAME SOURCES ... DEPS ... [TIMEOUT s] [LABELS ...]): a GoogleTest
# binary with meshtrain's test main (meshtrain/testing/test_main.cc).
function(meshtrain_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_DEPS} GTest::gtest meshtrain_test_main)
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}")
endfunction()
