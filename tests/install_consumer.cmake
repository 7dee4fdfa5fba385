# ctest -P script: install qkv into a temporary prefix, build tests/consumer against it, run the result.
# Variables: BUILD_DIR (qkv's build tree), SOURCE_DIR (qkv's source tree), WORK_DIR (scratch).
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build" -G Ninja
                        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the consumer project against the installed qkv failed (${rc})")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build "${WORK_DIR}/build" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer project failed (${rc})")
endif()
execute_process(COMMAND "${WORK_DIR}/build/readme_example" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message("${out}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "-0\\.0739, +0\\.0713")
  message(FATAL_ERROR "the installed library's example did not print the book's first row")
endif()

# The same example built without CMake, with the installed pkg-config file.
find_program(PKG_CONFIG pkg-config REQUIRED)
set(ENV{PKG_CONFIG_PATH} "${WORK_DIR}/prefix/lib/pkgconfig")
execute_process(COMMAND ${PKG_CONFIG} --cflags --libs qkv OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pkg-config does not find the installed qkv.pc")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
execute_process(COMMAND c++ -std=c++20 -O1 ${SOURCE_DIR}/tests/readme_example.cpp -o ${WORK_DIR}/pc_example ${flags}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the example with `pkg-config --cflags --libs qkv` failed")
endif()
execute_process(COMMAND ${WORK_DIR}/pc_example RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT out MATCHES "-0\\.0739, +0\\.0713")
  message(FATAL_ERROR "the pkg-config-built example did not print the book's first row")
endif()
message("pkg-config build: ok")
