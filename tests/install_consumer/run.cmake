# ctest -R install_and_find_package: installs the build tree into a scratch
# prefix, then configures, builds and runs tests/install_consumer against it.
set(prefix "${BUILD_DIR}/install-test/prefix")
set(consumer_build "${BUILD_DIR}/install-test/consumer")
file(REMOVE_RECURSE "${BUILD_DIR}/install-test")
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/tests/install_consumer;-B;${consumer_build};-G;${GENERATOR};-DCMAKE_PREFIX_PATH=${prefix}"
    "${CMAKE_COMMAND};--build;${consumer_build}"
    "${consumer_build}/consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE result)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "install_and_find_package: '${step}' failed (${result})")
  endif()
endforeach()
