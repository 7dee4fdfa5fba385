# ctest -P script: install qkv into a temporary prefix, build tests/consumer against it, run the result.
# Variables: BUILD_DIR (qkv's build tree), SOURCE_DIR (qkv's source tree), WORK_DIR (scratch).
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
# Builds tests/consumer against the installed package (the shared libraries, or the archives when STATIC is ON) and
# runs its examples.
function(build_consumer kind static)
  set(build "${WORK_DIR}/build-${kind}")
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/consumer" -B "${build}" -G Ninja
                          -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release -DQKV_STATIC=${static}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring the consumer project against the installed qkv (${kind}) failed (${rc})")
  endif()
  if(NOT static)
    # The shared libraries carry their dependencies: the consumer looked for none of them.
    file(STRINGS "${build}/CMakeCache.txt" found REGEX "^(OpenMP_CXX_FLAGS|GIF_LIBRARY|PNG_LIBRARY[A-Z_]*|MPI_CXX_[A-Z_]*|dnnl_DIR)[:=]")
    if(found)
      message(FATAL_ERROR "a consumer of the shared qkv::qkv had to find qkv's private dependencies: ${found}")
    endif()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build "${build}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the consumer project (${kind}) failed")
  endif()
  execute_process(COMMAND "${build}/readme_example" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  message("${kind}: ${out}")
  if(NOT rc EQUAL 0 OR NOT out MATCHES "-0\\.0739, +0\\.0713")
    message(FATAL_ERROR "the installed library's example (${kind}) did not print the book's first row")
  endif()
  file(MAKE_DIRECTORY "${WORK_DIR}/${kind}")
  execute_process(COMMAND "${build}/pictures_example" "${WORK_DIR}/${kind}" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT EXISTS "${WORK_DIR}/${kind}/weights.svg" OR NOT EXISTS "${WORK_DIR}/${kind}/loss.pdf")
    message(FATAL_ERROR "the installed qkv::viz's example (${kind}) did not write its pictures: ${out}")
  endif()
endfunction()
build_consumer(shared OFF)
build_consumer(static ON)

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
  execute_process(COMMAND c++ -std=c++20 -O1 ${SOURCE_DIR}/tests/${example}.cpp -o ${WORK_DIR}/pc_${example}_${package} ${flags}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building ${example} with `pkg-config --cflags --libs ${package}` failed")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${WORK_DIR}/prefix/lib ${WORK_DIR}/pc_${example}_${package} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the pkg-config-built ${example} failed: ${out}")
  endif()
  set(${output} "${out}" PARENT_SCOPE)
endfunction()

foreach(kind IN ITEMS "" "-static")
  build_with_pkg_config(qkv${kind} readme_example out)
  if(NOT out MATCHES "-0\\.0739, +0\\.0713")
    message(FATAL_ERROR "the example built with qkv${kind}.pc did not print the book's first row")
  endif()
  file(MAKE_DIRECTORY "${WORK_DIR}/pc${kind}")
  build_with_pkg_config(qkv-viz${kind} pictures_example out "${WORK_DIR}/pc${kind}")
  if(NOT EXISTS "${WORK_DIR}/pc${kind}/weights.png")
    message(FATAL_ERROR "the pictures example built with qkv-viz${kind}.pc wrote no weights.png: ${out}")
  endif()
endforeach()
message("pkg-config builds of qkv, qkv-viz, qkv-static and qkv-viz-static: ok")
