// Included inside a namespace of the includer's own, after expf.h (as
// attend.h includes it): each instruction set's file compiles its own copy.

// silu(gate) * up into gate, n values: silu(g) = g * sigmoid(g), sigmoid
// as MLX's CPU computes it (1 / (1 + exp(-|g|)), mirrored below zero) with
// expf.h's exp. A loop the compiler vectorises under the file's target:
// every lane does the scalar loop's operations in its order (no
// contraction), so every instruction set gives the same bits.
inline void swiglu(float* gate, const float* up, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float y = 1.0f / (1.0f + exp_nonpositive(-__builtin_fabsf(g)));
    gate[i] = (g * (g < 0.0f ? 1.0f - y : y)) * up[i];
  }
}
