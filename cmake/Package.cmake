# The Debian package (CPack's DEB generator): what cmake/Install.cmake
# installs, under /usr, depending on the Debian development packages that
# the installed libraries link and the package config finds again
# (scripts/install-deps.sh names the same ones), and, through
# dpkg-shlibdeps, on the shared libraries the meshtrain command loads.
#
#   make deb        # build/release/package/meshtrain_<version>_<arch>.deb
#   sudo apt install ./build/release/package/meshtrain_*.deb
#
# See docs/install.md. tests/deb_test.sh builds, checks and unpacks it.
set(CPACK_GENERATOR DEB)
set(engines_text "")
if(MESHTRAIN_HAVE_MPI)
  string(APPEND engines_text ", OpenMPI")
endif()
if(MESHTRAIN_HAVE_GLOO)
  string(APPEND engines_text ", Gloo (TCP)")
endif()
set(CPACK_PACKAGE_NAME meshtrain)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed training of neural networks on a device mesh (library and command)")
set(CPACK_PACKAGE_DESCRIPTION "meshtrain is a C++20 library and command-line tool for training neural
networks across many devices: a device mesh with named axes, sharded
tensors, data, fully sharded, tensor, pipeline and context parallelism, on
a threads engine (simulated devices)${engines_text}.
This package holds the meshtrain command, the static libraries, their
public headers, a CMake package (find_package(meshtrain)) and a
pkg-config file (meshtrain).")
set(MESHTRAIN_PACKAGE_CONTACT "meshtrain maintainers <maintainers@users.noreply.a-seed-760db1b0.example>"
    CACHE STRING "The Debian package's Maintainer field")
set(CPACK_PACKAGE_CONTACT "${MESHTRAIN_PACKAGE_CONTACT}")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # meshtrain_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION devel)

# What a program built against the package needs: the headers and
# libraries of every dependency the package config finds again
# (MESHTRAIN_PACKAGE_DEPS, cmake/Install.cmake), and pkg-config for
# SentencePiece's module.
set(deb_depends libfmt-dev libcli11-dev libopenblas-dev nlohmann-json3-dev zlib1g-dev libsentencepiece-dev
    "pkgconf | pkg-config")
if("tomlplusplus::tomlplusplus" IN_LIST MESHTRAIN_PACKAGE_DEPS)
  list(APPEND deb_depends libtomlplusplus-dev)
endif()
if("DNNL::dnnl" IN_LIST MESHTRAIN_PACKAGE_DEPS)
  list(APPEND deb_depends libdnnl-dev)
  if(DNNL_GPU_RUNTIME STREQUAL "OCL")
    # dnnl-config.cmake requires OpenCL's development files.
    list(APPEND deb_depends "ocl-icd-opencl-dev | opencl-dev")
  endif()
endif()
set(deb_recommends cmake g++)
if(MESHTRAIN_HAVE_MPI)
  list(APPEND deb_depends libopenmpi-dev)
  list(APPEND deb_recommends openmpi-bin)  # mpirun
endif()
if(MESHTRAIN_HAVE_GLOO)
  list(APPEND deb_depends libgloo-dev)
endif()
if(MESHTRAIN_HAVE_PYTHON)
  # The module (import meshtrain) is built for this interpreter's version.
  math(EXPR next_minor "${Python_VERSION_MINOR} + 1")
  list(APPEND deb_depends "python3 (>= ${Python_VERSION_MAJOR}.${Python_VERSION_MINOR})"
       "python3 (<< ${Python_VERSION_MAJOR}.${next_minor})" python3-numpy)
endif()
list(JOIN deb_depends ", " CPACK_DEBIAN_PACKAGE_DEPENDS)
list(JOIN deb_recommends ", " CPACK_DEBIAN_PACKAGE_RECOMMENDS)
# The data of the built-in models (`meshtrain train`, docs/data.md).
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "dataset-fashion-mnist, fortunes")
# The shared libraries the meshtrain command loads, by dpkg-shlibdeps.
find_program(MESHTRAIN_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(MESHTRAIN_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
endif()
include(CPack)
