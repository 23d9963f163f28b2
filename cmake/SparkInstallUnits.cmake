# Run at install time (install(CODE) in the top CMakeLists.txt): copies the systemd units of
# packaging/systemd/ into lib/systemd/system under the prefix being installed, with their
# ExecStart paths rewritten from the default prefix (/usr/local, what the sources name so
# they also work when copied by hand) to this prefix's binaries. The prefix is only known
# here: `cpack` installs with /usr while a plain `cmake --install` may use another.
# The cluster file they name, /etc/sparkctl/ring.env, moves with the prefix too: /etc for
# /usr (the package), PREFIX/etc otherwise; the commented example ring.env is installed
# there unless one is already there (an operator's edits are never overwritten).
# Inputs: SPARK_RING_ENV (the example), SPARK_UNITS (unit files), SPARK_UNITS_STAGE (a build directory), SPARK_BINDIR and
# SPARK_SBINDIR (relative to the prefix).
if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set(_etc "/etc/sparkctl")
else()
  set(_etc "${CMAKE_INSTALL_PREFIX}/etc/sparkctl")
endif()
if(NOT EXISTS "$ENV{DESTDIR}${_etc}/ring.env")
  file(INSTALL DESTINATION "${_etc}" TYPE FILE FILES "${SPARK_RING_ENV}"
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
endif()
file(MAKE_DIRECTORY "${SPARK_UNITS_STAGE}")
set(_staged "")
foreach(_unit IN LISTS SPARK_UNITS)
  get_filename_component(_name "${_unit}" NAME)
  file(READ "${_unit}" _text)
  string(REPLACE "/usr/local/bin/" "${CMAKE_INSTALL_PREFIX}/${SPARK_BINDIR}/" _text "${_text}")
  string(REPLACE "/usr/local/sbin/" "${CMAKE_INSTALL_PREFIX}/${SPARK_SBINDIR}/" _text "${_text}")
  string(REPLACE "/etc/sparkctl/" "${_etc}/" _text "${_text}")
  file(WRITE "${SPARK_UNITS_STAGE}/${_name}" "${_text}")
  list(APPEND _staged "${SPARK_UNITS_STAGE}/${_name}")
endforeach()
# systemd looks in lib/systemd/system under the prefix, not in the multiarch LIBDIR.
file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/system" TYPE FILE
     PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ FILES ${_staged})
