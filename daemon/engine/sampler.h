#pragma once
// Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, a
// counter-based random draw keyed by (seed, stream, step), logprobs. One Sampler per
// generated sequence. The draw itself is kernels/sampler.h's, the same function the GPU
// sampler computes, so a sequence gets the same tokens on either device.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "daemon/grammar/json_grammar.h"
#include "kernels/sampler.h"

namespace spark::engine {

/// Most top_logprobs a request may ask for (OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;

/// OpenAI-style sampling parameters (stop strings are the API layer's job).
struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy (argmax)
  int top_k = 0;                    // 0 or -1: off
  float top_p = 1.0f;               // (0, 1]
  float min_p = 0.0f;               // [0, 1]: drop tokens below min_p * p(max)
  float repetition_penalty = 1.0f;  // > 0; tokens of prompt+output: logit/r if > 0 else logit*r
  float presence_penalty = 0.0f;    // [-2, 2]; minus this once for tokens already generated
  float frequency_penalty = 0.0f;   // [-2, 2]; minus this times the count of each generated token
  std::optional<uint64_t> seed;     // same seed + prompt -> same tokens
  int max_tokens = 16;    // capped by the context; 0: prefill the prompt only (finish "length")
  int n = 1;              // choices, 1..kMaxChoices
  bool logprobs = false;  // report the chosen token's logprob
  int top_logprobs = 0;   // 0..20 alternatives per token
  /// >= 0: the log-probability of every prompt token after the ones before it (the first
  /// has none), with this many (0..20) alternatives each: the engine then computes the
  /// logits of every prompt position, for this request alone. -1: off.
  int prompt_logprobs = -1;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;  // do not stop at the model's EOS ids
  /// Structured outputs: each draw takes only the tokens this grammar allows next (its end
  /// ids once the value is complete, and those alone when nothing may follow). Null: none.
  std::shared_ptr<const grammar::Constraint> constraint;
};

inline constexpr int kMaxChoices = 16;

/// Checks ranges; Errc::usage with a message naming the field.
Status validate(const SamplingParams& p, int vocab_size);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

struct Sample {
  int32_t token = 0;
  float logprob = 0;              // log-softmax of the model's logits (before any processing)
  std::vector<TokenLogprob> top;  // top_logprobs alternatives, most likely first
};

/// `token`'s log-softmax in `logits` (vocab_size floats) and the `top` most likely ids
/// (ties: lowest id first), as sample() reports a drawn token's: how a prompt token is scored.
Sample score_token(const float* logits, int vocab_size, int32_t token, int top);

class Sampler {
 public:
  /// `stream` tells apart the choices of one request (choice index): with a seed, each
  /// choice gets its own deterministic stream.
  Sampler(const SamplingParams& p, int vocab_size, const std::vector<int32_t>& prompt,
          uint64_t stream);
  /// Picks the next token from `logits` (vocab_size floats; not modified) and records it.
  Sample sample(const float* logits);
  /// The kernel parameters of the next draw (seed, stream and step included), for a device
  /// sampler that draws for this sequence: it then picks what sample() would. `ahead` > 0:
  /// the draw that many after the next (a step queued before this one's draw is recorded;
  /// without penalties, whose state would need the draws in between).
  kernels::SampleParams next_params(uint32_t ahead = 0) const;
  /// Records a token drawn elsewhere (by the device sampler), as sample() does.
  void record(int32_t token);
  /// With a constraint: the allowed ids of the next draw ((vocab + 31) / 32 words, computed
  /// once per step); null without one.
  const uint32_t* mask() const;
  bool constrained() const { return matcher_ != nullptr; }
  /// Penalty state: 1 for tokens of the prompt and output so far, and output counts.
  const std::vector<uint8_t>& seen() const { return seen_; }
  const std::vector<int32_t>& counts() const { return counts_; }

 private:
  SamplingParams p_;
  int vocab_;
  std::vector<uint8_t> seen_;
  std::vector<int32_t> counts_;
  uint64_t seed_ = 0;
  uint64_t stream_ = 0;
  uint32_t step_ = 0;
  std::unique_ptr<grammar::Matcher> matcher_;
  mutable std::vector<uint32_t> mask_;
  mutable int64_t mask_step_ = -1;  // the step mask_ is for
  mutable int allowed_ = 0;         // ids mask_ allows
};

}  // namespace spark::engine
