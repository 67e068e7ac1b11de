// The cores' clock under load, for issue 40 (is the lane's 15-thread limit the clock, the memory or the kernel?).
// T threads, thread i pinned to CPU i, each runs a chain of dependent integer adds (one per cycle on any x86 core)
// and then 10 independent chains of AVX-512 FMAs; prints each load's effective GHz per thread: the adds'
// rate is the clock itself, the FMAs' rate is 2 per cycle on a core with two FMA ports at full vector width.
// Build and run: gcc -O2 -pthread -mavx512f -o /tmp/clock_probe tests/gpu/clock_probe.c && /tmp/clock_probe 1 8 15
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    int cpu;
    double add_ghz, fma_per_ns;
    pthread_barrier_t* bar;
} Arg;

static void* run(void* p) {
    Arg* a = p;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(a->cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    pthread_barrier_wait(a->bar);
    const long n = 400000000;
    long x = a->cpu;
    double t0 = now();
    for (long i = 0; i < n; ++i) __asm__ volatile("add $1, %0" : "+r"(x));
    a->add_ghz = n / (now() - t0) / 1e9;
    pthread_barrier_wait(a->bar);
    // 10 independent chains (more than FMA latency x ports), in registers.
    __m512 v0 = _mm512_set1_ps(1.0f), v1 = v0, v2 = v0, v3 = v0, v4 = v0, v5 = v0, v6 = v0, v7 = v0, v8 = v0, v9 = v0;
    const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
    const long m_iter = 40000000;
    t0 = now();
    for (long i = 0; i < m_iter; ++i) {
#define F(v) v = _mm512_fmadd_ps(v, m, c)
        F(v0); F(v1); F(v2); F(v3); F(v4); F(v5); F(v6); F(v7); F(v8); F(v9);
        __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5), "+v"(v6), "+v"(v7),
                         "+v"(v8), "+v"(v9));
    }
    a->fma_per_ns = m_iter * 10.0 / (now() - t0) / 1e9;
    const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3)),
                                   _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v4, v5), _mm512_add_ps(v6, v7)),
                                                 _mm512_add_ps(v8, v9)));
    return _mm512_reduce_add_ps(s) == 12345.0f ? p : NULL;
}

int main(int argc, char** argv) {
    for (int k = 1; k < argc; ++k) {
        int t = atoi(argv[k]);
        pthread_t th[256];
        Arg a[256];
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, t);
        for (int i = 0; i < t; ++i) {
            a[i].cpu = i;
            a[i].bar = &bar;
            pthread_create(&th[i], NULL, run, &a[i]);
        }
        double add_min = 1e9, add_sum = 0, fma_min = 1e9, fma_sum = 0;
        for (int i = 0; i < t; ++i) {
            pthread_join(th[i], NULL);
            add_sum += a[i].add_ghz;
            fma_sum += a[i].fma_per_ns;
            add_min = a[i].add_ghz < add_min ? a[i].add_ghz : add_min;
            fma_min = a[i].fma_per_ns < fma_min ? a[i].fma_per_ns : fma_min;
        }
        printf("%3d threads: integer adds %.2f GHz a thread (slowest %.2f); AVX-512 FMAs %.2f per ns a thread "
               "(slowest %.2f)\n", t, add_sum / t, add_min, fma_sum / t, fma_min);
        pthread_barrier_destroy(&bar);
    }
    return 0;
}
