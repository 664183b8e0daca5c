# kernels_simd_isolation_test: the SIMD translation units (compiled with -mavx2 / -mavx512*) must
# define no link-once (weak) code: the linker keeps one copy of each such function for the whole
# program, and a copy compiled for AVX-512 would fault in scalar callers on CPUs without it
# (kernels/internal/segment_codecs.h, "ISA isolation of the SIMD paths").
#
#   cmake -DNM=<nm> -DOBJECTS=<a.o;b.o;...> -P check_simd_isolation.cmake
#
# Checks every object whose name contains "simd_avx"; fails when there is none.
set(checked 0)
foreach(obj IN LISTS OBJECTS)
  if(NOT obj MATCHES "simd_avx")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  execute_process(COMMAND "${NM}" --defined-only -C "${obj}" OUTPUT_VARIABLE symbols
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line IN LISTS lines)
    # "<address> <type> <name>": W is weak code, i an indirect function. Weak data (V, e.g.
    # typeinfo under -fsanitize=function) holds no instructions and is allowed.
    if(line MATCHES "^[0-9a-fA-F]* [Wi] (.*)$")
      message(SEND_ERROR "${obj} defines link-once code: ${CMAKE_MATCH_1}")
    endif()
  endforeach()
  message(STATUS "checked ${obj}")
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "no simd_avx* object among: ${OBJECTS}")
endif()
