# Sharding strategies (DataParallel, FSDP, TensorParallel, PipelineParallel,
# MultiDimensional): see docs/strategies.md.
target_sources(meshtrain_sharding PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/strategy.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/stage_assignment.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/multi_dimensional.cc)
meshtrain_test(strategy_test SOURCES strategy_test.cc DEPS meshtrain_sharding)
# The tests match error messages with gmock's HasSubstr.
target_link_libraries(strategy_test PRIVATE GTest::gmock)
