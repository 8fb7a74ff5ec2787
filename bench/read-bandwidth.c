/* How fast this machine reads memory: the ceiling of a memory-bound decode.
 *
 * usage: cc -O2 -march=native -pthread bench/read-bandwidth.c -o /tmp/read-bandwidth
 *        /tmp/read-bandwidth [MiB] [threads]      (default 1024 MiB, 1 and 2 threads)
 *
 * Each thread reads its share of a buffer (filled first, so every page is
 * backed) as four sequential streams a quarter of the share apart, the way
 * ds4's decode tiles walk a matrix, five times; prints the best of three
 * timings in GB/s (10^9 bytes/s). A buffer well past the L3 measures DRAM: a
 * decode whose weights and K/V are that size cannot read faster. Against
 * llama.cpp, tokens/s ≤ GB/s / (bytes read per token); e.g. SmolLM2 Q4_1 at
 * 6144 tokens of f16 K/V reads about 237.6 MB per token (#21). */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { PASSES = 5, STREAMS = 4 };

static size_t buf_bytes;
static int n_threads;
static const uint64_t *buf;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One cache line as one vector (GCC/Clang vector extension: one 512-bit
 * register with AVX-512, two 256-bit ones with AVX2). */
typedef uint64_t line __attribute__((vector_size(64)));

static void *read_share(void *arg) {
    size_t id = (size_t)arg, lines = buf_bytes / sizeof(line) / n_threads;
    const line *p = (const line *)buf + id * lines;
    size_t stream = lines / STREAMS;
    line sum[STREAMS] = {{0}};
    for (int pass = 0; pass < PASSES; pass++)
        for (size_t i = 0; i < stream; i++)
            for (int s = 0; s < STREAMS; s++)
                sum[s] += p[s * stream + i];
    uint64_t total = 0;
    for (int s = 0; s < STREAMS; s++)
        for (int k = 0; k < 8; k++)
            total += sum[s][k];
    return (void *)(uintptr_t)total; /* keeps the reads */
}

static double measure(void) {
    double best = 0;
    for (int round = 0; round < 3; round++) {
        pthread_t th[64];
        double t0 = now();
        for (int i = 0; i < n_threads; i++)
            pthread_create(&th[i], NULL, read_share, (void *)(uintptr_t)i);
        for (int i = 0; i < n_threads; i++)
            pthread_join(th[i], NULL);
        double gbs = (double)PASSES * buf_bytes / (now() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    return best;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    int only = argc > 2 ? atoi(argv[2]) : 0;
    if (mib == 0 || only < 0 || only > 64) {
        fprintf(stderr, "usage: %s [MiB > 0] [threads 1..64]\n", argv[0]);
        return 2;
    }
    buf_bytes = mib << 20;
    uint64_t *b = aligned_alloc(4096, buf_bytes);
    if (!b) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
    memset(b, 1, buf_bytes);
    buf = b;
    for (int t = only ? only : 1; t <= (only ? only : 2); t++) {
        n_threads = t;
        printf("%zu MiB, %d thread%s: %.1f GB/s\n", mib, t, t > 1 ? "s" : "", measure());
    }
    free(b);
    return 0;
}
