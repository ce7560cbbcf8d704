// Choosing tokens from logits on the CPU, as one op: MLX's CPU backend
// has no vector exp, sort or cumsum on x86, and mlx-lm's sampler chain
// (logsumexp, a sort for top-p, categorical sampling over the vocabulary)
// cost a decode step 1.9 ms a token at a temperature and 9.3 ms with
// top-p, against a 7.8 ms forward pass (SmolLM2's 49,152 tokens).
//
// The distribution is mlx-lm's chain's: top-p, then top-k, on the logits
// at temperature 1, then the temperature over what they keep. A token is
// drawn from it by one uniform number: the kept tokens' weights walked in
// a fixed order until their running sum passes the uniform's share of
// their total. Each row on its own.

#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace kvmux_native {

namespace mx = mlx::core;

// What a row keeps and how it is weighed: temperature 0 takes the first
// highest logit (mx.argmax's choice); top_p outside (0, 1) and top_k
// outside (0, tokens) keep every token.
struct Sampling {
  float temperature, top_p;
  int top_k;
};

// Tokens (logits' shape less its last axis, uint32) from logits (..., V),
// one uniform number in [0, 1) per row (none at temperature 0).
mx::array sample(const mx::array& logits, float temperature, float top_p, int top_k, std::vector<double> uniforms);

// The distribution `sample` draws each row's token from (float32, logits'
// shape; one-hot at temperature 0).
mx::array distribution(const mx::array& logits, float temperature, float top_p, int top_k);

class Sample : public mx::UnaryPrimitive {
 public:
  Sample(mx::Stream stream, Sampling sampling, std::vector<double> uniforms, bool distribution)
      : mx::UnaryPrimitive(stream),
        sampling_(sampling),
        uniforms_(std::move(uniforms)),
        distribution_(distribution) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override { return "KvmuxSample"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Sampling sampling_;
  std::vector<double> uniforms_;
  bool distribution_;
};

}  // namespace kvmux_native
