# The CPU kernels' sources and their per-ISA flags, for kernels/CMakeLists.txt and the GPU check's
# fallback build (launch/gpu-check/CMakeLists.txt): one list for both.
#   colibri_kernels_cpu_sources(TARGET DIR): adds DIR/*.cpp of the list to TARGET, with the flags.
function(colibri_kernels_cpu_sources target dir)
  target_sources(${target} PRIVATE ${dir}/linear.cpp ${dir}/elementwise.cpp ${dir}/quant.cpp
                 ${dir}/quant_int8.cpp ${dir}/quant_zero_points.cpp ${dir}/read_bandwidth.cpp
                 ${dir}/nvfp4.cpp)
  # Per-ISA files with their own flags, chosen at run time by CPUID (quant.cpp, linear.cpp).
  if(NOT CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
    return()
  endif()
  target_sources(${target} PRIVATE ${dir}/quant_avx2.cpp ${dir}/quant_avx512.cpp
                 ${dir}/vec_avx2.cpp ${dir}/vec_avx512.cpp ${dir}/quant_int8_avx2.cpp
                 ${dir}/quant_int8_avx512.cpp ${dir}/quant_int8_tiles_vnni.cpp
                 ${dir}/quant_int8_avxvnni.cpp ${dir}/quant_avx512bf16.cpp ${dir}/quant_int8_amx.cpp
                 ${dir}/nvfp4_avx2.cpp ${dir}/nvfp4_avx512.cpp)
  set_source_files_properties(${dir}/quant_avx2.cpp ${dir}/vec_avx2.cpp ${dir}/quant_int8_avx2.cpp
    ${dir}/nvfp4_avx2.cpp
    TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma")
  set_source_files_properties(${dir}/quant_avx512.cpp ${dir}/vec_avx512.cpp
    TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mfma")
  set_source_files_properties(${dir}/quant_int8_avxvnni.cpp
    TARGET_DIRECTORY ${target} PROPERTIES COMPILE_OPTIONS "-mavx2;-mfma;-mavxvnni")
  set_source_files_properties(${dir}/quant_int8_avx512.cpp ${dir}/quant_int8_tiles_vnni.cpp
    ${dir}/nvfp4_avx512.cpp
    TARGET_DIRECTORY ${target} PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512vnni;-mfma")
  set_source_files_properties(${dir}/quant_int8_amx.cpp TARGET_DIRECTORY ${target} PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mfma;-mamx-tile;-mamx-int8")
  set_source_files_properties(${dir}/quant_avx512bf16.cpp TARGET_DIRECTORY ${target} PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512bf16;-mfma")
endfunction()
