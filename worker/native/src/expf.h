// Included inside a namespace of the includer's own (as block.h): each
// instruction set's file compiles its own copy, so no two share a symbol.

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf: within 2
// ulp, in operations a vector unit has (no libm call, so the loop
// vectorises); exactly 0 below -87 (e^-87 ~ 1.6e-38: nothing beside
// any weight of a softmax, whose largest is 1), so a masked score (-inf)
// weighs exactly nothing.
inline float exp_nonpositive(float x) {
  const bool nothing = x < -87.0f;
  x = nothing ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r) * r + r + 1.0f;
  return nothing ? 0.0f : y * __builtin_bit_cast(float, (int(n) + 127) << 23);
}
