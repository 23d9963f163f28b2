// sparkd: the per-node daemon. Everything lives in the sparkdaemon library.
#include "daemon/daemon.h"

int main(int argc, char** argv) {
  return spark::daemon::sparkd_main(argc, argv);
}
