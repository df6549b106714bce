/* Widen the window of the data race in torch's ProcessGroupGloo::runLoop (see
 * docs/gloo_heap_race_upstream.md): sleep before each small memcpy that runLoop itself makes,
 * i.e. the copy of a completed op's name into the shared pgStatus_->lastCompletedWorkName.
 * Nothing else changes, so a crash under this preload is the race, only made likely.
 *
 * Build: cc -O2 -shared -fPIC -o widen_race.so widen_race.c -ldl
 * Use:   LD_PRELOAD=./widen_race.so python ...   (WIDEN_RACE_NS: the sleep, default 200000)
 *
 * runLoop's address range is looked up when a thread is created (gloo starts its workers in
 * the process group's constructor, so libtorch_cpu is loaded by then), never on memcpy's path.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uintptr_t lo, hi;
static long sleep_ns = 200000;
static void *(*real_memcpy)(void *, const void *, size_t);
static int (*real_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static void find_runloop(void) {
    void *lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) return;
    void *f = dlsym(lib, "_ZN4c10d16ProcessGroupGloo7runLoopEi");
    Dl_info info;
    const ElfW(Sym) *sym = NULL;
    if (f && dladdr1(f, &info, (void **)&sym, RTLD_DL_SYMENT) && sym) {
        const char *env = getenv("WIDEN_RACE_NS");
        if (env) sleep_ns = atol(env);
        hi = (uintptr_t)f + sym->st_size;
        lo = (uintptr_t)f;
    }
}

int pthread_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg) {
    if (!real_create) real_create = dlsym(RTLD_NEXT, "pthread_create");
    if (!lo) find_runloop();
    return real_create(t, a, fn, arg);
}

void *memcpy(void *dst, const void *src, size_t n) {
    uintptr_t ra = (uintptr_t)__builtin_return_address(0);
    if (lo && ra >= lo && ra < hi && n <= 32) {
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
    }
    if (!real_memcpy) {
        real_memcpy = dlsym(RTLD_NEXT, "memcpy");
        if (!real_memcpy) { /* only while dlsym itself copies: byte by byte */
            volatile char *d = dst;
            for (size_t i = 0; i < n; i++) d[i] = ((const char *)src)[i];
            return dst;
        }
    }
    return real_memcpy(dst, src, n);
}
