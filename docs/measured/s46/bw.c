#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  size_t sizes[]={4<<20,16<<20,64<<20,128<<20,270<<20,1024<<20};
  for(int si=0;si<6;si++){size_t n=sizes[si];
    char*b=aligned_alloc(2<<20,n);memset(b,1,n);
    double best=1e9;
    for(int rep=0;rep<(n<(300<<20)?20:5);rep++){
      double t=now();
      #pragma omp parallel
      { __m512i x=_mm512_setzero_si512(); int nt=omp_get_num_threads(),id=omp_get_thread_num();
        size_t per=n/nt; const char*p=b+per*id;
        for(size_t o=0;o<per;o+=256){x=_mm512_or_si512(x,_mm512_load_si512(p+o));x=_mm512_or_si512(x,_mm512_load_si512(p+o+64));x=_mm512_or_si512(x,_mm512_load_si512(p+o+128));x=_mm512_or_si512(x,_mm512_load_si512(p+o+192));}
        asm volatile(""::"v"(x));}
      t=now()-t;if(t<best)best=t;}
    printf("%5zu MB: %.1f GB/s\n",n>>20,n/best/1e9);free(b);}
}
