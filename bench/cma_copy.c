/* What a single copy between two processes costs on this machine, against
 * the copies the shared-memory collectives make (a reference for issue 18's
 * scatter and all-to-all, which copy each byte twice: into the segment and
 * out of it).
 *
 *     cc -O2 -mavx2 -o target/cma_copy bench/cma_copy.c && target/cma_copy [BOUNCE_KIB]
 *
 * A forked child keeps 64 MiB of written memory; the parent, five times:
 *   memcpy      a plain copy of 64 MiB of its own (ordinary stores);
 *   nt          the same with non-temporal stores (what the runtime's large
 *               copies use, `multiworld_collectives::copy_large`);
 *   cma         one process_vm_readv of the child's 64 MiB into its buffer
 *               (the kernel copies with ordinary stores, pinning each page);
 *   cma+nt      process_vm_readv in BOUNCE_KIB pieces (default 256) into a
 *               buffer that stays in the cache, each piece then copied out
 *               with non-temporal stores (one read of the source from
 *               memory and one write, the least a copy can do);
 *   cma 4 MiB   process_vm_readv in 4 MiB pieces.
 * The first round includes the first touch of the child's pages.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* n a multiple of 64, d 32-byte aligned. */
static void nt_copy(char *d, const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
    }
    _mm_sfence();
}

static int readv_from(pid_t pid, char *dst, const char *src, size_t n) {
    struct iovec l = {dst, n}, r = {(void *)src, n};
    return process_vm_readv(pid, &l, 1, &r, 1, 0) == (ssize_t)n ? 0 : -1;
}

int main(int argc, char **argv) {
    const size_t size = (size_t)64 << 20;
    const size_t bounce_len = (argc > 1 ? (size_t)atol(argv[1]) : 256) << 10;
    if (bounce_len == 0 || size % bounce_len != 0 || bounce_len % 64 != 0) {
        fprintf(stderr, "BOUNCE_KIB must divide 65536 and be a multiple of 64 bytes\n");
        return 2;
    }
    char *src = aligned_alloc(4096, size), *dst = aligned_alloc(4096, size);
    char *own = aligned_alloc(4096, size), *bounce = aligned_alloc(4096, bounce_len);
    if (!src || !dst || !own || !bounce) return 1;
    memset(src, 1, size); /* written before the fork: the child's pages hold data */
    int p[2];
    if (pipe(p) != 0) return 1;
    pid_t child = fork();
    if (child == 0) { /* keeps `src` until the parent is done */
        char x;
        close(p[1]);
        (void)!read(p[0], &x, 1);
        _exit(0);
    }
    memset(dst, 0, size);
    memset(own, 2, size);
    int failed = 0;
    for (int round = 0; round < 5; round++) {
        double t = now();
        memcpy(dst, own, size);
        double plain = now() - t;
        t = now();
        nt_copy(dst, own, size);
        double nt = now() - t;
        t = now();
        failed |= readv_from(child, dst, src, size);
        double cma = now() - t;
        t = now();
        for (size_t o = 0; o < size; o += bounce_len) {
            failed |= readv_from(child, bounce, src + o, bounce_len);
            nt_copy(dst + o, bounce, bounce_len);
        }
        double cma_nt = now() - t;
        t = now();
        for (size_t o = 0; o < size; o += (size_t)4 << 20) failed |= readv_from(child, dst + o, src + o, (size_t)4 << 20);
        double cma4 = now() - t;
        printf("64 MiB: memcpy %.2f ms  nt %.2f ms  cma %.2f ms  cma+nt (%zu KiB) %.2f ms  cma 4 MiB %.2f ms\n",
               plain * 1e3, nt * 1e3, cma * 1e3, bounce_len >> 10, cma_nt * 1e3, cma4 * 1e3);
    }
    (void)!write(p[1], "x", 1);
    waitpid(child, NULL, 0);
    if (failed) fprintf(stderr, "process_vm_readv failed (ptrace restrictions?)\n");
    return failed ? 1 : 0;
}
