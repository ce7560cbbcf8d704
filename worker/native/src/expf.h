// Included inside a namespace of the includer's own (as block.h): each
// instruction set's file compiles its own copy, so no two share a symbol.

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf: within 2
// ulp, in operations a vector unit has (no libm call where the target has
// fused multiply-adds, so the loop vectorises); exactly 0 below -87
// (e^-87 ~ 1.6e-38: nothing beside any weight of a softmax, whose largest
// is 1), so a masked score (-inf) weighs exactly nothing. Its steps are
// fused multiply-adds, one rounding each (a third fewer instructions than
// a product and a sum: a prefill chunk's weights 1.5x faster), so every
// instruction set gets the same bits; where a file's target has none
// (the scalar file on x86), fmaf computes them.
inline float exp_nonpositive(float x) {
  const bool nothing = x < -87.0f;
  x = nothing ? -87.0f : x;
  const float n = __builtin_floorf(__builtin_fmaf(x, 1.44269504088896341f, 0.5f));
  const float r = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = __builtin_fmaf(p, r, 1.3981999507e-3f);
  p = __builtin_fmaf(p, r, 8.3334519073e-3f);
  p = __builtin_fmaf(p, r, 4.1665795894e-2f);
  p = __builtin_fmaf(p, r, 1.6666665459e-1f);
  p = __builtin_fmaf(p, r, 5.0000001201e-1f);
  const float y = __builtin_fmaf(p * r, r, r) + 1.0f;
  return nothing ? 0.0f : y * __builtin_bit_cast(float, (int(n) + 127) << 23);
}
