#pragma once
// `sparkd fabric-rank`: one rank of `sparkctl preflight --fabric` (the fabric self-test on
// the ring's pins before any engine starts).

namespace spark::daemon {

/// Runs one rank of the test with this process's NCCL_* environment; prints the report (or
/// {"error":...}) as one JSON line. Exit 0 passed, the precondition code when it failed.
int fabric_rank_main(int argc, const char* const* argv);

}  // namespace spark::daemon
