/*
 * A fake CUDA driver (-DFAKE_CUDA -> libcuda.so.1) and a fake NCCL
 * (-DFAKE_NCCL -> libnccl.so.2) for the tests (compiled at test time by the
 * test kit's `fake_nccl` module, used by multiworld-nccl's tests/simulated.rs,
 * the facade's NCCL-world tests and the examples' tests): just enough of both
 * C APIs, with "device memory" in host memory, to drive multiworld-nccl's
 * state machine (non-blocking init, async errors, events, deadlines, abort,
 * quarantine, teardown) on machines without a GPU. It also checks what the
 * crate passes: the ncclConfig_t prefix (NCCL 2.18 layout), the unique id
 * passed by value, enum ranges, roots and peers.
 *
 * Both libraries share `struct fake_stream`: the NCCL fake marks the stream
 * of a never-completing operation as hung, and the driver fake's events on
 * that stream then stay "not ready" until an abort clears it.
 *
 * Test control functions are prefixed fake_; the test kit resolves them with
 * dlsym. All state is global: the tests that use it run one at a time.
 */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct fake_stream { volatile int hung; int magic; };
#define STREAM_MAGIC 0x5717ea11

#ifdef FAKE_CUDA
/* ---------------------------------------------------------------- CUDA */
typedef int CUresult;
struct fake_event { struct fake_stream *stream; int blocked; };

static int g_devices = 1;
static volatile long g_allocs, g_streams, g_events, g_ctx_refs, g_pools, g_pinned;
static int g_no_pinned, g_copies_hang, g_no_set_current, g_event_query_rc;

void fake_cuda_reset(int devices) {
  g_devices = devices; g_no_pinned = 0; g_copies_hang = 0; g_no_set_current = 0;
  g_event_query_rc = 0;
}
/* While nonzero, cuEventQuery returns this code (an error querying an
   operation's end). */
void fake_cuda_event_query_fails(int rc) { g_event_query_rc = rc; }
/* Makes cuCtxSetCurrent fail (a context that cannot be made current). */
void fake_cuda_no_set_current(int on) { g_no_set_current = on; }
/* Makes cuMemHostAlloc fail (the crate must fall back to pageable staging). */
void fake_cuda_no_pinned(int on) { g_no_pinned = on; }
/* While on, a host copy leaves its stream hung (it never completes). */
void fake_cuda_copies_hang(int on) { g_copies_hang = on; }
long fake_cuda_live(int what) {
  switch (what) {
    case 0: return g_allocs;
    case 1: return g_streams;
    case 2: return g_events;
    case 3: return g_ctx_refs;
    case 4: return g_pools;
    case 5: return g_pinned;
  }
  return -1;
}

CUresult cuInit(unsigned flags) { (void)flags; return g_devices == 0 ? 100 : 0; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = g_devices; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
  if (ordinal < 0 || ordinal >= g_devices) return 101; /* invalid device */
  *d = ordinal; return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
  *ctx = (void *)(uintptr_t)(0x1000 + dev);
  __sync_fetch_and_add(&g_ctx_refs, 1); return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; __sync_fetch_and_sub(&g_ctx_refs, 1); return 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx && !g_no_set_current ? 0 : 201; }
CUresult cuStreamCreate(struct fake_stream **s, unsigned flags) {
  if (flags != 1) return 1; /* we expect CU_STREAM_NON_BLOCKING */
  *s = calloc(1, sizeof **s); (*s)->magic = STREAM_MAGIC;
  __sync_fetch_and_add(&g_streams, 1); return 0;
}
CUresult cuStreamDestroy_v2(struct fake_stream *s) {
  if (!s || s->magic != STREAM_MAGIC) return 400;
  s->magic = 0; free(s); __sync_fetch_and_sub(&g_streams, 1); return 0;
}
CUresult cuEventCreate(struct fake_event **e, unsigned flags) {
  (void)flags; *e = calloc(1, sizeof **e); __sync_fetch_and_add(&g_events, 1); return 0;
}
/* A NULL stream is the legacy default stream (never hung here). */
CUresult cuEventRecord(struct fake_event *e, struct fake_stream *s) {
  if (s && s->magic != STREAM_MAGIC) return 400;
  e->stream = s; e->blocked = s ? s->hung : 0; return 0;
}
/* Work is done in order here: nothing to wait for. */
CUresult cuStreamWaitEvent(struct fake_stream *s, struct fake_event *e, unsigned flags) {
  (void)flags;
  if (s && s->magic != STREAM_MAGIC) return 400;
  return e ? 0 : 400;
}
CUresult cuEventQuery(struct fake_event *e) {
  if (g_event_query_rc) return g_event_query_rc;
  return (e->blocked && e->stream && e->stream->hung) ? 600 : 0;
}
CUresult cuEventDestroy_v2(struct fake_event *e) { free(e); __sync_fetch_and_sub(&g_events, 1); return 0; }
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, struct fake_stream *s) {
  if (g_copies_hang && s) { s->hung = 1; return 0; }
  memcpy((void *)(uintptr_t)dst, src, n); return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, struct fake_stream *s) {
  if (g_copies_hang && s) { s->hung = 1; return 0; }
  memcpy(dst, (const void *)(uintptr_t)src, n); return 0;
}
CUresult cuMemsetD8Async(unsigned long long dst, unsigned char v, size_t n, struct fake_stream *s) {
  (void)s; memset((void *)(uintptr_t)dst, v, n); return 0;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
  (void)flags;
  if (g_no_pinned) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
  *p = malloc(n);
  if (!*p) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
  __sync_fetch_and_add(&g_pinned, 1); return 0;
}
CUresult cuMemFreeHost(void *p) { free(p); __sync_fetch_and_sub(&g_pinned, 1); return 0; }
CUresult cuGetErrorString(CUresult r, const char **s) { (void)r; *s = "fake CUDA error"; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_FAKE"; return 0; }

struct pool_props { int alloc_type, handle_types, loc_type, loc_id; void *win32; size_t max_size;
                    unsigned short usage; unsigned char reserved[54]; };
CUresult cuMemPoolCreate(void **pool, const struct pool_props *p) {
  if (p->alloc_type != 1 || p->loc_type != 1 || p->loc_id < 0 || p->loc_id >= g_devices) return 1;
  for (int i = 0; i < 54; i++) if (p->reserved[i]) return 1;
  *pool = (void *)0x9000; __sync_fetch_and_add(&g_pools, 1); return 0;
}
CUresult cuMemPoolDestroy(void *pool) { (void)pool; __sync_fetch_and_sub(&g_pools, 1); return 0; }
CUresult cuMemAllocFromPoolAsync(unsigned long long *p, size_t n, void *pool, struct fake_stream *s) {
  if (!pool || !s || s->magic != STREAM_MAGIC || n == 0) return 1;
  void *m = malloc(n);
  if (!m) return 2; /* CUDA_ERROR_OUT_OF_MEMORY, as the real driver says */
  *p = (unsigned long long)(uintptr_t)m; __sync_fetch_and_add(&g_allocs, 1); return 0;
}
CUresult cuMemFreeAsync(unsigned long long p, struct fake_stream *s) {
  (void)s; free((void *)(uintptr_t)p); __sync_fetch_and_sub(&g_allocs, 1); return 0;
}
#endif /* FAKE_CUDA */

#ifdef FAKE_NCCL
/* ---------------------------------------------------------------- NCCL */
typedef int ncclResult_t;
enum { OK = 0, INVALID_ARGUMENT = 4, INVALID_USAGE = 5, REMOTE_ERROR = 6, IN_PROGRESS = 7 };
typedef struct { char internal[128]; } ncclUniqueId;
/* The NCCL 2.18 ncclConfig_t prefix. */
typedef struct { size_t size; unsigned magic, version; int blocking, cga, min_ctas, max_ctas;
                 const char *net_name; int split_share; } ncclConfig_t;

struct fake_comm {
  int nranks, rank, polls_left, async_error, aborted;
  struct fake_stream *hung_stream;
  /* A slow enqueue (fake_nccl_stall_last): each collective call sleeps
   * stall_ms, then returns ncclInProgress for stall_polls queries. */
  int stall_polls, stall_ms;
};

static int g_version = 22703; /* 2.27.3 */
static int g_init_hang, g_ops_hang, g_abort_hang, g_init_polls = 3, g_noop;
/* How long ncclGetUniqueId takes (NCCL's first call initialises it: a
 * socket, a thread), set by fake_nccl_slow_unique_id. */
static int g_uid_ms;
static volatile long g_comms;
static struct fake_comm *g_last;
static __thread int t_group_depth;
static __thread struct { int is_send; char *ptr; size_t bytes; int peer; struct fake_comm *c;
                         struct fake_stream *s; } t_p2p[64];
static __thread int t_p2p_n;

void fake_nccl_reset(int version) {
  g_version = version; g_init_hang = g_ops_hang = g_abort_hang = g_noop = 0; g_init_polls = 3; g_last = NULL;
  g_uid_ms = 0;
}
/* Makes every later ncclGetUniqueId sleep `ms` first (0: off). */
void fake_nccl_slow_unique_id(int ms) { g_uid_ms = ms; }
/* A broken NCCL for testing the tests: operations complete but move no data
 * (so a check that cannot tell a result from its untouched buffer passes).
 * Also on when the environment has FAKE_NCCL_NOOP=1. */
void fake_nccl_noop(int on) { g_noop = on; }
static int noop(void) {
  const char *e = getenv("FAKE_NCCL_NOOP");
  return g_noop || (e && strcmp(e, "1") == 0);
}
void fake_nccl_set(int init_hang, int ops_hang, int abort_hang) {
  g_init_hang = init_hang; g_ops_hang = ops_hang; g_abort_hang = abort_hang;
}
/* Makes every later collective enqueued on the most recently created
 * communicator slow: the call itself sleeps `sleep_ms` (an enqueue that
 * blocks inside NCCL), then returns ncclInProgress, and
 * ncclCommGetAsyncError keeps answering ncclInProgress for `polls` queries
 * (INT_MAX: forever, so the caller's deadline must end it). The data is
 * moved as usual. (0, 0) turns it off. */
void fake_nccl_stall_last(int polls, int sleep_ms) {
  if (g_last) { g_last->stall_polls = polls; g_last->stall_ms = sleep_ms; }
}
/* Lets the hung operations of the most recently created communicator
 * complete (a hung kernel that finished late; it moved no data). */
void fake_nccl_release_last(void) {
  if (g_last && g_last->hung_stream) g_last->hung_stream->hung = 0;
}
/* Injects an asynchronous error into the most recently created communicator. */
void fake_nccl_fail_last(int code) { if (g_last) g_last->async_error = code; }
long fake_nccl_live(void) { return g_comms; }

static size_t type_size(int t) {
  static const size_t sz[12] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
  return (t >= 0 && t < 12) ? sz[t] : 0;
}
static int bad_stream(struct fake_stream *s) { return !s || s->magic != STREAM_MAGIC; }
/* Collectives of a multi-rank fake (there are no peers), or any operation
 * while ops_hang is set, never complete. */
static ncclResult_t finish(struct fake_comm *c, struct fake_stream *s, void *dst, const void *src, size_t bytes) {
  if (g_ops_hang || c->nranks > 1) { s->hung = 1; c->hung_stream = s; return OK; }
  if (dst && src && dst != src && !noop()) memmove(dst, src, bytes);
  return OK;
}
/* A collective's enqueue, slowed down as fake_nccl_stall_last asked. */
static ncclResult_t enqueue(struct fake_comm *c, struct fake_stream *s, void *dst, const void *src, size_t bytes) {
  ncclResult_t r = finish(c, s, dst, src, bytes);
  if (r != OK) return r;
  if (c->stall_ms > 0) usleep((useconds_t)c->stall_ms * 1000);
  if (c->stall_polls > 0) { c->polls_left = c->stall_polls; return IN_PROGRESS; }
  return OK;
}

ncclResult_t ncclGetVersion(int *v) { *v = g_version; return OK; }
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (g_uid_ms > 0) usleep((useconds_t)g_uid_ms * 1000);
  for (int i = 0; i < 128; i++) id->internal[i] = (char)(0x40 + i % 16);
  return OK;
}
ncclResult_t ncclCommInitRankConfig(struct fake_comm **out, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
  for (int i = 0; i < 128; i++) if (id.internal[i] != (char)(0x40 + i % 16)) return INVALID_ARGUMENT;
  if (!cfg || cfg->magic != 0xcafebeef || cfg->size != 48 || cfg->version != 21800) return INVALID_ARGUMENT;
  if (cfg->blocking != 0) return INVALID_USAGE; /* the crate must ask for non-blocking */
  if (cfg->cga != INT_MIN || cfg->min_ctas != INT_MIN || cfg->max_ctas != INT_MIN || cfg->net_name
      || cfg->split_share != INT_MIN || ((const int *)cfg)[11] != INT_MIN) return INVALID_ARGUMENT;
  if (nranks < 1 || rank < 0 || rank >= nranks) return INVALID_ARGUMENT;
  struct fake_comm *c = calloc(1, sizeof *c);
  c->nranks = nranks; c->rank = rank;
  c->polls_left = g_init_hang ? INT_MAX : g_init_polls;
  *out = c; g_last = c; __sync_fetch_and_add(&g_comms, 1);
  return IN_PROGRESS;
}
ncclResult_t ncclCommGetAsyncError(struct fake_comm *c, ncclResult_t *st) {
  if (!c || c->aborted) return INVALID_ARGUMENT;
  if (c->polls_left > 0) { if (c->polls_left != INT_MAX) c->polls_left--; *st = IN_PROGRESS; return OK; }
  *st = c->async_error; return OK;
}
ncclResult_t ncclCommAbort(struct fake_comm *c) {
  if (!c) return OK;
  if (g_abort_hang) for (;;) pause(); /* "abort itself can hang" */
  if (c->hung_stream) c->hung_stream->hung = 0;
  c->aborted = 1; free(c); __sync_fetch_and_sub(&g_comms, 1); return OK;
}
ncclResult_t ncclCommFinalize(struct fake_comm *c) { c->polls_left = 2; return IN_PROGRESS; }
ncclResult_t ncclCommDestroy(struct fake_comm *c) {
  if (c->polls_left > 0) return INVALID_USAGE;
  free(c); __sync_fetch_and_sub(&g_comms, 1); return OK;
}
const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) { case OK: return "no error"; case INVALID_ARGUMENT: return "invalid argument";
               case REMOTE_ERROR: return "remote process exited or there was a network error";
               default: return "fake NCCL error"; }
}
const char *ncclGetLastError(struct fake_comm *c) { (void)c; return "fake last error"; }

ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int t, int op, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t) || op < 0 || op > 4 || !s || !r) return INVALID_ARGUMENT;
  return enqueue(c, st, r, s, n * type_size(t));
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int t, int root, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t) || root < 0 || root >= c->nranks) return INVALID_ARGUMENT;
  return enqueue(c, st, r, s, n * type_size(t));
}
ncclResult_t ncclReduce(const void *s, void *r, size_t n, int t, int op, int root, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t) || op < 0 || op > 4 || root < 0 || root >= c->nranks) return INVALID_ARGUMENT;
  return enqueue(c, st, r, s, n * type_size(t));
}
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int t, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t)) return INVALID_ARGUMENT;
  return enqueue(c, st, r, s, n * type_size(t));
}
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t) || op < 0 || op > 4) return INVALID_ARGUMENT;
  return enqueue(c, st, r, s, n * type_size(t));
}
static ncclResult_t p2p(int is_send, void *ptr, size_t n, int t, int peer, struct fake_comm *c, struct fake_stream *st) {
  if (!c || bad_stream(st) || !type_size(t) || peer < 0 || peer >= c->nranks || t_p2p_n >= 64) return INVALID_ARGUMENT;
  t_p2p[t_p2p_n].is_send = is_send; t_p2p[t_p2p_n].ptr = ptr; t_p2p[t_p2p_n].bytes = n * type_size(t);
  t_p2p[t_p2p_n].peer = peer; t_p2p[t_p2p_n].c = c; t_p2p[t_p2p_n].s = st; t_p2p_n++;
  return OK;
}
static ncclResult_t run_p2p(void) {
  /* Pair each send to self with the next unmatched receive from self. */
  int used[64] = {0};
  for (int i = 0; i < t_p2p_n; i++) {
    if (!t_p2p[i].is_send) continue;
    int matched = 0;
    for (int j = 0; j < t_p2p_n && !matched; j++) {
      if (t_p2p[j].is_send || used[j] || t_p2p[i].peer != t_p2p[i].c->rank || t_p2p[j].peer != t_p2p[j].c->rank) continue;
      if (t_p2p[j].bytes != t_p2p[i].bytes) return INVALID_USAGE;
      used[j] = matched = 1; used[i] = 1;
      finish(t_p2p[i].c, t_p2p[i].s, t_p2p[j].ptr, t_p2p[i].ptr, t_p2p[i].bytes);
    }
  }
  for (int i = 0; i < t_p2p_n; i++)
    if (!used[i]) { t_p2p[i].s->hung = 1; t_p2p[i].c->hung_stream = t_p2p[i].s; } /* waits forever */
  t_p2p_n = 0;
  return OK;
}
ncclResult_t ncclGroupStart(void) { t_group_depth++; return OK; }
ncclResult_t ncclGroupEnd(void) {
  if (t_group_depth <= 0) return INVALID_USAGE;
  if (--t_group_depth == 0) return run_p2p();
  return OK;
}
ncclResult_t ncclSend(const void *s, size_t n, int t, int peer, struct fake_comm *c, struct fake_stream *st) {
  ncclResult_t r = p2p(1, (void *)s, n, t, peer, c, st);
  return (r == OK && t_group_depth == 0) ? run_p2p() : r;
}
ncclResult_t ncclRecv(void *p, size_t n, int t, int peer, struct fake_comm *c, struct fake_stream *st) {
  ncclResult_t r = p2p(0, p, n, t, peer, c, st);
  return (r == OK && t_group_depth == 0) ? run_p2p() : r;
}
ncclResult_t ncclCommRevoke(struct fake_comm *c, int flags) {
  if (flags != 0) return INVALID_ARGUMENT;
  if (c->hung_stream) c->hung_stream->hung = 0;
  c->polls_left = 2; return IN_PROGRESS;
}
ncclResult_t ncclCommShrink(struct fake_comm *c, int *excl, int n, struct fake_comm **out, ncclConfig_t *cfg, int flags) {
  if (cfg != NULL || flags < 0 || flags > 1 || n < 0 || n >= c->nranks) return INVALID_ARGUMENT;
  int below = 0;
  for (int i = 0; i < n; i++) { if (excl[i] < 0 || excl[i] >= c->nranks || excl[i] == c->rank) return INVALID_ARGUMENT;
                                if (excl[i] < c->rank) below++; }
  struct fake_comm *k = calloc(1, sizeof *k);
  k->nranks = c->nranks - n; k->rank = c->rank - below; k->polls_left = 2;
  if (flags == 1 && c->hung_stream) c->hung_stream->hung = 0;
  *out = k; g_last = k; __sync_fetch_and_add(&g_comms, 1);
  return IN_PROGRESS;
}
#endif /* FAKE_NCCL */
