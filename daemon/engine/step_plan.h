#pragma once
// The tensor-parallel step plan: what rank 0 tells the other ranks before each engine step,
// as bytes for the control channel (control_channel.h). It carries only the step's
// structure: the sequences that leave (cancelled) and the ones that join (prompt, sampling
// parameters with a fixed seed, block table, prefix-cache hits). Every rank then schedules
// the step, runs it, draws each sequence's token from the same gathered logits with the
// same counter-based sampler, and decides EOS, stop ids and max_tokens itself, so no token
// travels in a plan: a decode step with nothing new is a plan of kPlanHeaderBytes. The one
// exception is a sequence with an output constraint (structured outputs): its grammar stays
// on rank 0, which broadcasts the tokens it drew in each step that draws for one.
//
// Each plan also carries the digest of the tokens rank 0 drew in an earlier step; a rank
// whose own digest of that step differs has diverged and stops the ring (engine.cc).
// Integers are in the host's byte order: every rank of a ring runs the same build.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "daemon/engine/sampler.h"

namespace spark::engine {

enum class PlanKind : uint32_t {
  step = 1,       // a step follows: apply the plan, then run the step
  heartbeat = 2,  // rank 0 is alive and idle; nothing to do
  stop = 3,       // rank 0's engine stopped: the worker returns
};

/// One sequence joining the running set, with all a rank needs to run and sample it.
struct PlanAdmit {
  uint64_t seq = 0;     // ring-wide sequence id (rank 0 numbers them from 1)
  uint64_t stream = 0;  // the sampler's stream: the choice index
  std::vector<int32_t> prompt;
  int32_t max_total = 0;        // prompt + max_tokens, capped by the context
  int32_t computed = 0;         // leading prompt tokens already in the KV cache (prefix hits)
  std::vector<int32_t> blocks;  // the sequence's whole block table
  std::vector<int32_t> ring;    // its ring in the windowed layers' own pool (empty: none)
  int32_t write_from = 0;       // positions below are recomputed but not written (SeqChunk)
  SamplingParams params;        // seed always set, so every rank draws alike
  /// The sequence has an output constraint (its grammar stays on rank 0): rank 0 draws its
  /// tokens and broadcasts them each step, and the other ranks record those.
  bool rank0_draws = false;
};

struct StepPlan {
  PlanKind kind = PlanKind::step;
  uint64_t serial = 0;  // plans are numbered from 1; the step after plan s is step s
  /// Rank 0 posted this plan before it computed the previous step (the overlapped control
  /// plane); false when it waited for that step to end (lock-step).
  bool ahead = false;
  uint64_t digest_step = 0;  // the step whose token digest follows (0: none)
  uint64_t digest = 0;
  std::vector<uint64_t> cancels;  // sequences that leave before the step, freeing their blocks
  std::vector<PlanAdmit> admits;  // sequences that join before the step, in this order
  bool has_content() const { return !cancels.empty() || !admits.empty(); }
};

/// Bytes of a plan with no cancels and no admissions (a decode step with nothing new).
inline constexpr size_t kPlanHeaderBytes = 48;

std::string encode_plan(const StepPlan& plan);
/// The plan in `bytes`; Errc::integrity naming the field and offset of a malformed one.
Result<StepPlan> decode_plan(std::string_view bytes);

/// Folds one drawn token of sequence `seq` into a step's token digest (start from 0).
uint64_t fold_token_digest(uint64_t digest, uint64_t seq, int32_t token);

}  // namespace spark::engine
