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

execute_process(COMMAND "${WORK_DIR}/build/pictures_example" "${WORK_DIR}" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT EXISTS "${WORK_DIR}/weights.svg" OR NOT EXISTS "${WORK_DIR}/loss.pdf")
  message(FATAL_ERROR "the installed qkv::viz's example did not write its pictures: ${out}")
endif()

# The same examples built without CMake, with the installed pkg-config files.
find_program(PKG_CONFIG pkg-config REQUIRED)
set(ENV{PKG_CONFIG_PATH} "${WORK_DIR}/prefix/lib/pkgconfig")
# Builds tests/EXAMPLE.cpp with `pkg-config --cflags --libs PACKAGE` and runs it with ARGS; its output in OUTPUT.
function(build_with_pkg_config package example output)
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs ${package} OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config does not find the installed ${package}.pc (or a package it requires)")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  execute_process(COMMAND c++ -std=c++20 -O1 ${SOURCE_DIR}/tests/${example}.cpp -o ${WORK_DIR}/pc_${example} ${flags}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building ${example} with `pkg-config --cflags --libs ${package}` failed")
  endif()
  execute_process(COMMAND ${WORK_DIR}/pc_${example} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the pkg-config-built ${example} failed: ${out}")
  endif()
  set(${output} "${out}" PARENT_SCOPE)
endfunction()

build_with_pkg_config(qkv readme_example out)
if(NOT out MATCHES "-0\\.0739, +0\\.0713")
  message(FATAL_ERROR "the pkg-config-built example did not print the book's first row")
endif()
file(MAKE_DIRECTORY "${WORK_DIR}/pc")
build_with_pkg_config(qkv-viz pictures_example out "${WORK_DIR}/pc")
if(NOT EXISTS "${WORK_DIR}/pc/weights.png")
  message(FATAL_ERROR "the pkg-config-built pictures example wrote no weights.png: ${out}")
endif()
message("pkg-config builds of qkv and qkv-viz: ok")
