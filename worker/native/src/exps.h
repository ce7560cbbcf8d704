// Included inside a namespace of the includer's own, after expf.h (as
// swiglu.h): each instruction set's file compiles its own copy.

// out[i] = exp((x[i] - shift) * scale) for n values x[i] <= shift (a
// sampler's weights: logits less their highest, over a temperature), with
// expf.h's exp (-inf: exactly 0). A loop the compiler vectorises under
// the file's target, each lane doing the scalar loop's operations: the
// same bits on every instruction set.
inline void exps(const float* x, size_t n, float shift, float scale, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = exp_nonpositive((x[i] - shift) * scale);
}
