# Warnings for our own targets; SPARK_WERROR (CI) turns them into errors.
function(spark_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wcast-align -Wunused -Woverloaded-virtual -Wformat=2 -Wimplicit-fallthrough>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${SPARK_WERROR}>>:-Werror>
    # GCC 12 at -O3 reports impossible std::string copies (-Wrestrict, GCC bug 105329)
    # in plain string assignments; it is a false positive, so it must not fail the build.
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict>)
endfunction()
