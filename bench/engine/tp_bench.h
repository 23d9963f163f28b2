#pragma once
// What the tensor-parallel control plane costs a decode step, on the CPU path: W ranks as
// threads over Gloo on loopback, the same random checkpoint and the same steps, twice:
//   - "engine, plan overlapped": rank 0 runs the Engine (scheduler, sampling, the step plan
//     posted to the workers before the step before computes) and the other ranks run
//     run_tp_worker (each draws the tokens itself);
//   - "engine, plan after each step": the same with EngineOptions::overlap_plan off, so the
//     workers wait for each plan;
//   - "lock-step" (the peer: no control plane): every rank already knows each step and
//     calls Model::forward directly; rank 0 also takes the greedy argmax of the logits, as
//     the engine's sampler does.
// Decode step time = the median of every decode step's duration over all rounds (a loaded
// machine's stalls hit single steps; the median leaves them out), with the 10th percentile.
// The difference is what the control plane (and the scheduler's bookkeeping) add per step;
// plan_ready is rank 1's count of decode steps whose plan had already arrived.
#include <map>
#include <string>

#include "core/error.h"

namespace spark::engine {

/// `opts`: tp-size (2), hidden (512), layers (8), vocab (8192), batch (1), tokens (64),
/// rounds (3), threads (1), json (set: JSON instead of the table). Returns the exit code.
Result<int> run_tp_bench(const std::map<std::string, std::string>& opts);

}  // namespace spark::engine
