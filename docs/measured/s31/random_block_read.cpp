#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <cstring>
#include <algorithm>
#include <sys/mman.h>
// Read random blocks of BS bytes (K and V pools), summing as float vectors; software prefetch DIST blocks ahead.
int main(int argc, char** argv) {
  size_t pool = 512ull << 20; int BS = atoi(argv[1]); int dist = atoi(argv[2]); int mode = argc > 3 ? atoi(argv[3]) : 0;
  size_t nb = pool / BS;
  char* k = (char*)aligned_alloc(2 << 20, pool); if (getenv("HUGE")) madvise(k, pool, MADV_HUGEPAGE); memset(k, 1, pool);
  std::vector<size_t> order(nb); for (size_t i = 0; i < nb; ++i) order[i] = i;
  std::mt19937 g(1); if (mode == 0) std::shuffle(order.begin(), order.end(), g);
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
    auto t0 = std::chrono::steady_clock::now();
    for (size_t b = 0; b < nb; ++b) {
      if (dist > 0 && b + dist < nb) { const char* pf = k + order[b + dist] * BS; for (int o = 0; o < BS; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0); }
      const float* p = (const float*)(k + order[b] * BS);
      for (int o = 0; o < BS / 4; o += 32) {
        acc0 = _mm256_add_ps(acc0, _mm256_load_ps(p + o)); acc1 = _mm256_add_ps(acc1, _mm256_load_ps(p + o + 8));
        acc2 = _mm256_add_ps(acc2, _mm256_load_ps(p + o + 16)); acc3 = _mm256_add_ps(acc3, _mm256_load_ps(p + o + 24));
      }
    }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float s[8]; _mm256_storeu_ps(s, _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    if (s[0] == 12345) printf("x");
    best = std::min(best, dt);
  }
  printf("BS=%d dist=%d mode=%s: %.1f GB/s\n", BS, dist, mode ? "seq" : "random", pool / best / 1e9);
}
