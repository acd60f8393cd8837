# Data: IDX/Fashion-MNIST reading, the distributed sampler and the batch
# prefetcher (idx.*, sampler.*). Included by data/CMakeLists.txt.
if(NOT TARGET ZLIB::ZLIB)
  message(FATAL_ERROR "zlib not found: run scripts/install-deps.sh (package zlib1g-dev)")
endif()

meshtrain_layer(meshtrain_data
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/idx.cc ${CMAKE_CURRENT_LIST_DIR}/sampler.cc
  DEPS meshtrain_core
  PRIVATE_DEPS ZLIB::ZLIB)

meshtrain_test(idx_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/idx_test.cc
  DEPS meshtrain_data ZLIB::ZLIB
  TIMEOUT 60 LABELS train data)

meshtrain_test(sampler_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/sampler_test.cc
  DEPS meshtrain_data
  TIMEOUT 60 LABELS train data)
