/* The FMA peak of this CPU: every thread runs 12 independent chains of vector FMAs (enough to
 * cover the FMA latency on the CPUs here: 4-5 cycles at 2 FMAs per cycle), so the count of
 * floating-point operations per second is what the FMA units can do, with no memory traffic.
 * Built and run by benchmarks/roofline.py (gcc -O2 -march=native -fopenmp); prints one line per
 * kind: "fp32 <GFLOP/s>" with the widest float vectors the build has, and, where the CPU has
 * AVX-512 BF16, "bf16dot <GFLOP/s>" for vdpbf16ps (two products per 32-bit lane). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#define CHAINS 12

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static float hsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float hsum(vec v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
#else
#error "needs AVX2 + FMA or AVX-512"
#endif

static double fp32_run(long iters, float *sink) {
  double t0 = omp_get_wtime();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    vec c[CHAINS];
    const vec va = SET1(0.999999f), vb = SET1(1e-7f);  /* chains stay finite */
    for (int i = 0; i < CHAINS; ++i) c[i] = SET1((float)i);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) c[i] = FMA(c[i], va, vb);
    }
    for (int i = 0; i < CHAINS; ++i) total += hsum(c[i]);
  }
  *sink += total;
  return omp_get_wtime() - t0;
}

#if defined(__AVX512BF16__)
static double bf16_run(long iters, float *sink) {
  double t0 = omp_get_wtime();
  float total = 0;
#pragma omp parallel reduction(+ : total)
  {
    __m512 c[CHAINS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
    for (int i = 0; i < CHAINS; ++i) c[i] = _mm512_set1_ps((float)i);
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < CHAINS; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, a);
    }
    for (int i = 0; i < CHAINS; ++i) total += _mm512_reduce_add_ps(c[i]);
  }
  *sink += total;
  return omp_get_wtime() - t0;
}
#endif

int main(int argc, char **argv) {
  const long iters = argc > 1 ? atol(argv[1]) : 50000000L;
  const int threads = omp_get_max_threads();
  float sink = 0;
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t = fp32_run(iters, &sink);
    if (t < best) best = t;
  }
  printf("fp32 %.1f\n", 2.0 * CHAINS * LANES * (double)iters * threads / best / 1e9);
#if defined(__AVX512BF16__)
  best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    const double t = bf16_run(iters, &sink);
    if (t < best) best = t;
  }
  printf("bf16dot %.1f\n", 4.0 * CHAINS * LANES * (double)iters * threads / best / 1e9);
#endif
  fprintf(stderr, "threads %d (checksum %g)\n", threads, (double)sink);
  return 0;
}
