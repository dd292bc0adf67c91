# A run that must be refused: `cmake -DCOMMAND=a|b|c -DEXIT=2 -DMESSAGE=<regex> -P expect_refusal.cmake` runs the
# command (its arguments separated by '|') and passes only when it exits with EXIT and its stderr matches
# MESSAGE; a crash (a signal), another exit code or another message fails, with the output shown.
string(REPLACE "|" ";" _cmd "${COMMAND}")
execute_process(COMMAND ${_cmd} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT "${_rc}" STREQUAL "${EXIT}")
  message(FATAL_ERROR "exit '${_rc}', expected ${EXIT}\nstdout:\n${_out}\nstderr:\n${_err}")
endif()
if(NOT _err MATCHES "${MESSAGE}")
  message(FATAL_ERROR "stderr does not match '${MESSAGE}'\nstdout:\n${_out}\nstderr:\n${_err}")
endif()
message(STATUS "refused with exit ${_rc}: ${_err}")
