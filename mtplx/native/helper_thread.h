/* A kernel's one helper thread, started once per process: shared by small_gemm.c and draft_step.c.
   `state` is 0 before the first start, 1 once the thread runs, -1 if it could not start (the kernel
   then computes alone); the thread is detached, and a forked child forgets it (`forget`) and starts
   its own when it first needs one. */
#ifndef MTPLX_HELPER_THREAD_H
#define MTPLX_HELPER_THREAD_H
#include <pthread.h>
#include <stdatomic.h>

static inline int start_helper_thread(atomic_int *state, void *(*main_fn)(void *), void (*forget)(void)) {
    int now = atomic_load(state);
    if (now != 0)
        return now > 0;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&t, &attr, main_fn, NULL) == 0;
    pthread_attr_destroy(&attr);
    if (ok)
        pthread_atfork(NULL, NULL, forget);
    atomic_store(state, ok ? 1 : -1);
    return ok;
}
#endif
