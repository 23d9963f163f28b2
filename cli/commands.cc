#include "cli/bundle.h"
#include "cli/cli.h"
#include "cli/engine_pin.h"
#include "cli/cmd_preflight.h"
#include "cli/cmd_stage.h"
#include "cli/cmd_demo_model.h"
#include "cli/cmd_ring.h"
#include "cli/cmd_bench.h"

namespace spark::cli {

// The command table. Add a line here for each new command (one file per command).
const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"help", "Show commands, or the help of one command", cmd_help},
      {"version", "Print versions of sparkctl and what it found (CUDA driver, NCCL)", cmd_version},
      {"config", "Show the resolved cluster file (config show) or validate it (config check)",
       cmd_config},
      {"preflight", "Check every node for what breaks rings (GID, pins, memory, disk, parity)",
       cmd_preflight},
      {"env", "Print a rank's engine environment (NCCL_*, GLOO_*, CUDA_VISIBLE_DEVICES)", cmd_env},
      {"plan", "Memory per rank for 1-4 nodes from the model's config.json; largest context",
       cmd_plan},
      {"capture-node", "Capture what preflight reads on this node into a replayable .tar.gz",
       cmd_capture_node},
      {"manifest", "Create or verify a model directory's manifest (xxh3-128 per file and chunk)", cmd_manifest},
      {"stage-weights", "Copy the model to every node over the fabric, verified and resumable", cmd_stage_weights},
      {"evict", "Drop the page cache of the model files on every node (no root needed)", cmd_evict},
      {"cache-stat", "Show how much of each file is in the page cache (like vmtouch -v)", cmd_cache_stat},
      {"stage-recv", "(internal) receiving half of stage-weights, started on a target over SSH", cmd_stage_recv},
      {"stage-send", "(internal) sending half of stage-weights, given receivers and tokens", cmd_stage_send},
      {"demo-model", "Write a small demo checkpoint with random weights (runs without a GPU)", cmd_demo_model},
      {"start", "Start sparkd on every node and wait until the ring is READY", cmd_start},
      {"stop", "Stop every rank, verify nothing is left, and keep the ring down (DISABLED)", cmd_stop},
      {"restart", "Stop and start the whole ring together (clears DISABLED and GAVE_UP)", cmd_restart},
      {"status", "Per rank and node: state, pid, uptime, memory, slots; READY, markers, watch", cmd_status},
      {"watch", "One health check; restart the ring after WATCH_FAILURES (run by cron/systemd)", cmd_watch},
      {"rollback", "Start the last engine set that reached READY (image by digest, cluster file)",
       cmd_rollback},
      {"bundle", "One .tar.gz for a bug report from every node: captures, versions, logs, diff",
       cmd_bundle},
      {"logs", "Show or follow a rank's sparkd log from the head", cmd_logs},
      {"health-get", "(internal) GET rank 0's /health on node 0 for the head", cmd_health_get},
      {"bench", "Benchmark and check an OpenAI-compatible endpoint: C1, C8, TTFT, prefill, gates",
       cmd_bench},
      {"node", "(internal) probe, launch or stop this node's ranks for the head (JSON)", cmd_node},
  };
  return table;
}

}  // namespace spark::cli
