// heapcheck.so: an LD_PRELOAD library that makes native heap corruption show at (or near) its
// culprit, for the multi-process tests (environment variables reach every rank through the
// forkserver). Build and use: scripts/heapcheck/run.sh (see there).
//
// * Quarantine (always on): free() of a chunk of at most QFREE_MAX usable bytes (default 2048)
//   fills it with 0xA5 and keeps it in a ring of 2^18 chunks instead of freeing it; when it
//   leaves the ring every byte is checked. A changed byte is a write after free, reported as
//   "[qfree ...] WRITE AFTER FREE" with the chunk's size, the bytes written (also as fp32) and,
//   with QFREE_BT=1, the C stack that freed it. A free of a chunk still in the ring is reported
//   as "[qfree ...] DOUBLE FREE" with both stacks (either thread's).
// * Fence (QFENCE=1): posix_memalign of at most 4096 bytes (c10's CPU allocator, i.e. every
//   small tensor storage) gets a page of its own; free() makes the page inaccessible and keeps
//   it so for the next 2^14 such frees, so any later read or write of the storage, by any
//   thread, faults where it happens: "[qfence ...] SIGSEGV ... in tid N" and that thread's C
//   stack (after faulthandler's Python stacks).
// Reports go to stderr (the rank logs). Up to 20 of each kind per process.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <signal.h>
#include <errno.h>
#include <ucontext.h>

extern void __libc_free(void *);
#define RING (1 << 18)
#define DEPTH 20
#define PAT 0xA5
static size_t maxsz = 2048;
static int use_bt = 0;
typedef struct { void *p; size_t n; int nbt; pid_t tid; void *bt[DEPTH]; } slot_t;
static slot_t ring[RING];
static unsigned long head = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int in_hook = 0;
static int reports = 0;
static int dreports = 0;

static int ef_on;
static struct sigaction ef_prev;
static void ef_segv(int, siginfo_t *, void *);
__attribute__((constructor)) static void init(void) {
  const char *s = getenv("QFREE_BT"); use_bt = s && *s == '1';
  s = getenv("QFREE_MAX"); if (s) maxsz = strtoul(s, 0, 10);
  void *tmp[4]; in_hook = 1; backtrace(tmp, 4); in_hook = 0;
  s = getenv("QFENCE"); ef_on = s && *s == '1';
  if (ef_on) { struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_sigaction = ef_segv; sa.sa_flags = SA_SIGINFO | SA_ONSTACK; sigaction(SIGSEGV, &sa, &ef_prev); }
}

static void check(slot_t *e) {
  unsigned char *c = e->p; size_t first = (size_t)-1, cnt = 0, last = 0;
  for (size_t i = 0; i < e->n; i++) if (c[i] != PAT) { if (first == (size_t)-1) first = i; cnt++; last = i; }
  if (!cnt || reports >= 20) return;
  reports++;
  char buf[1024]; int k = snprintf(buf, sizeof buf,
      "\n[qfree pid %d] WRITE AFTER FREE: chunk %p usable %zu freed by tid %d: %zu bytes changed, offsets %zu..%zu; bytes:",
      getpid(), e->p, e->n, e->tid, cnt, first, last);
  for (size_t i = first & ~(size_t)15; i <= last && i < first + 96 && k < 900; i++) k += snprintf(buf + k, sizeof buf - k, "%s%02x", (i % 4) ? "" : " ", c[i]);
  k += snprintf(buf + k, sizeof buf - k, "\n as f32:");
  for (size_t i = first & ~(size_t)3; i + 4 <= e->n && i <= last && i < first + 64 && k < 1000; i += 4) { float f; memcpy(&f, c + i, 4); k += snprintf(buf + k, sizeof buf - k, " %g", f); }
  k += snprintf(buf + k, sizeof buf - k, "\n freed at:\n");
  write(2, buf, k);
  if (e->nbt) backtrace_symbols_fd(e->bt, e->nbt, 2);
}


// ---- electric fence for small posix_memalign allocations (CPU tensor storages) ----
#define EF_MAX 4096
#define EF_HASH (1 << 17)
#define EF_QRING (1 << 14)
static void *ef_tab[EF_HASH];       // live fenced pointers (open addressing; (void*)1 = tombstone)
static void *ef_q[EF_QRING];        // freed fenced pages, PROT_NONE, unmapped when evicted
static unsigned long ef_qhead = 0;
static pthread_mutex_t ef_mu = PTHREAD_MUTEX_INITIALIZER;
static inline unsigned long ef_h(void *p) { return (((uintptr_t)p >> 12) * 0x9E3779B97F4A7C15ull) >> (64 - 17); }
static int ef_insert(void *p) {
  unsigned long h = ef_h(p);
  for (unsigned long i = 0; i < EF_HASH; i++) {
    unsigned long k = (h + i) & (EF_HASH - 1);
    if (ef_tab[k] == 0 || ef_tab[k] == (void *)1) { ef_tab[k] = p; return 1; }
  }
  return 0;
}
static int ef_remove(void *p) {
  unsigned long h = ef_h(p);
  for (unsigned long i = 0; i < EF_HASH; i++) {
    unsigned long k = (h + i) & (EF_HASH - 1);
    if (ef_tab[k] == p) { ef_tab[k] = (void *)1; return 1; }
    if (ef_tab[k] == 0) return 0;
  }
  return 0;
}
extern int __posix_memalign(void **, size_t, size_t) __attribute__((weak));
static int (*real_pm)(void **, size_t, size_t) = 0;
int posix_memalign(void **out, size_t align, size_t size) {
  if (!real_pm) { real_pm = dlsym(RTLD_NEXT, "posix_memalign"); }
  if (!ef_on || in_hook || size == 0 || size > EF_MAX || align > 4096) return real_pm(out, align, size);
  void *p = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return real_pm(out, align, size);
  pthread_mutex_lock(&ef_mu);
  int ok = ef_insert(p);
  pthread_mutex_unlock(&ef_mu);
  if (!ok) { munmap(p, 4096); return real_pm(out, align, size); }
  *out = p;
  return 0;
}
static int ef_free(void *p) {
  if (((uintptr_t)p & 4095) != 0) return 0;
  pthread_mutex_lock(&ef_mu);
  int mine = ef_remove(p);
  if (mine) {
    mprotect(p, 4096, PROT_NONE);
    void *old = ef_q[ef_qhead % EF_QRING]; ef_q[ef_qhead++ % EF_QRING] = p;
    if (old) munmap(old, 4096);
  }
  pthread_mutex_unlock(&ef_mu);
  return mine;
}
static int ef_in_quarantine(void *a) {
  void *pg = (void *)((uintptr_t)a & ~(uintptr_t)4095);
  for (unsigned long i = 0; i < EF_QRING; i++) if (ef_q[i] == pg) return 1;
  return 0;
}
static void ef_segv(int sig, siginfo_t *si, void *uc) {
  char buf[256];
  int q = ef_in_quarantine(si->si_addr);
  int k = snprintf(buf, sizeof buf, "\n[qfence pid %d] SIGSEGV at %p in tid %d: %s\n", getpid(), si->si_addr, gettid(),
                   q ? "ACCESS TO A FREED (FENCED) TENSOR STORAGE" : "not a fenced page");
  write(2, buf, k);
  void *bt[48]; int n = backtrace(bt, 48); backtrace_symbols_fd(bt, n, 2);
  signal(SIGSEGV, SIG_DFL); raise(SIGSEGV);
}

void free(void *p) {
  if (!p) return;
  if (ef_on && !in_hook && ef_free(p)) return;
  if (in_hook) { __libc_free(p); return; }
  size_t n = malloc_usable_size(p);
  if (n > maxsz) { __libc_free(p); return; }
  in_hook = 1;
  if (n >= 16) {  // already holds the pattern: freed before? only if it is still quarantined
    const unsigned char *c = p; int all = 1;
    for (int i = 0; i < 16; i++) if (c[i] != PAT) { all = 0; break; }
    if (all) {
      pthread_mutex_lock(&mu);
      long hit = -1;
      for (unsigned long i = 0; i < RING; i++) if (ring[i].p == p) { hit = i; break; }
      if (hit >= 0) {
        slot_t prev = ring[hit];
        pthread_mutex_unlock(&mu);
        if (dreports < 20) {
          dreports++;
          char buf[256]; int k = snprintf(buf, sizeof buf, "\n[qfree pid %d] DOUBLE FREE of %p usable %zu by tid %d; this free at:\n", getpid(), p, n, gettid());
          write(2, buf, k);
          void *bt[DEPTH]; int nb = backtrace(bt, DEPTH); backtrace_symbols_fd(bt, nb, 2);
          k = snprintf(buf, sizeof buf, " earlier free by tid %d at:\n", prev.tid); write(2, buf, k);
          if (prev.nbt) backtrace_symbols_fd(prev.bt, prev.nbt, 2);
        }
        in_hook = 0; return;  // keep it quarantined once
      }
      pthread_mutex_unlock(&mu);
    }
  }
  slot_t e; e.p = p; e.n = n; e.nbt = 0; e.tid = gettid();
  if (use_bt) e.nbt = backtrace(e.bt, DEPTH);
  memset(p, PAT, n);
  pthread_mutex_lock(&mu);
  slot_t *s = &ring[head++ % RING];
  slot_t old = *s; *s = e;
  pthread_mutex_unlock(&mu);
  if (old.p) { check(&old); __libc_free(old.p); }
  in_hook = 0;
}
void cfree(void *p) { free(p); }
