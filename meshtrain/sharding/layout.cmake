# Layouts, sharded tensors, redistribution and sharding pictures (section 1
# of the sharding issue). Included by CMakeLists.txt in this folder.
target_sources(meshtrain_sharding PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/layout.cc
  ${CMAKE_CURRENT_LIST_DIR}/placement.cc
  ${CMAKE_CURRENT_LIST_DIR}/sharded_tensor.cc)
target_sources(meshtrain_sharding PRIVATE ${CMAKE_CURRENT_LIST_DIR}/visualize.cc)

meshtrain_test(layout_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/layout_test.cc
  DEPS meshtrain_sharding
  TIMEOUT 60 LABELS sharding)
target_link_libraries(layout_test PRIVATE GTest::gmock)

meshtrain_test(placement_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/placement_test.cc
  DEPS meshtrain_sharding
  TIMEOUT 60 LABELS sharding)

meshtrain_test(sharded_tensor_property_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/sharded_tensor_property_test.cc
  DEPS meshtrain_testing meshtrain_launch
  TIMEOUT 300 LABELS sharding multirank)

meshtrain_test(sharded_tensor_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/sharded_tensor_test.cc
  DEPS meshtrain_sharding meshtrain_launch
  TIMEOUT 120 LABELS sharding multirank)
target_link_libraries(sharded_tensor_test PRIVATE GTest::gmock)

meshtrain_test(visualize_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/visualize_test.cc
  DEPS meshtrain_sharding
  TIMEOUT 60 LABELS sharding)
target_link_libraries(visualize_test PRIVATE GTest::gmock)

# The property test's fixed subset under mpirun (tests/redistribute_mpi_main.cc).
if(MESHTRAIN_HAVE_MPI)
  add_executable(redistribute_mpi_test ${PROJECT_SOURCE_DIR}/tests/redistribute_mpi_main.cc)
  target_link_libraries(redistribute_mpi_test PRIVATE meshtrain_testing meshtrain_launch)
  add_test(NAME redistribute_mpi_np4
    COMMAND ${MPIEXEC_EXECUTABLE} --oversubscribe -np 4 $<TARGET_FILE:redistribute_mpi_test>)
  set_tests_properties(redistribute_mpi_np4 PROPERTIES TIMEOUT 300 LABELS "multirank;mpi"
    ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1")
endif()
