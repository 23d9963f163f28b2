# Warnings for our own targets; SPARK_WERROR (CI) turns them into errors.
function(spark_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wcast-align -Wunused -Woverloaded-virtual -Wformat=2 -Wimplicit-fallthrough>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${SPARK_WERROR}>>:-Werror>)
endfunction()
