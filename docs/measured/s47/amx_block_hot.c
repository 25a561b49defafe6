#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
struct cfg { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static char A[32*1152*2] __attribute__((aligned(64)));
static char B[288*256] __attribute__((aligned(64)));
static float C[32*32] __attribute__((aligned(64)));
int main(int argc, char**argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct cfg c; memset(&c,0,sizeof c); c.palette=1;
  for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  _tile_loadconfig(&c);
  long K=576, reps=200000; long lda=1152, ldb=256; memset(A, FILL, sizeof A); memset(B, FILL, sizeof B);
  int mode = argc>1 ? atoi(argv[1]) : 0;
  double t0=now();
  for(long r=0;r<reps;r++){
    _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
    for(long k0=0;k0<K;k0+=32){
      const char* wk = B + (k0/2)*ldb;
      _tile_loadd(4, A + k0*2, lda);
      _tile_loadd(6, wk, ldb);
      _tile_loadd(7, wk + 64, ldb);
      _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
      _tile_loadd(5, A + 16*lda + k0*2, lda);
      _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
    }
    if (mode==0){
    _tile_stored(0,C,128);_tile_stored(1,C+16,128);_tile_stored(2,C+512,128);_tile_stored(3,C+528,128);}
  }
  double t=now()-t0;
  long dps = reps*(K/32)*4;
  printf("mode %d: %.2f ns per dp (%.0f GFLOP/s)\n", mode, t/dps*1e9, dps*16384.0/t/1e9);
}
