# The Python bindings' dependencies (docs/python.md): pybind11 (Debian
# pybind11-dev) and a Python 3 interpreter with its development files
# (python3-dev) and numpy (python3-numpy). Sets MESHTRAIN_HAVE_PYTHON and,
# when on, Python_EXECUTABLE and MESHTRAIN_PYTHON_INSTALL_DIR (relative to
# the install prefix: the interpreter's package directory, Debian's
# dist-packages for /usr/bin/python3). Included before the libraries: the
# extension module links them, so they are built position-independent.
option(MESHTRAIN_WITH_PYTHON "Build the Python module (import meshtrain) when pybind11, Python 3 and numpy are found" ON)
set(MESHTRAIN_HAVE_PYTHON OFF)
set(MESHTRAIN_PYTHON_WHY "MESHTRAIN_WITH_PYTHON is OFF")
if(MESHTRAIN_WITH_PYTHON)
  # The interpreter: the one named by Python_EXECUTABLE, else the first of
  # python3 on PATH and /usr/bin/python3 that imports numpy (a pyenv or
  # virtualenv python3 without numpy falls back to Debian's).
  if(NOT Python_EXECUTABLE)
    find_program(meshtrain_path_python3 NAMES python3 NO_CACHE)
    foreach(candidate ${meshtrain_path_python3} /usr/bin/python3)
      if(EXISTS "${candidate}")
        execute_process(COMMAND "${candidate}" -c "import numpy" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
        if(rc EQUAL 0)
          set(Python_EXECUTABLE "${candidate}" CACHE FILEPATH "The Python interpreter the module is built for")
          break()
        endif()
      endif()
    endforeach()
  endif()
  if(Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter Development.Module QUIET)
    set(PYBIND11_FINDPYTHON ON)  # pybind11 takes the Python found above
    find_package(pybind11 CONFIG QUIET)
  endif()
  if(NOT Python_EXECUTABLE)
    set(MESHTRAIN_PYTHON_WHY "no python3 with numpy (apt install python3-numpy)")
  elseif(NOT pybind11_FOUND)
    set(MESHTRAIN_PYTHON_WHY "pybind11 not found (apt install pybind11-dev)")
  elseif(NOT Python_Development.Module_FOUND)
    set(MESHTRAIN_PYTHON_WHY "no Python development files for ${Python_EXECUTABLE} (apt install python3-dev)")
  else()
    set(MESHTRAIN_HAVE_PYTHON ON)
    # dist-packages for Debian's interpreter (its deb_system scheme), else
    # the interpreter's own platlib, relative to the prefix.
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c
        "import sysconfig; s = 'deb_system' if 'deb_system' in sysconfig.get_scheme_names() else sysconfig.get_default_scheme(); print(sysconfig.get_path('platlib', s, vars={'base': '', 'platbase': ''}).lstrip('/'))"
      OUTPUT_VARIABLE meshtrain_python_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
    set(MESHTRAIN_PYTHON_INSTALL_DIR "${meshtrain_python_dir}" CACHE STRING
        "Where cmake --install puts the meshtrain package, relative to the prefix")
    # The libraries go into the extension module: position-independent
    # code, without semantic interposition (GCC then inlines as it does
    # for an executable, so the numbers stay the same).
    set(CMAKE_POSITION_INDEPENDENT_CODE ON)
    add_compile_options(-fno-semantic-interposition)
  endif()
endif()
