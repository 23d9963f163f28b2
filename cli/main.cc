// sparkctl: the operator's CLI. Everything is in the sparkcli library.
#include <iostream>

#include "cli/cli.h"

int main(int argc, char** argv) {
  return spark::cli::run(argc, argv, std::cout, std::cerr, spark::Environment::current());
}
