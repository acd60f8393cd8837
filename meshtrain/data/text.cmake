# Text data: corpus reading, the SentencePiece tokenizer, the token file and
# the token DataSource (text_corpus.*, tokenizer.*, token_file.*,
# text_data.*). Included by data/CMakeLists.txt, after data.cmake.
if(PKG_CONFIG_FOUND)
  pkg_check_modules(SENTENCEPIECE QUIET IMPORTED_TARGET sentencepiece)
endif()
if(NOT TARGET PkgConfig::SENTENCEPIECE)
  find_path(MESHTRAIN_SENTENCEPIECE_INCLUDE sentencepiece_trainer.h)
  find_library(MESHTRAIN_SENTENCEPIECE_LIB sentencepiece)
  find_library(MESHTRAIN_SENTENCEPIECE_TRAIN_LIB sentencepiece_train)
  if(NOT MESHTRAIN_SENTENCEPIECE_INCLUDE OR NOT MESHTRAIN_SENTENCEPIECE_LIB OR NOT MESHTRAIN_SENTENCEPIECE_TRAIN_LIB)
    message(FATAL_ERROR "SentencePiece not found (sentencepiece_trainer.h, libsentencepiece, libsentencepiece_train): "
                        "run scripts/install-deps.sh (package libsentencepiece-dev)")
  endif()
  add_library(meshtrain_sentencepiece INTERFACE)
  target_include_directories(meshtrain_sentencepiece INTERFACE ${MESHTRAIN_SENTENCEPIECE_INCLUDE})
  target_link_libraries(meshtrain_sentencepiece INTERFACE ${MESHTRAIN_SENTENCEPIECE_TRAIN_LIB}
                        ${MESHTRAIN_SENTENCEPIECE_LIB})
  set(MESHTRAIN_SENTENCEPIECE meshtrain_sentencepiece)
  message(STATUS "  found    SentencePiece ${MESHTRAIN_SENTENCEPIECE_LIB}")
else()
  set(MESHTRAIN_SENTENCEPIECE PkgConfig::SENTENCEPIECE)
  message(STATUS "  found    SentencePiece ${SENTENCEPIECE_VERSION}")
endif()

meshtrain_layer(meshtrain_text
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/text_corpus.cc ${CMAKE_CURRENT_LIST_DIR}/tokenizer.cc
          ${CMAKE_CURRENT_LIST_DIR}/token_file.cc ${CMAKE_CURRENT_LIST_DIR}/text_data.cc
  DEPS meshtrain_data meshtrain_core
  PRIVATE_DEPS ${MESHTRAIN_SENTENCEPIECE} ZLIB::ZLIB)

meshtrain_test(tokenizer_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/tokenizer_test.cc
  DEPS meshtrain_text GTest::gmock
  TIMEOUT 120 LABELS train data)
meshtrain_test(token_file_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/token_file_test.cc
  DEPS meshtrain_text GTest::gmock ZLIB::ZLIB
  TIMEOUT 60 LABELS train data)
meshtrain_test(text_data_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/text_data_test.cc
  DEPS meshtrain_text GTest::gmock
  TIMEOUT 120 LABELS train data)
