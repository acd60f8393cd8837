# The configure summary's CPU line: the instruction-set level of the machine
# that configures, named as meshtrain/core/cpu_isa.h names it. The build
# itself does not depend on it: kernels pick their path at run time, capped
# by MESHTRAIN_CPU_ISA (docs/core.md, "CPU instruction sets").
set(MESHTRAIN_BUILD_CPU_ISA "unknown")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND EXISTS /proc/cpuinfo)
  file(STRINGS /proc/cpuinfo _meshtrain_flags REGEX "^flags" LIMIT_COUNT 1)
  string(APPEND _meshtrain_flags " ")
  set(MESHTRAIN_BUILD_CPU_ISA "sse41")
  if(_meshtrain_flags MATCHES " avx2 " AND _meshtrain_flags MATCHES " fma " AND _meshtrain_flags MATCHES " f16c ")
    set(MESHTRAIN_BUILD_CPU_ISA "avx2")
    if(_meshtrain_flags MATCHES " avx512f " AND _meshtrain_flags MATCHES " avx512bw " AND
       _meshtrain_flags MATCHES " avx512vl " AND _meshtrain_flags MATCHES " avx512dq ")
      set(MESHTRAIN_BUILD_CPU_ISA "avx512")
      if(_meshtrain_flags MATCHES " avx512_bf16 ")
        set(MESHTRAIN_BUILD_CPU_ISA "avx512_bf16")
        if(_meshtrain_flags MATCHES " amx_bf16 " AND _meshtrain_flags MATCHES " amx_tile ")
          set(MESHTRAIN_BUILD_CPU_ISA "amx")
        endif()
      endif()
    endif()
  endif()
endif()
set(_meshtrain_isa_note "kernels pick theirs at run time; MESHTRAIN_CPU_ISA=avx2 runs as an AVX2 CPU")
if(DEFINED ENV{MESHTRAIN_CPU_ISA})
  set(_meshtrain_isa_note "MESHTRAIN_CPU_ISA=$ENV{MESHTRAIN_CPU_ISA} is set here: programs run as a CPU with at most that")
endif()
message(STATUS "meshtrain CPU ISA: ${MESHTRAIN_BUILD_CPU_ISA} on this machine (${_meshtrain_isa_note})")
