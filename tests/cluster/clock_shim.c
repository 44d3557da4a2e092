/* An LD_PRELOAD shim that shifts this process's wall clock (CLOCK_REALTIME, gettimeofday, time)
 * by the number of seconds written in the file named by $KVPS_CLOCK_OFFSET_FILE, re-read at most
 * every 50 ms, so a test can make a running process's wall clock jump. The monotonic clock is
 * left alone, as a real wall-clock step (NTP, a resumed VM, an operator) leaves it.
 * libfaketime does this too, but its sleep interception fails Python's time.sleep (EINVAL). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static volatile double offset_s;
static volatile long long next_read_ns;

static void refresh(void) {
    struct timespec now;
    if (!real_clock_gettime)
        real_clock_gettime = dlsym(RTLD_NEXT, "clock_gettime");
    real_clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    if (ns < next_read_ns)
        return;
    next_read_ns = ns + 50000000LL;
    const char *path = getenv("KVPS_CLOCK_OFFSET_FILE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return;
    double value;
    if (fscanf(f, "%lf", &value) == 1)
        offset_s = value;
    fclose(f);
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + (long long)(offset_s * 1e9);
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    refresh();
    int rc = real_clock_gettime(clock, ts);
    if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
