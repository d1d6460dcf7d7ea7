// Vector helpers shared by the CPU attention kernels: target attributes, and exp.
//
// Everything here is inline and carries its own target attribute, so including
// this file compiles no vector instruction into code that runs without a check.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVSERVE_HAVE_X86_BUILD 1
#include <immintrin.h>

#define KVSERVE_AVX2 __attribute__((target("avx2,fma")))
#define KVSERVE_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
#define KVSERVE_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
#define KVSERVE_AVX512_INLINE __attribute__((target("avx512f,avx512dq,fma"), always_inline)) inline

namespace kvserve::cpu {

// exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n through the exponent bits.
KVSERVE_AVX2_INLINE __m256 exp_nonpositive(__m256 x) {
  // NOTE: operands in this order, a NaN x stays NaN (max_ps returns its second operand).
  x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);  // below: exp underflows float32 anyway
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // n >= -126 here, so 2^n is a normal float: (n + 127) << 23.
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// The same on 16 lanes.
KVSERVE_AVX512_INLINE __m512 exp_nonpositive(__m512 x) {
  // NOTE: operands in this order, a NaN x stays NaN (max_ps returns its second operand).
  x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);  // below: exp underflows float32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  // n >= -126 here, so 2^n is a normal float: (n + 127) << 23.
  const __m512i exponent =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

}  // namespace kvserve::cpu

#endif  // x86
