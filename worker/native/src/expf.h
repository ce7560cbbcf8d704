// Included inside a namespace of the includer's own (as block.h): each
// instruction set's file compiles its own copy, so no two share a symbol.

// exp(x) for x <= 0 (scores less their maximum), Cephes' expf: within 2
// ulp, in operations a vector unit has (no libm call, so the loop
// vectorises).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r) * r + r + 1.0f;
  return y * __builtin_bit_cast(float, (int(n) + 127) << 23);
}
