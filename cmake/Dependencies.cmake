# Every dependency is a Debian package installed by scripts/setup.sh.
find_package(OpenMP REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(Threads REQUIRED)

# OpenBLAS built for OpenMP (libopenblas-openmp-dev): its threads are the same OpenMP pool our own
# kernels use, so BLAS calls made inside our parallel regions run single-threaded instead of
# oversubscribing the cores.
find_library(OPENBLAS_OPENMP_LIB NAMES openblas
             PATHS /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
find_path(CBLAS_INCLUDE_DIR NAMES cblas.h
          PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp /usr/include/openblas)
if(NOT OPENBLAS_OPENMP_LIB OR NOT CBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS (OpenMP build) not found: run scripts/setup.sh "
                      "(Debian package libopenblas-openmp-dev)")
endif()
add_library(malleus_blas INTERFACE)
target_link_libraries(malleus_blas INTERFACE ${OPENBLAS_OPENMP_LIB} OpenMP::OpenMP_CXX)
target_include_directories(malleus_blas SYSTEM INTERFACE ${CBLAS_INCLUDE_DIR})

find_path(XXHASH_INCLUDE_DIR NAMES xxhash.h)
find_library(XXHASH_LIB NAMES xxhash)
if(NOT XXHASH_INCLUDE_DIR OR NOT XXHASH_LIB)
  message(FATAL_ERROR "xxHash not found: run scripts/setup.sh (Debian package libxxhash-dev)")
endif()
add_library(malleus_xxhash INTERFACE)
target_link_libraries(malleus_xxhash INTERFACE ${XXHASH_LIB})
target_include_directories(malleus_xxhash SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
# Debian's shared libxxhash on x86-64 chooses the widest vector unit (AVX2, AVX-512) at run time
# only in its *_dispatch entry points; common/checksum.cpp uses them where the library has them.
include(CheckLibraryExists)
check_library_exists(${XXHASH_LIB} XXH3_64bits_update_dispatch "" MALLEUS_HAVE_XXH3_DISPATCH)
if(MALLEUS_HAVE_XXH3_DISPATCH)
  target_compile_definitions(malleus_xxhash INTERFACE MALLEUS_XXH3_DISPATCH=1)
endif()

# Compressed corpora (src/data): gzip through zlib, xz through liblzma, zstd through libzstd
# (Debian packages zlib1g-dev, liblzma-dev, libzstd-dev).
find_package(PkgConfig REQUIRED)
pkg_check_modules(MALLEUS_ZLIB IMPORTED_TARGET zlib)
pkg_check_modules(MALLEUS_LZMA IMPORTED_TARGET liblzma)
pkg_check_modules(MALLEUS_ZSTD IMPORTED_TARGET libzstd)
if(NOT MALLEUS_ZLIB_FOUND OR NOT MALLEUS_LZMA_FOUND OR NOT MALLEUS_ZSTD_FOUND)
  message(FATAL_ERROR "zlib, liblzma or libzstd not found: run scripts/setup.sh "
                      "(Debian packages zlib1g-dev, liblzma-dev, libzstd-dev)")
endif()
add_library(malleus_compression INTERFACE)
target_link_libraries(malleus_compression INTERFACE PkgConfig::MALLEUS_ZLIB PkgConfig::MALLEUS_LZMA
                      PkgConfig::MALLEUS_ZSTD)

if(MALLEUS_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
