// qcompile's intra-op thread pool for the microkernel dispatches of a batch that runs inline
// (IREE local-sync): the calling thread and H helper threads share one dispatch's workgroups.
//
// A pooled module's kernels get {qk_pool_run, pool} through a small i64 operand and call
// qk_pool_run(pool, n, body, arg); body(arg, i) computes workgroup i. Helpers spin for the
// pool's spin time after each dispatch (the next one usually follows within microseconds: no
// sleep and wake-up per dispatch, which is what IREE's task system pays; nor between the calls
// of a loop, whose gaps are a few hundred microseconds), then sleep on a futex.
//
// Claiming is one compare-and-swap on a 64-bit ticket (generation, front, back): the caller
// takes items from the front, the helpers from the back, until the two meet. A claim takes a
// run of items, 1/(4 T) of those left for T threads (at least one), so a dispatch of n items
// costs O(T log n) claims, not n: each claim, and each count of finished items, moves a cache
// line between cores (about 0.1 us, against 0.3-1 us of work per item in the small layers of
// mobilenet_v2). The runs shrink towards the end, which keeps the threads' finishes close.
// The kernels order their workgroups by pixels (channel blocks fastest), so each thread keeps
// to its own part of the image from layer to layer and mostly reads what it wrote itself, from
// its own cache (a grid run on one thread alone orders a conv's channel blocks slowest instead:
// conv_vnni.c, PAR_IDS_CONV). A helper still leaving dispatch g can never claim an item of
// dispatch g + 1 by mistake: the generation in the ticket must match. The caller returns when
// every item is done.
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_HELPERS 63

typedef void (*qk_body)(void*, int64_t);

static int64_t now_ns(void);

// ---- Events: a sleeper's wake-up (the pool's helpers; the data-parallel shards' hand-offs,
// qcompile/codegen/cpu.py, Shards) ----------------------------------------------------------
// A counter on a cache line of its own: the poster bumps it and wakes its sleepers, if any. A
// waiter reads it, checks whether it still has to wait, and sleeps on a futex for as long as it
// holds the value read (a bump in between returns at once). The shards' waiter spins on it for
// spin_ns first (yielding now and then, in case the thread it waits for shares its CPU): the
// shard threads wait on one for their next shard, the caller on theirs for the results; neither
// sleeps between the calls of a loop, and neither waits for a wake-up.
typedef struct {
  _Alignas(64) _Atomic uint32_t seq;
  _Atomic int sleepers;
} qk_event;

static void event_sleep(qk_event* e, uint32_t w) {
  atomic_fetch_add(&e->sleepers, 1);
  syscall(SYS_futex, &e->seq, FUTEX_WAIT_PRIVATE, w, 0, 0, 0);
  atomic_fetch_sub(&e->sleepers, 1);
}

void qk_event_post(qk_event* e) {
  atomic_fetch_add(&e->seq, 1);      // (sequentially consistent: against the waiter's count)
  if (atomic_load(&e->sleepers) > 0)
    syscall(SYS_futex, &e->seq, FUTEX_WAKE_PRIVATE, MAX_HELPERS, 0, 0, 0);
}

// the count once it differs from `seen`
uint32_t qk_event_wait(qk_event* e, uint32_t seen, int64_t spin_ns) {
  int64_t t0 = now_ns();
  for (int spins = 1;; ++spins) {
    const uint32_t s = atomic_load_explicit(&e->seq, memory_order_acquire);
    if (s != seen) return s;
    __builtin_ia32_pause();
    if ((spins & 63) == 0) sched_yield();
    if ((spins & 255) == 0 && now_ns() - t0 > spin_ns) {
      event_sleep(e, seen);
      t0 = now_ns();
    }
  }
}

typedef struct {
  _Alignas(64) _Atomic uint64_t ticket;   // generation << 48 | front << 24 | back
  _Alignas(64) _Atomic int64_t done;      // items of this generation finished
  _Alignas(64) qk_body fn;                // read by every claim: a line of its own
  void* arg;
  qk_event wake;                          // bumped at each dispatch (and to stop)
  _Atomic int stop;
  _Atomic int busy;                       // a caller is in qk_pool_run
  uint64_t gen;                           // the caller's last generation
  int64_t spin_ns;                        // a helper spins this long after its last item
  int helpers;
  cpu_set_t callers;                      // the CPUs a caller runs on (no helper's)
  cpu_set_t mine;                         // the helpers' CPUs
  pthread_t th[MAX_HELPERS];
} qk_pool;

#define GEN(t) ((t) >> 48)
#define FRONT(t) (((t) >> 24) & 0xFFFFFF)
#define BACK(t) ((t) & 0xFFFFFF)            // one past the last unclaimed item

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// claim and run runs of items of generation `gen` (from the front, or from the back) until
// none is left or the ticket has moved on to another generation
static void work(qk_pool* p, uint64_t gen, int back) {
  const uint64_t share = 4 * (uint64_t)(p->helpers + 1);
  uint64_t t = atomic_load_explicit(&p->ticket, memory_order_acquire);
  for (;;) {
    if (GEN(t) != gen || FRONT(t) >= BACK(t)) return;
    const uint64_t left = BACK(t) - FRONT(t);
    const uint64_t k = left > share ? left / share : 1;
    const uint64_t next = back ? t - k : t + (k << 24);
    if (atomic_compare_exchange_weak_explicit(&p->ticket, &t, next, memory_order_acq_rel,
                                              memory_order_acquire)) {
      // the generation matched: fn and arg are this dispatch's (stored before the ticket)
      const qk_body fn = p->fn;
      void* const arg = p->arg;
      if (back)
        for (int64_t i = (int64_t)BACK(t) - 1; i >= (int64_t)(BACK(t) - k); --i) fn(arg, i);
      else
        for (int64_t i = (int64_t)FRONT(t); i < (int64_t)(FRONT(t) + k); ++i) fn(arg, i);
      atomic_fetch_add_explicit(&p->done, (int64_t)k, memory_order_release);
      t = atomic_load_explicit(&p->ticket, memory_order_acquire);
    }
  }
}

static void* helper(void* arg) {
  qk_pool* p = (qk_pool*)arg;
  uint64_t seen = GEN(atomic_load(&p->ticket));
  for (;;) {
    int64_t t0 = now_ns();
    uint64_t t;
    for (int spins = 0;; ++spins) {
      if (atomic_load_explicit(&p->stop, memory_order_relaxed)) return 0;
      t = atomic_load_explicit(&p->ticket, memory_order_acquire);
      if (GEN(t) != seen) break;
      __builtin_ia32_pause();
      if ((spins & 63) == 63) sched_yield();     // a thread sharing this CPU runs first
      if ((spins & 255) == 255 && now_ns() - t0 > p->spin_ns) {
        const uint32_t w = atomic_load(&p->wake.seq);
        if (GEN(atomic_load(&p->ticket)) == seen && !atomic_load(&p->stop))
          event_sleep(&p->wake, w);
        t0 = now_ns();
      }
    }
    seen = GEN(t);
    work(p, seen, 1);
  }
}

// A pool of `helpers` threads besides the caller (0: every call runs inline) that spin for
// `spin_ns` after their last item before they sleep; NULL on failure.
// Helper i is pinned to the (i + 1)-th CPU this process may use, and a caller found on a
// helper's CPU moves to the others for the dispatch. Left to the scheduler, a helper woken by
// the caller lands on the caller's CPU (wake-affine), and two spinning, cache-hot threads are
// then not migrated apart: both share one CPU, slower than one thread alone.
qk_pool* qk_pool_new(int helpers, int64_t spin_ns) {
  cpu_set_t allowed;
  int cpus[MAX_HELPERS + 1], ncpu = 0;
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0)
    for (int c = 0; c < CPU_SETSIZE && ncpu <= MAX_HELPERS; ++c)
      if (CPU_ISSET(c, &allowed)) cpus[ncpu++] = c;
  if (helpers > ncpu - 1) helpers = ncpu - 1;     // one CPU each, besides the caller's
  if (helpers < 0) helpers = 0;
  qk_pool* p = (qk_pool*)calloc(1, sizeof(qk_pool));
  if (!p) return 0;
  p->spin_ns = spin_ns < 0 ? 0 : spin_ns;
  CPU_ZERO(&p->callers);
  CPU_ZERO(&p->mine);
  for (int i = 0; i < ncpu; ++i) CPU_SET(cpus[i], i <= helpers ? &p->callers : &p->mine);
  for (int i = 0; i < helpers; ++i) {
    pthread_attr_t attr;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[i + 1], &one);
    CPU_CLR(cpus[i + 1], &p->callers);
    CPU_SET(cpus[i + 1], &p->mine);
    pthread_attr_init(&attr);
    pthread_attr_setaffinity_np(&attr, sizeof one, &one);
    const int err = pthread_create(&p->th[i], &attr, helper, p);
    pthread_attr_destroy(&attr);
    if (err != 0) break;
    p->helpers = i + 1;
  }
  return p;
}

void qk_pool_free(qk_pool* p) {
  if (!p) return;
  atomic_store(&p->stop, 1);
  qk_event_post(&p->wake);
  for (int i = 0; i < p->helpers; ++i) pthread_join(p->th[i], 0);
  free(p);
}

int qk_pool_helpers(const qk_pool* p) { return p ? p->helpers : 0; }

// body(arg, i) for i in [0, n), on the caller and the helpers; returns when all are done.
// A second caller while the pool is busy (another thread's dispatch) runs its items itself.
void qk_pool_run(qk_pool* p, int64_t n, qk_body fn, void* arg) {
  if (!p || p->helpers == 0 || n <= 1 || n > 0xFFFFFF || atomic_exchange(&p->busy, 1)) {
    for (int64_t i = 0; i < n; ++i) fn(arg, i);
    return;
  }
  const int cpu = sched_getcpu();
  int moved = 0;
  cpu_set_t before;
  if (cpu >= 0 && CPU_ISSET(cpu, &p->mine) && CPU_COUNT(&p->callers) > 0 &&
      sched_getaffinity(0, sizeof before, &before) == 0)
    moved = sched_setaffinity(0, sizeof p->callers, &p->callers) == 0;
  p->fn = fn;
  p->arg = arg;
  atomic_store_explicit(&p->done, 0, memory_order_relaxed);
  const uint64_t gen = (p->gen + 1) & 0xFFFF;
  p->gen = gen;
  atomic_store(&p->ticket, gen << 48 | (uint64_t)n);
  qk_event_post(&p->wake);
  work(p, gen, 0);
  // a helper still on its last item: yield now and then, in case it waits for this CPU
  for (int spins = 1; atomic_load_explicit(&p->done, memory_order_acquire) < n; ++spins) {
    __builtin_ia32_pause();
    if ((spins & 63) == 0) sched_yield();
  }
  if (moved) sched_setaffinity(0, sizeof before, &before);   // stays put until it sleeps
  atomic_store_explicit(&p->busy, 0, memory_order_release);
}

