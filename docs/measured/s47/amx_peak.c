#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <omp.h>
struct cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  long iters = 20000000;
  double t0=now();
  #pragma omp parallel
  {
    struct cfg c; memset(&c,0,sizeof c); c.palette=1;
    for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
    _tile_loadconfig(&c);
    static __thread char buf[4096] __attribute__((aligned(64)));
    _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
    _tile_loadd(4,buf,64);_tile_loadd(5,buf,64);_tile_loadd(6,buf,64);_tile_loadd(7,buf,64);
    for(long i=0;i<iters/4;i++){
      _tile_dpbf16ps(0,4,6);_tile_dpbf16ps(1,4,7);_tile_dpbf16ps(2,5,6);_tile_dpbf16ps(3,5,7);
    }
    _tile_stored(0,buf,64);
  }
  double t=now()-t0;
  int n=omp_get_max_threads();
  printf("threads %d: %.1f ns per tdpbf16ps per thread, %.0f GFLOP/s total\n", n, t/iters*1e9, n*iters*16384.0/t/1e9);
}
