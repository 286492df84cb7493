/* fake_libcuda.c: a test double of the CUDA driver, built as libcuda.so.1.
 *
 * What it is for: running vtm's CUDA backend (src/vtm/csrc/backend_cuda.cc)
 * on a machine without a GPU, in CI. The tests compile this file into a
 * shared library named libcuda.so.1 and put its folder on LD_LIBRARY_PATH of
 * a child pytest, where vtm's dlopen("libcuda.so.1") finds it. It is our own
 * code, written from the public CUDA driver API reference; cuda.h supplies
 * the types and prototypes, so a signature that differs from the header's is
 * a compile error, and the header's macros give each entry point its
 * versioned symbol (cuMemcpyDtoDAsync is exported as cuMemcpyDtoDAsync_v2),
 * exactly what vtm resolves. It exports the 34 entry points of
 * VTM_CUDA_ENTRY_POINTS and nothing else of the driver, plus the fake_cuda_*
 * control functions below (tests call them through ctypes: the library is
 * loaded in-process, and a second dlopen of the soname returns the same one).
 *
 * The model: device memory is host memory and a device pointer is a host
 * address. cuMemCreate makes a memfd of the allocation's size (its first and
 * last page poisoned, as the driver does not clear memory); cuMemAddressReserve
 * mmaps a PROT_NONE range; cuMemMap maps the memfd there MAP_SHARED|MAP_FIXED,
 * still PROT_NONE, and cuMemSetAccess mprotects it, so a CPU touching a page
 * before access is granted (or after it is unmapped) faults, as a kernel
 * would. A stream is a queue: copies and memsets are checked at their call,
 * queued on their stream, and run (a memmove, a memset) only when a
 * synchronization forces them, in the order the driver promises and no
 * other ("Queued work" below); an event captures a point of a queue.
 *
 * Rules enforced (a call that breaks one fails with the driver's error code,
 * has no effect, and is counted as a violation with a message, so a test can
 * assert that vtm broke none, including in calls whose result vtm ignores):
 *  - nothing works before cuInit(0) or in a child forked after it;
 *  - every call other than init, device, error-name and context calls needs a
 *    current context, which must be the retained primary context (vtm's own
 *    invariant, and the driver's for streams, events, copies and host memory);
 *  - cuMemCreate: pinned device memory on device 0, size a nonzero multiple of
 *    the granularity (2 MiB), flags 0; the device's memory is bounded
 *    (FAKE_CUDA_DEVICE_BYTES, default 16 GiB): past it, OUT_OF_MEMORY;
 *  - handles are opaque nonzero ids, never reused; cuMemRelease takes one
 *    reference; the memory lives until its last handle reference is released
 *    and its last mapping unmapped;
 *  - cuMemAddressReserve: size a nonzero multiple of the granularity,
 *    alignment 0 or a power of two; cuMemAddressFree: exactly a reservation,
 *    with nothing mapped in it;
 *  - cuMemMap: offset 0, the whole allocation, at a granularity-aligned
 *    address inside one reservation, over nothing mapped;
 *  - cuMemUnmap: a range made of whole mappings with no hole;
 *  - cuMemSetAccess: a range made of whole mappings with no hole (stricter
 *    than the reference's wording, "a fully mapped address range containing
 *    all allocations"), device 0, flags NONE, READ or READWRITE;
 *  - export: only allocations created exportable as POSIX fds; each export
 *    is a new fd the caller owns. Import of an fd whose allocation this
 *    process holds returns the handle it holds, owed one more cuMemRelease
 *    (what the driver does, by backend_cuda.cc's account; the reference
 *    promises neither that nor a new handle, and fake_cuda_set_option
 *    ("import_same_handle", 0) gives a new one instead), else a new handle;
 *    an fd that is not one of this fake's allocations is refused;
 *  - copies and memsets: every device byte read must be mapped with access
 *    granted, every byte written mapped read-write (else ILLEGAL_ADDRESS);
 *    streams and events must be live (or the NULL/legacy/per-thread streams);
 *  - queued work: unmapping device memory, or lowering its access, or freeing
 *    page-locked host memory, that a queued copy or memset not yet run still
 *    uses (on a GPU: a use after free) fails with CUDA_ERROR_NOT_PERMITTED;
 *    a destroyed stream's work stays queued, and its memory in use, until
 *    something forces it;
 *  - cuMemHostAlloc: page-aligned memory, known flags, bounded by
 *    FAKE_CUDA_HOST_BYTES when set; cuMemFreeHost only of what it returned;
 *  - the primary context is reference counted; when the last reference is
 *    released its streams and events are destroyed with it, and the copies
 *    and memsets still queued are dropped unrun (each counted as
 *    "context_reclaimed", which a clean user keeps at 0).
 *
 * Not modelled: the use of host memory that is not page-locked by queued
 * copies (freed or reused before they run, only the bytes copied show it),
 * more than one device, other contexts than the primary one, sticky errors,
 * peer access, memory that only an exported fd keeps alive counted against
 * the device's size, and the driver's entry points vtm does not use (the
 * synchronous copies, cuCtxSynchronize and cuEventQuery among them).
 *
 * Test controls (exported, for ctypes; entry points are named without the
 * _v2 suffix, e.g. "cuMemcpyHtoDAsync"):
 *  - fake_cuda_fail(entry, nth, count, error): the nth call of `entry` from
 *    now (1: the next one) and the count-1 after it (count < 0: all after it)
 *    fail with `error` and do nothing. FAKE_CUDA_FAIL="entry:nth:count:error,..."
 *    (error by number or name, default CUDA_ERROR_UNKNOWN) does the same at
 *    load time;
 *  - fake_cuda_clear_faults(); fake_cuda_calls(entry), fake_cuda_injected(entry),
 *    fake_cuda_calls_behind(entry) (its calls made while copies or memsets
 *    were queued and not yet run), fake_cuda_reset_counters();
 *  - fake_cuda_live(what): "handles", "allocations", "device_bytes",
 *    "mappings", "reservations", "host_allocations", "memfds" (open fds of
 *    this fake's memfds, exported ones included), "streams", "events",
 *    "context_refs", "context_reclaimed", "queued" (copies and memsets
 *    queued and not yet run);
 *  - fake_cuda_range(what, i, &va, &size): the i-th "mappings" or "reservations";
 *  - fake_cuda_violations(), fake_cuda_last_violation(buf, len);
 *  - fake_cuda_set_option(name, value): "device_bytes", "host_bytes",
 *    "import_same_handle", "poison" (0: none, 1: the first and last page, the
 *    default, 2: every byte), "verbose" (1: print violations to stderr, 2:
 *    and every change to the address space), "eager" (1: run each copy and
 *    memset as it is queued, as a stream that is never behind would);
 *    FAKE_CUDA_DEVICE_BYTES, FAKE_CUDA_HOST_BYTES, FAKE_CUDA_POISON,
 *    FAKE_CUDA_VERBOSE and FAKE_CUDA_EAGER set the same at load time.
 *
 * Threading: one mutex serialises every call, so the tables need no other
 * locking; the current context is per thread, as in the driver.
 */
#define _GNU_SOURCE
#include <cuda.h>

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define FAKE_API __attribute__((visibility("default")))

#define GRANULARITY ((size_t)2 << 20)
#define MEMFD_NAME "fake_cuda_allocation"
#define POISON_BYTE 0xcb

/* The entry points, by the names of their prototypes. */
#define FAKE_ENTRY_POINTS(X)        \
  X(cuGetErrorName)                 \
  X(cuGetErrorString)               \
  X(cuInit)                         \
  X(cuDeviceGetCount)               \
  X(cuDeviceGet)                    \
  X(cuDeviceGetAttribute)           \
  X(cuDevicePrimaryCtxRetain)       \
  X(cuDevicePrimaryCtxRelease)      \
  X(cuCtxGetCurrent)                \
  X(cuCtxSetCurrent)                \
  X(cuStreamCreate)                 \
  X(cuStreamDestroy)                \
  X(cuStreamSynchronize)            \
  X(cuStreamWaitEvent)              \
  X(cuEventCreate)                  \
  X(cuEventRecord)                  \
  X(cuEventSynchronize)             \
  X(cuEventDestroy)                 \
  X(cuMemGetAllocationGranularity)  \
  X(cuMemAddressReserve)            \
  X(cuMemAddressFree)               \
  X(cuMemCreate)                    \
  X(cuMemRelease)                   \
  X(cuMemMap)                       \
  X(cuMemUnmap)                     \
  X(cuMemSetAccess)                 \
  X(cuMemExportToShareableHandle)   \
  X(cuMemImportFromShareableHandle) \
  X(cuMemcpyDtoDAsync)              \
  X(cuMemcpyDtoHAsync)              \
  X(cuMemcpyHtoDAsync)              \
  X(cuMemHostAlloc)                 \
  X(cuMemFreeHost)                  \
  X(cuMemsetD8Async)

enum {
#define FAKE_ENUM(name) FN_##name,
  FAKE_ENTRY_POINTS(FAKE_ENUM)
#undef FAKE_ENUM
  FN_COUNT
};

static const char* const kEntryNames[FN_COUNT] = {
#define FAKE_NAME(name) #name,
    FAKE_ENTRY_POINTS(FAKE_NAME)
#undef FAKE_NAME
};

/* ------------------------------------------------------------------------
 * Error codes: the ones this fake returns, with its own descriptions. */

typedef struct {
  CUresult code;
  const char* name;
  const char* text;
} ErrorInfo;

static const ErrorInfo kErrors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "the driver is not initialized"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA device is present"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "the launch failed"},
    {CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const ErrorInfo* FindError(CUresult code) {
  for (size_t i = 0; i < sizeof(kErrors) / sizeof(kErrors[0]); ++i)
    if (kErrors[i].code == code) return &kErrors[i];
  return NULL;
}

/* ------------------------------------------------------------------------
 * Sorted tables: entries ordered by key, found by binary search. One shape
 * serves every kind of object; `bytes` and `flags` mean what the table's
 * user says. */

typedef struct {
  uint64_t key;
  uint64_t bytes;
  void* obj;
  int flags;
} Entry;

typedef struct {
  Entry* v;
  size_t n;
  size_t cap;
} Table;

/* The index of the first entry whose key is >= key. */
static size_t LowerBound(const Table* t, uint64_t key) {
  size_t lo = 0, hi = t->n;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    if (t->v[mid].key < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static Entry* Find(Table* t, uint64_t key) {
  const size_t i = LowerBound(t, key);
  return i < t->n && t->v[i].key == key ? &t->v[i] : NULL;
}

/* The entry with the greatest key <= key, or NULL. */
static Entry* FindAtOrBefore(Table* t, uint64_t key) {
  const size_t i = LowerBound(t, key);
  if (i < t->n && t->v[i].key == key) return &t->v[i];
  return i > 0 ? &t->v[i - 1] : NULL;
}

static int Insert(Table* t, Entry e) {
  if (t->n == t->cap) {
    const size_t cap = t->cap ? t->cap * 2 : 64;
    Entry* v = realloc(t->v, cap * sizeof(Entry));
    if (v == NULL) return -1;
    t->v = v;
    t->cap = cap;
  }
  const size_t i = LowerBound(t, e.key);
  memmove(&t->v[i + 1], &t->v[i], (t->n - i) * sizeof(Entry));
  t->v[i] = e;
  ++t->n;
  return 0;
}

static void Erase(Table* t, Entry* e) {
  const size_t i = (size_t)(e - t->v);
  memmove(&t->v[i], &t->v[i + 1], (t->n - i - 1) * sizeof(Entry));
  --t->n;
}

/* ------------------------------------------------------------------------
 * The driver's state. */

/* Physical memory: one memfd, alive while a handle names it or a mapping
 * shows it. */
typedef struct {
  int fd;
  size_t bytes;
  dev_t dev;
  ino_t ino;
  int exportable;                             /* created with POSIX fd export requested */
  size_t handles;                             /* live handles naming it */
  CUmemGenericAllocationHandle shared_handle; /* the one an import hands back; 0: none */
  size_t mappings;
} Allocation;

struct CUctx_st {
  long refs; /* primary context retains not yet released */
};

/* Access levels stored in a mapping's Entry.flags. */
enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };

/* Work queued on streams (see "Queued work" below). */

/* A point in a queue: "queue `queue` has run its operations numbered up to
 * `seq`". queue 0: none (an event never recorded). */
typedef struct {
  uint64_t queue;
  unsigned long long seq;
} Capture;

/* Device memory an operation reads (ACCESS_READ) or writes (ACCESS_READWRITE). */
typedef struct {
  uint64_t va;
  size_t bytes; /* 0: none */
  int access;
} DeviceUse;

typedef enum { OP_COPY, OP_MEMSET, OP_MARKER } OpKind;

/* One operation of a queue: a copy, a memset, or a marker (an event's
 * record, or a wait for another queue's capture), which touches nothing. */
typedef struct Op {
  struct Op* next;
  unsigned long long seq; /* numbered in the order queued, over all queues */
  OpKind kind;
  int fn; /* the entry point that queued it */
  void* dst;
  const void* src;
  size_t bytes;
  unsigned char value;     /* OP_MEMSET's byte */
  DeviceUse device[2];     /* what it touches on the device */
  const void* host;        /* host memory it reads or writes, host_bytes of it; NULL: none */
  size_t host_bytes;
  Capture* after;          /* it runs after these, n_after of them (each numbered below it) */
  size_t n_after;
} Op;

/* A stream's operations, oldest first. */
typedef struct {
  uint64_t id;        /* never reused */
  const void* handle; /* the stream's handle, for messages */
  int blocking;       /* ordered with the legacy stream */
  int destroyed;      /* the handle is gone, its work is not */
  Op* head;
  Op* tail;
} Queue;

struct CUstream_st {
  unsigned flags;
  Queue* queue; /* in g.queues */
};

struct CUevent_st {
  unsigned flags;
  Capture captured; /* by its last cuEventRecord */
};

typedef struct {
  long long calls;
  long long injected;
  long long behind; /* calls made while copies or memsets were queued and not yet run */
  long long fail_from; /* calls numbered [fail_from, fail_until) fail */
  long long fail_until;
  CUresult fail_error;
} EntryState;

static struct {
  pthread_mutex_t mu;
  int initialized;
  int forked;
  EntryState entries[FN_COUNT];

  struct CUctx_st primary;
  Table allocations;  /* key: Allocation*, obj: the Allocation */
  Table handles;      /* key: handle id, obj: its Allocation, bytes: cuMemRelease calls it is owed */
  Table mappings;     /* key: va, bytes, obj: Allocation, flags: access */
  Table reservations; /* key: va, bytes */
  Table host;         /* key: pointer, bytes */
  Table streams;      /* key: CUstream */
  Table events;       /* key: CUevent */
  Table queues;       /* key: queue id, obj: the Queue of a live stream, or of a destroyed one with work left */
  Queue legacy;       /* the legacy default stream's (NULL, CU_STREAM_LEGACY) */
  Queue per_thread;   /* CU_STREAM_PER_THREAD's, one for all threads */
  uint64_t next_queue;
  unsigned long long next_seq;
  long long queued; /* copies and memsets not yet run */
  CUmemGenericAllocationHandle next_handle;
  size_t device_used;
  size_t host_used;
  long long context_reclaimed;

  /* options */
  size_t device_bytes;
  size_t host_bytes; /* 0: unbounded */
  int import_same_handle;
  int poison;
  int verbose;
  int eager; /* run each operation when it is queued */

  long long violations;
  char last_violation[512];
} g = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .next_handle = 0x7f0000001000ull,
    .legacy = {.id = 1, .handle = CU_STREAM_LEGACY},
    .per_thread = {.id = 2, .handle = CU_STREAM_PER_THREAD, .blocking = 1},
    .next_queue = 3,
    .device_bytes = (size_t)16 << 30,
    .import_same_handle = 1,
    .poison = 1,
};

static __thread CUcontext t_current;

/* Records a broken rule and returns its error code. */
__attribute__((format(printf, 2, 3))) static CUresult Violation(CUresult code, const char* format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(g.last_violation, sizeof(g.last_violation), format, args);
  va_end(args);
  ++g.violations;
  if (g.verbose) fprintf(stderr, "fake libcuda: violation: %s\n", g.last_violation);
  return code;
}

/* FAKE_CUDA_VERBOSE=2: each change to the address space, for debugging. */
__attribute__((format(printf, 1, 2))) static void Trace(const char* format, ...) {
  if (g.verbose < 2) return;
  va_list args;
  va_start(args, format);
  fputs("fake libcuda: ", stderr);
  vfprintf(stderr, format, args);
  fputc('\n', stderr);
  va_end(args);
}

static int PowerOfTwo(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

/* ------------------------------------------------------------------------
 * Queued work.
 *
 * A stream is a queue. An async call checks its arguments at once (a bad one
 * fails the call, as before) and queues its operation; the operation runs
 * only when something forces it, never earlier, so a test sees no more order
 * than the driver promises, and the same order every run (the option "eager",
 * FAKE_CUDA_EAGER=1, runs each operation as it is queued instead). What
 * forces work, by the driver API's reference:
 *  - cuStreamSynchronize "waits until the device has completed all operations
 *    in the stream": all of the stream's;
 *  - cuEventRecord "captures in hEvent the contents of hStream at the time of
 *    this call", and cuEventSynchronize "waits until the completion of all
 *    work currently captured in hEvent": the stream's work up to the record;
 *  - cuStreamWaitEvent "makes all future work submitted to hStream wait for
 *    all work captured in hEvent": the waiting stream's later operations run
 *    after the captured ones, which run first when the later ones are forced;
 *  - "Stream synchronization behavior": "When an action is taken in the legacy
 *    stream such as a kernel launch or cudaStreamWaitEvent(), the legacy
 *    stream first waits on all blocking streams, the action is queued in the
 *    legacy stream, and then all blocking streams wait on the legacy stream";
 *    streams created CU_STREAM_NON_BLOCKING "do not synchronize with the
 *    legacy stream". The per-thread stream "is not a non-blocking stream and
 *    will synchronize with the legacy default stream"; this fake keeps one
 *    per-thread queue for all threads (more order than the driver's, never
 *    less).
 * Every operation runs after those its queue holds before it and after the
 * captures it waits for; sequence numbers grow over all queues, and a
 * capture always names a point before the operation that waits for it, so
 * running them cannot loop. */

static Queue* FindQueue(uint64_t id) {
  if (id == g.legacy.id) return &g.legacy;
  if (id == g.per_thread.id) return &g.per_thread;
  Entry* e = Find(&g.queues, id);
  return e ? e->obj : NULL;
}

/* Every queue, by index in [0, QueueCount()): the two default streams', then
 * the table's. */
static size_t QueueCount(void) { return g.queues.n + 2; }

static Queue* QueueAt(size_t i) {
  if (i == 0) return &g.legacy;
  if (i == 1) return &g.per_thread;
  return g.queues.v[i - 2].obj;
}

/* Whether the work up to `c` has run (a queue gone has run all of it). */
static int CaptureRan(Capture c) {
  const Queue* q = c.queue != 0 ? FindQueue(c.queue) : NULL;
  return q == NULL || q->head == NULL || q->head->seq > c.seq;
}

static int CapturesRan(const Op* op) {
  for (size_t i = 0; i < op->n_after; ++i)
    if (!CaptureRan(op->after[i])) return 0;
  return 1;
}

/* A new operation, numbered now; NULL when out of memory. */
static Op* NewOp(OpKind kind, int fn) {
  Op* op = calloc(1, sizeof(*op));
  if (op == NULL) return NULL;
  op->kind = kind;
  op->fn = fn;
  op->seq = ++g.next_seq;
  return op;
}

static void FreeOp(Op* op) {
  free(op->after);
  free(op);
}

/* Makes `op` run after the work up to `c`; -1 when out of memory. */
static int AddCapture(Op* op, Capture c) {
  if (c.queue == 0 || CaptureRan(c)) return 0;
  Capture* after = realloc(op->after, (op->n_after + 1) * sizeof(Capture));
  if (after == NULL) return -1;
  after[op->n_after++] = c;
  op->after = after;
  return 0;
}

/* The order the legacy stream's rule (above) adds to `op`, queued on `q`. */
static int AddLegacyOrder(const Queue* q, Op* op) {
  if (q == &g.legacy) {
    for (size_t i = 0; i < QueueCount(); ++i) {
      const Queue* b = QueueAt(i);
      if (b->blocking && b->tail != NULL && AddCapture(op, (Capture){b->id, b->tail->seq}) != 0) return -1;
    }
    return 0;
  }
  if (q->blocking && g.legacy.tail != NULL) return AddCapture(op, (Capture){g.legacy.id, g.legacy.tail->seq});
  return 0;
}

/* Takes q's oldest operation off it (it has run, or is dropped). */
static Op* PopHead(Queue* q) {
  Op* op = q->head;
  q->head = op->next;
  if (q->head == NULL) q->tail = NULL;
  if (op->kind != OP_MARKER) --g.queued;
  return op;
}

/* A destroyed stream's queue goes when its work has run. */
static void ForgetIfDone(Queue* q) {
  if (!q->destroyed || q->head != NULL) return;
  Erase(&g.queues, Find(&g.queues, q->id));
  free(q);
}

/* The operation's effect: device memory is host memory, so a copy or a
 * memset is a memmove or a memset; a marker does nothing. */
static void Execute(const Op* op) {
  if (op->kind == OP_COPY) memmove(op->dst, op->src, op->bytes);
  if (op->kind == OP_MEMSET) memset(op->dst, op->value, op->bytes);
}

/* Runs the work up to `c`: the queue's operations through c.seq, oldest
 * first, each after the captures it waits for. */
static void RunThrough(Capture c) {
  Queue* q = c.queue != 0 ? FindQueue(c.queue) : NULL;
  if (q == NULL) return;
  while (q->head != NULL && q->head->seq <= c.seq) {
    Op* op = q->head;
    /* Numbered below op, so none of them is in q: op stays its head. */
    for (size_t i = 0; i < op->n_after; ++i) RunThrough(op->after[i]);
    PopHead(q);
    Execute(op);
    FreeOp(op);
  }
  ForgetIfDone(q);
}

static void RunQueue(Queue* q) {
  if (q->tail != NULL) RunThrough((Capture){q->id, q->tail->seq});
}

/* Retires the markers at the head of `q` whose captures have run: a marker
 * touches nothing, so when it runs cannot be seen, and a queue nobody
 * synchronises (the stream of a fence nobody waits for) does not grow. */
static void RetireMarkers(Queue* q) {
  while (q->head != NULL && q->head->kind == OP_MARKER && CapturesRan(q->head)) FreeOp(PopHead(q));
  ForgetIfDone(q);
}

/* Queues `op` on `q` (taking it, freed on failure); with "eager", runs it. */
static CUresult Enqueue(Queue* q, Op* op) {
  if (AddLegacyOrder(q, op) != 0) {
    FreeOp(op);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  if (q->tail != NULL)
    q->tail->next = op;
  else
    q->head = op;
  q->tail = op;
  if (op->kind != OP_MARKER) ++g.queued;
  if (g.eager)
    RunThrough((Capture){q->id, op->seq});
  else
    RetireMarkers(q);
  return CUDA_SUCCESS;
}

/* Whether `use` touches [start, start+size) and needs more than `access`. */
static int UseConflicts(const DeviceUse* use, uint64_t start, size_t size, int access) {
  return use->bytes != 0 && use->va < start + size && start < use->va + use->bytes &&
         (use->access & access) != use->access;
}

/* The first operation not yet run that uses device memory in [start,
 * start+size) in a way `access` would not allow (ACCESS_NONE: any use), and
 * its queue in *where; NULL if none. */
static const Op* QueuedDeviceUse(uint64_t start, size_t size, int access, const Queue** where) {
  for (size_t i = 0; i < QueueCount(); ++i)
    for (const Op* op = QueueAt(i)->head; op != NULL; op = op->next)
      if (UseConflicts(&op->device[0], start, size, access) || UseConflicts(&op->device[1], start, size, access)) {
        *where = QueueAt(i);
        return op;
      }
  return NULL;
}

/* The first operation not yet run that reads or writes host memory in
 * [p, p+size), and its queue in *where; NULL if none. */
static const Op* QueuedHostUse(const void* p, size_t size, const Queue** where) {
  const uintptr_t start = (uintptr_t)p;
  for (size_t i = 0; i < QueueCount(); ++i)
    for (const Op* op = QueueAt(i)->head; op != NULL; op = op->next)
      if (op->host != NULL && (uintptr_t)op->host < start + size && start < (uintptr_t)op->host + op->host_bytes) {
        *where = QueueAt(i);
        return op;
      }
  return NULL;
}

/* Memory released under queued work: on a GPU the work would read or write
 * memory that is gone, or reused. The reference documents no check of it;
 * this fake refuses the call, which does nothing, and counts a violation. */
static CUresult InUse(const char* fn, const char* what, const Op* op, const Queue* q) {
  return Violation(CUDA_ERROR_NOT_PERMITTED,
                   "%s: %s is used by a %s queued on %s %p that has not run (synchronize the stream first)", fn,
                   what, kEntryNames[op->fn],
                   q == &g.legacy ? "the legacy stream" : q->destroyed ? "destroyed stream" : "stream", q->handle);
}

/* ------------------------------------------------------------------------
 * Entry: counting, injected faults and the preconditions every call shares. */

enum Needs { NEEDS_NOTHING, NEEDS_INIT, NEEDS_CONTEXT };

static CUresult Enter(int fn, enum Needs needs) {
  EntryState* e = &g.entries[fn];
  const long long call = ++e->calls;
  if (g.queued > 0) ++e->behind;
  if (call >= e->fail_from && call < e->fail_until) {
    ++e->injected;
    return e->fail_error;
  }
  if (needs == NEEDS_NOTHING) return CUDA_SUCCESS;
  if (g.forked)
    return Violation(CUDA_ERROR_NOT_INITIALIZED, "%s in a process forked after cuInit", kEntryNames[fn]);
  if (!g.initialized && fn != FN_cuInit)
    return Violation(CUDA_ERROR_NOT_INITIALIZED, "%s before cuInit", kEntryNames[fn]);
  if (needs == NEEDS_CONTEXT) {
    if (t_current == NULL) return Violation(CUDA_ERROR_INVALID_CONTEXT, "%s with no current context", kEntryNames[fn]);
    if (g.primary.refs <= 0)
      return Violation(CUDA_ERROR_INVALID_CONTEXT, "%s with a current context that was released",
                       kEntryNames[fn]);
  }
  return CUDA_SUCCESS;
}

/* Each entry point: lock, count and check, run its body, unlock. */
#define FAKE_ENTRY(name, needs, params, args)                \
  static CUresult name##_body params;                        \
  FAKE_API CUresult CUDAAPI name params {                    \
    pthread_mutex_lock(&g.mu);                               \
    CUresult result_ = Enter(FN_##name, needs);              \
    if (result_ == CUDA_SUCCESS) result_ = name##_body args; \
    pthread_mutex_unlock(&g.mu);                             \
    return result_;                                          \
  }                                                          \
  static CUresult name##_body params

/* ------------------------------------------------------------------------
 * Errors, init, devices. */

FAKE_ENTRY(cuGetErrorName, NEEDS_NOTHING, (CUresult error, const char** pStr), (error, pStr)) {
  if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
  const ErrorInfo* info = FindError(error);
  *pStr = info ? info->name : NULL;
  return info ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_ENTRY(cuGetErrorString, NEEDS_NOTHING, (CUresult error, const char** pStr), (error, pStr)) {
  if (pStr == NULL) return CUDA_ERROR_INVALID_VALUE;
  const ErrorInfo* info = FindError(error);
  *pStr = info ? info->text : NULL;
  return info ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_ENTRY(cuInit, NEEDS_INIT, (unsigned int Flags), (Flags)) {
  if (Flags != 0) return Violation(CUDA_ERROR_INVALID_VALUE, "cuInit: flags %u, must be 0", Flags);
  g.initialized = 1;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuDeviceGetCount, NEEDS_INIT, (int* count), (count)) {
  if (count == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetCount: count is NULL");
  *count = 1;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuDeviceGet, NEEDS_INIT, (CUdevice * device, int ordinal), (device, ordinal)) {
  if (device == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet: device is NULL");
  if (ordinal != 0) return Violation(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet: ordinal %d of 1 device", ordinal);
  *device = 0;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuDeviceGetAttribute, NEEDS_INIT, (int* pi, CUdevice_attribute attrib, CUdevice dev),
           (pi, attrib, dev)) {
  if (pi == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute: pi is NULL");
  if (dev != 0) return Violation(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGetAttribute: device %d", dev);
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
      *pi = 1;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *pi = 9;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *pi = 0;
      return CUDA_SUCCESS;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *pi = 4;
      return CUDA_SUCCESS;
    default:
      return Violation(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute: attribute %d is not modelled", (int)attrib);
  }
}

/* ------------------------------------------------------------------------
 * The primary context. */

/* Drops every operation of `q` without running it; how many copies and
 * memsets that was. */
static long long DropQueued(Queue* q) {
  long long dropped = 0;
  while (q->head != NULL) {
    Op* op = PopHead(q);
    dropped += op->kind != OP_MARKER;
    FreeOp(op);
  }
  return dropped;
}

/* The context's end: its streams and events go with it, and so does the work
 * still queued on them, never run (the context that would run it is gone;
 * each copy or memset dropped counts as reclaimed). */
static void ResetPrimary(void) {
  for (size_t i = 0; i < QueueCount(); ++i) g.context_reclaimed += DropQueued(QueueAt(i));
  for (size_t i = 0; i < g.queues.n; ++i) free(g.queues.v[i].obj);
  for (size_t i = 0; i < g.streams.n; ++i) free(g.streams.v[i].obj);
  for (size_t i = 0; i < g.events.n; ++i) free(g.events.v[i].obj);
  g.context_reclaimed += (long long)(g.streams.n + g.events.n);
  g.queues.n = 0;
  g.streams.n = 0;
  g.events.n = 0;
}

FAKE_ENTRY(cuDevicePrimaryCtxRetain, NEEDS_INIT, (CUcontext * pctx, CUdevice dev), (pctx, dev)) {
  if (pctx == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuDevicePrimaryCtxRetain: pctx is NULL");
  if (dev != 0) return Violation(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRetain: device %d", dev);
  ++g.primary.refs;
  *pctx = &g.primary;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuDevicePrimaryCtxRelease, NEEDS_INIT, (CUdevice dev), (dev)) {
  if (dev != 0) return Violation(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRelease: device %d", dev);
  if (g.primary.refs <= 0)
    return Violation(CUDA_ERROR_INVALID_CONTEXT, "cuDevicePrimaryCtxRelease: the primary context is not retained");
  if (--g.primary.refs == 0) ResetPrimary();
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuCtxGetCurrent, NEEDS_INIT, (CUcontext * pctx), (pctx)) {
  if (pctx == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuCtxGetCurrent: pctx is NULL");
  *pctx = t_current;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuCtxSetCurrent, NEEDS_INIT, (CUcontext ctx), (ctx)) {
  if (ctx != NULL && ctx != &g.primary)
    return Violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent: %p is not a context", (void*)ctx);
  if (ctx != NULL && g.primary.refs <= 0)
    return Violation(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent: the primary context is not retained");
  t_current = ctx;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------
 * Streams and events. */

/* A zeroed object of `size` bytes entered in `table` under its own address
 * (a stream's or an event's handle); NULL, with nothing entered, when out of memory. */
static void* NewObject(Table* table, size_t size) {
  void* obj = calloc(1, size);
  if (obj == NULL) return NULL;
  if (Insert(table, (Entry){(uintptr_t)obj, 0, obj, 0}) != 0) {
    free(obj);
    return NULL;
  }
  return obj;
}

/* The queue of stream `s`, or NULL if it is not a live stream. NULL is the
 * legacy stream: vtm calls the driver's entry points without the per-thread
 * (_ptsz) suffix. */
static Queue* StreamQueue(CUstream s) {
  if (s == NULL || s == CU_STREAM_LEGACY) return &g.legacy;
  if (s == CU_STREAM_PER_THREAD) return &g.per_thread;
  Entry* e = Find(&g.streams, (uintptr_t)s);
  return e ? ((struct CUstream_st*)e->obj)->queue : NULL;
}

static struct CUevent_st* LiveEvent(CUevent ev) {
  Entry* e = Find(&g.events, (uintptr_t)ev);
  return e ? e->obj : NULL;
}

FAKE_ENTRY(cuStreamCreate, NEEDS_CONTEXT, (CUstream * phStream, unsigned int Flags), (phStream, Flags)) {
  if (phStream == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: phStream is NULL");
  if (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate: flags %#x", Flags);
  Queue* q = calloc(1, sizeof(*q));
  if (q == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  q->id = g.next_queue++;
  q->blocking = !(Flags & CU_STREAM_NON_BLOCKING);
  struct CUstream_st* s = NewObject(&g.streams, sizeof(*s));
  if (s == NULL || Insert(&g.queues, (Entry){q->id, 0, q, 0}) != 0) {
    if (s != NULL) Erase(&g.streams, Find(&g.streams, (uintptr_t)s));
    free(s);
    free(q);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  q->handle = s;
  s->flags = Flags;
  s->queue = q;
  *phStream = s;
  return CUDA_SUCCESS;
}

/* "In case the device is still doing work in the stream hStream when
 * cuStreamDestroy() is called, the function will return immediately and the
 * resources associated with hStream will be released automatically once the
 * device has completed all work in hStream." The handle goes; the queue stays
 * until its work has run (forced through an event recorded on it, or by work
 * that waits for one), and the memory that work uses stays in use. */
FAKE_ENTRY(cuStreamDestroy, NEEDS_CONTEXT, (CUstream hStream), (hStream)) {
  Entry* e = Find(&g.streams, (uintptr_t)hStream);
  if (e == NULL)
    return Violation(CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy: %p is not a live stream", (void*)hStream);
  struct CUstream_st* s = e->obj;
  Queue* q = s->queue;
  free(s);
  Erase(&g.streams, e);
  q->destroyed = 1;
  ForgetIfDone(q);
  return CUDA_SUCCESS;
}

/* The stream's own work (and what it waits for). The reference promises no
 * more: work queued on other streams, the legacy one included, may still be
 * pending. */
FAKE_ENTRY(cuStreamSynchronize, NEEDS_CONTEXT, (CUstream hStream), (hStream)) {
  Queue* q = StreamQueue(hStream);
  if (q == NULL)
    return Violation(CUDA_ERROR_INVALID_HANDLE, "cuStreamSynchronize: %p is not a live stream", (void*)hStream);
  RunQueue(q);
  return CUDA_SUCCESS;
}

/* A marker on the stream that waits for the event's capture ("the most
 * recently captured state at the time of the API call", not affected by
 * later records). An event never recorded "represents an empty set of work":
 * nothing to wait for. */
FAKE_ENTRY(cuStreamWaitEvent, NEEDS_CONTEXT, (CUstream hStream, CUevent hEvent, unsigned int Flags),
           (hStream, hEvent, Flags)) {
  Queue* q = StreamQueue(hStream);
  if (q == NULL)
    return Violation(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent: %p is not a live stream", (void*)hStream);
  const struct CUevent_st* ev = LiveEvent(hEvent);
  if (ev == NULL)
    return Violation(CUDA_ERROR_INVALID_HANDLE, "cuStreamWaitEvent: %p is not a live event", (void*)hEvent);
  if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuStreamWaitEvent: flags %#x", Flags);
  Op* op = NewOp(OP_MARKER, FN_cuStreamWaitEvent);
  if (op == NULL || AddCapture(op, ev->captured) != 0) {
    if (op != NULL) FreeOp(op);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return Enqueue(q, op);
}

FAKE_ENTRY(cuEventCreate, NEEDS_CONTEXT, (CUevent * phEvent, unsigned int Flags), (phEvent, Flags)) {
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (phEvent == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuEventCreate: phEvent is NULL");
  if ((Flags & ~known) || ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuEventCreate: flags %#x", Flags);
  struct CUevent_st* ev = NewObject(&g.events, sizeof(*ev));
  if (ev == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  ev->flags = Flags;
  *phEvent = ev;
  return CUDA_SUCCESS;
}

/* A marker on the stream; the event captures the stream up to it (on the
 * legacy stream, the marker waits for every blocking stream first). */
FAKE_ENTRY(cuEventRecord, NEEDS_CONTEXT, (CUevent hEvent, CUstream hStream), (hEvent, hStream)) {
  struct CUevent_st* ev = LiveEvent(hEvent);
  if (ev == NULL) return Violation(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord: %p is not a live event", (void*)hEvent);
  Queue* q = StreamQueue(hStream);
  if (q == NULL) return Violation(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord: %p is not a live stream", (void*)hStream);
  Op* op = NewOp(OP_MARKER, FN_cuEventRecord);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  const Capture captured = {q->id, op->seq};
  const CUresult r = Enqueue(q, op);
  if (r == CUDA_SUCCESS) ev->captured = captured;
  return r;
}

FAKE_ENTRY(cuEventSynchronize, NEEDS_CONTEXT, (CUevent hEvent), (hEvent)) {
  const struct CUevent_st* ev = LiveEvent(hEvent);
  if (ev == NULL)
    return Violation(CUDA_ERROR_INVALID_HANDLE, "cuEventSynchronize: %p is not a live event", (void*)hEvent);
  RunThrough(ev->captured);
  return CUDA_SUCCESS;
}

/* "An event may be destroyed before it is complete ... any associated
 * resources will automatically be released asynchronously at completion":
 * the handle goes at once; waits already queued keep their capture. */
FAKE_ENTRY(cuEventDestroy, NEEDS_CONTEXT, (CUevent hEvent), (hEvent)) {
  Entry* e = Find(&g.events, (uintptr_t)hEvent);
  if (e == NULL) return Violation(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy: %p is not a live event", (void*)hEvent);
  free(e->obj);
  Erase(&g.events, e);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------
 * Allocations and handles. */

static CUresult CheckProp(const char* fn, const CUmemAllocationProp* prop) {
  if (prop == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "%s: prop is NULL", fn);
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    return Violation(CUDA_ERROR_INVALID_VALUE, "%s: allocation type %d, only pinned is modelled", fn, (int)prop->type);
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id != 0)
    return Violation(CUDA_ERROR_INVALID_DEVICE, "%s: location (type %d, id %d), not device 0", fn,
                     (int)prop->location.type, prop->location.id);
  if (prop->requestedHandleTypes & ~(unsigned)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return Violation(CUDA_ERROR_NOT_SUPPORTED, "%s: handle types %#x, only POSIX fds are supported", fn,
                     (unsigned)prop->requestedHandleTypes);
  return CUDA_SUCCESS;
}

/* Frees an allocation nothing refers to any more. */
static void MaybeFreeAllocation(Allocation* a) {
  if (a->handles != 0 || a->mappings != 0) return;
  close(a->fd);
  g.device_used -= a->bytes;
  Erase(&g.allocations, Find(&g.allocations, (uintptr_t)a));
  free(a);
}

/* A new handle naming `a`, owed one release. */
static CUresult NameAllocation(Allocation* a, CUmemGenericAllocationHandle* out) {
  const CUmemGenericAllocationHandle id = g.next_handle;
  if (Insert(&g.handles, (Entry){id, 1, a, 0}) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  g.next_handle += 0x10;
  ++a->handles;
  if (a->shared_handle == 0) a->shared_handle = id;
  *out = id;
  return CUDA_SUCCESS;
}

static Allocation* HandleAllocation(CUmemGenericAllocationHandle handle) {
  Entry* e = Find(&g.handles, handle);
  return e ? e->obj : NULL;
}

/* Fills new memory with a byte no one writes, as the driver does not clear
 * it: poison 1 fills the first and last page (cheap, and enough to catch
 * code that takes a new chunk for zeros), 2 all of it. */
static int PoisonRange(int fd, off_t offset, size_t bytes) {
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset);
  if (p == MAP_FAILED) return -1;
  memset(p, POISON_BYTE, bytes);
  munmap(p, bytes);
  return 0;
}

static int Poison(int fd, size_t bytes) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (g.poison >= 2 || bytes <= 2 * page) return PoisonRange(fd, 0, bytes);
  if (PoisonRange(fd, 0, page) != 0) return -1;
  return PoisonRange(fd, (off_t)(bytes - page), page);
}

FAKE_ENTRY(cuMemGetAllocationGranularity, NEEDS_INIT,
           (size_t * granularity, const CUmemAllocationProp* prop, CUmemAllocationGranularity_flags option),
           (granularity, prop, option)) {
  if (granularity == NULL)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity: granularity is NULL");
  CUresult r = CheckProp("cuMemGetAllocationGranularity", prop);
  if (r != CUDA_SUCCESS) return r;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity: option %d", (int)option);
  *granularity = GRANULARITY;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemCreate, NEEDS_CONTEXT,
           (CUmemGenericAllocationHandle * handle, size_t size, const CUmemAllocationProp* prop,
            unsigned long long flags),
           (handle, size, prop, flags)) {
  if (handle == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: handle is NULL");
  CUresult r = CheckProp("cuMemCreate", prop);
  if (r != CUDA_SUCCESS) return r;
  if (flags != 0) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: flags %#llx, must be 0", flags);
  if (size == 0 || size % GRANULARITY != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: size %zu is not a positive multiple of %zu", size,
                     GRANULARITY);
  if (size > g.device_bytes - g.device_used) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation* a = calloc(1, sizeof(*a));
  if (a == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  a->fd = memfd_create(MEMFD_NAME, MFD_CLOEXEC);
  struct stat st;
  if (a->fd < 0 || ftruncate(a->fd, (off_t)size) != 0 || fstat(a->fd, &st) != 0 ||
      (g.poison && Poison(a->fd, size) != 0)) {
    if (a->fd >= 0) close(a->fd);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->bytes = size;
  a->dev = st.st_dev;
  a->ino = st.st_ino;
  a->exportable = (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
  if (Insert(&g.allocations, (Entry){(uintptr_t)a, size, a, 0}) != 0) {
    close(a->fd);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g.device_used += size;
  r = NameAllocation(a, handle);
  if (r != CUDA_SUCCESS) MaybeFreeAllocation(a);
  return r;
}

FAKE_ENTRY(cuMemRelease, NEEDS_CONTEXT, (CUmemGenericAllocationHandle handle), (handle)) {
  Entry* e = Find(&g.handles, handle);
  if (e == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemRelease: %#llx is not a live handle", handle);
  Allocation* a = e->obj;
  if (--e->bytes > 0) return CUDA_SUCCESS;
  Erase(&g.handles, e);
  --a->handles;
  if (a->shared_handle == handle) a->shared_handle = 0;
  MaybeFreeAllocation(a);
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemExportToShareableHandle, NEEDS_CONTEXT,
           (void* shareableHandle, CUmemGenericAllocationHandle handle, CUmemAllocationHandleType handleType,
            unsigned long long flags),
           (shareableHandle, handle, handleType, flags)) {
  if (shareableHandle == NULL)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle: shareableHandle is NULL");
  Allocation* a = HandleAllocation(handle);
  if (a == NULL)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle: %#llx is not a live handle", handle);
  if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || flags != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle: handle type %d, flags %#llx",
                     (int)handleType, flags);
  if (!a->exportable)
    return Violation(CUDA_ERROR_NOT_PERMITTED,
                     "cuMemExportToShareableHandle: %#llx was not created exportable as a POSIX fd", handle);
  const int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *(int*)shareableHandle = fd;
  return CUDA_SUCCESS;
}

/* Whether `fd` is a memfd made by this fake (in this process or another). */
static int IsOurMemfd(int fd) {
  char path[64], target[256];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(path, target, sizeof(target) - 1);
  if (n < 0) return 0;
  target[n] = '\0';
  return strncmp(target, "/memfd:" MEMFD_NAME, strlen("/memfd:" MEMFD_NAME)) == 0;
}

FAKE_ENTRY(cuMemImportFromShareableHandle, NEEDS_CONTEXT,
           (CUmemGenericAllocationHandle * handle, void* osHandle, CUmemAllocationHandleType shHandleType),
           (handle, osHandle, shHandleType)) {
  if (handle == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle: handle is NULL");
  if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle: handle type %d", (int)shHandleType);
  const int fd = (int)(intptr_t)osHandle;
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0 || !IsOurMemfd(fd) || st.st_size <= 0 ||
      (size_t)st.st_size % GRANULARITY != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle: fd %d is not an exported allocation",
                     fd);
  for (size_t i = 0; i < g.allocations.n; ++i) {
    Allocation* a = g.allocations.v[i].obj;
    if (a->dev != st.st_dev || a->ino != st.st_ino) continue;
    if (a->shared_handle != 0 && g.import_same_handle) {
      ++Find(&g.handles, a->shared_handle)->bytes;
      *handle = a->shared_handle;
      return CUDA_SUCCESS;
    }
    return NameAllocation(a, handle);
  }
  const size_t size = (size_t)st.st_size;
  if (size > g.device_bytes - g.device_used) return CUDA_ERROR_OUT_OF_MEMORY;
  Allocation* a = calloc(1, sizeof(*a));
  if (a == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  /* The driver does not take the caller's fd: it keeps its own reference. */
  a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (a->fd < 0) {
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  a->bytes = size;
  a->dev = st.st_dev;
  a->ino = st.st_ino;
  a->exportable = 1;
  if (Insert(&g.allocations, (Entry){(uintptr_t)a, size, a, 0}) != 0) {
    close(a->fd);
    free(a);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g.device_used += size;
  CUresult r = NameAllocation(a, handle);
  if (r != CUDA_SUCCESS) MaybeFreeAllocation(a);
  return r;
}

/* ------------------------------------------------------------------------
 * Address ranges and mappings. */

/* The reservation holding all of [va, va+size), or NULL. */
static Entry* ReservationOf(uint64_t va, size_t size) {
  Entry* r = FindAtOrBefore(&g.reservations, va);
  if (r == NULL || va + size < va || va + size > r->key + r->bytes) return NULL;
  return r;
}

/* The index of the first mapping ending after `va`. */
static size_t FirstMappingAfter(uint64_t va) {
  size_t i = LowerBound(&g.mappings, va);
  if (i > 0 && g.mappings.v[i - 1].key + g.mappings.v[i - 1].bytes > va) --i;
  return i;
}

/* Whether [va, va+size) is exactly a run of whole adjacent mappings; sets
 * [*first, *end) to their indices. */
static int WholeMappings(uint64_t va, size_t size, size_t* first, size_t* end) {
  size_t i = FirstMappingAfter(va);
  *first = i;
  uint64_t at = va;
  while (at < va + size) {
    if (i >= g.mappings.n || g.mappings.v[i].key != at) return 0;
    at += g.mappings.v[i].bytes;
    ++i;
  }
  *end = i;
  return at == va + size;
}

/* Whether every byte of [va, va+size) is mapped with at least `access`. */
static int Accessible(uint64_t va, size_t size, int access) {
  if (size == 0) return 1;
  if (va + size < va) return 0;
  size_t i = FirstMappingAfter(va);
  uint64_t at = va;
  while (at < va + size) {
    if (i >= g.mappings.n || g.mappings.v[i].key > at) return 0;
    if ((g.mappings.v[i].flags & access) != access) return 0;
    at = g.mappings.v[i].key + g.mappings.v[i].bytes;
    ++i;
  }
  return 1;
}

FAKE_ENTRY(cuMemAddressReserve, NEEDS_CONTEXT,
           (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags),
           (ptr, size, alignment, addr, flags)) {
  (void)addr; /* a hint the driver may ignore; so does this fake */
  if (ptr == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: ptr is NULL");
  if (size == 0 || size % GRANULARITY != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: size %zu is not a positive multiple of %zu",
                     size, GRANULARITY);
  if (alignment != 0 && !PowerOfTwo(alignment))
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: alignment %zu is not a power of two", alignment);
  if (flags != 0) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: flags %#llx", flags);
  const size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
  if (size > SIZE_MAX - align) return CUDA_ERROR_OUT_OF_MEMORY;
  /* Over-reserve, then trim to an aligned range of `size`. */
  const size_t span = size + align;
  char* p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const uintptr_t start = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
  if (start > (uintptr_t)p) munmap(p, start - (uintptr_t)p);
  const uintptr_t tail = start + size, end = (uintptr_t)p + span;
  if (end > tail) munmap((void*)tail, end - tail);
  if (Insert(&g.reservations, (Entry){start, size, NULL, 0}) != 0) {
    munmap((void*)start, size);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *ptr = start;
  Trace("cuMemAddressReserve [%#lx, +%zu)", (unsigned long)start, size);
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemAddressFree, NEEDS_CONTEXT, (CUdeviceptr ptr, size_t size), (ptr, size)) {
  Entry* r = Find(&g.reservations, ptr);
  if (r == NULL || r->bytes != size)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree: [%#llx, +%zu) is not a reservation", ptr, size);
  const size_t i = FirstMappingAfter(ptr);
  if (i < g.mappings.n && g.mappings.v[i].key < ptr + size)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree: [%#llx, +%zu) still maps %#llx", ptr, size,
                     (unsigned long long)g.mappings.v[i].key);
  munmap((void*)(uintptr_t)ptr, size);
  Erase(&g.reservations, r);
  Trace("cuMemAddressFree [%#llx, +%zu)", ptr, size);
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemMap, NEEDS_CONTEXT,
           (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags),
           (ptr, size, offset, handle, flags)) {
  Allocation* a = HandleAllocation(handle);
  if (a == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: %#llx is not a live handle", handle);
  if (flags != 0 || offset != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: offset %zu, flags %#llx: both must be 0", offset, flags);
  if (size != a->bytes)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: size %zu, but the allocation is %zu bytes", size, a->bytes);
  if (ptr % GRANULARITY != 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: %#llx is not aligned to %zu", ptr, GRANULARITY);
  if (ReservationOf(ptr, size) == NULL)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: [%#llx, +%zu) is not inside one reservation", ptr, size);
  const size_t i = FirstMappingAfter(ptr);
  if (i < g.mappings.n && g.mappings.v[i].key < ptr + size)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: [%#llx, +%zu) overlaps the mapping at %#llx", ptr, size,
                     (unsigned long long)g.mappings.v[i].key);
  if (Insert(&g.mappings, (Entry){ptr, size, a, ACCESS_NONE}) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0);
  if (p == MAP_FAILED) {
    Erase(&g.mappings, Find(&g.mappings, ptr));
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  ++a->mappings;
  Trace("cuMemMap [%#llx, +%zu) <- %#llx", ptr, size, handle);
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemUnmap, NEEDS_CONTEXT, (CUdeviceptr ptr, size_t size), (ptr, size)) {
  size_t first = 0, end = 0;
  if (size == 0 || !WholeMappings(ptr, size, &first, &end))
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap: [%#llx, +%zu) is not a run of whole mappings", ptr, size);
  const Queue* q = NULL;
  const Op* op = QueuedDeviceUse(ptr, size, ACCESS_NONE, &q);
  if (op != NULL) return InUse("cuMemUnmap", "the range", op, q);
  /* Back to a PROT_NONE reservation, with no file behind it. */
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
  for (size_t i = first; i < end; ++i) {
    /* Freed at its last mapping: no later entry of the run refers to it. */
    Allocation* a = g.mappings.v[i].obj;
    if (--a->mappings == 0) MaybeFreeAllocation(a);
  }
  memmove(&g.mappings.v[first], &g.mappings.v[end], (g.mappings.n - end) * sizeof(Entry));
  g.mappings.n -= end - first;
  Trace("cuMemUnmap [%#llx, +%zu): %zu mapping(s)", ptr, size, end - first);
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemSetAccess, NEEDS_CONTEXT, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count),
           (ptr, size, desc, count)) {
  if (desc == NULL || count == 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: no access descriptor");
  int access = -1;
  for (size_t i = 0; i < count; ++i) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc[i].location.id != 0)
      return Violation(CUDA_ERROR_INVALID_DEVICE, "cuMemSetAccess: location (type %d, id %d), not device 0",
                       (int)desc[i].location.type, desc[i].location.id);
    const int flags = (int)desc[i].flags;
    if (flags != ACCESS_NONE && flags != ACCESS_READ && flags != ACCESS_READWRITE)
      return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: access flags %d", flags);
    access = flags;
  }
  size_t first = 0, end = 0;
  if (size == 0 || !WholeMappings(ptr, size, &first, &end))
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: [%#llx, +%zu) is not a run of whole mappings", ptr,
                     size);
  const Queue* q = NULL;
  const Op* op = QueuedDeviceUse(ptr, size, access, &q);
  if (op != NULL) return InUse("cuMemSetAccess", "the range, whose access it lowers,", op, q);
  const int prot = access == ACCESS_READWRITE ? PROT_READ | PROT_WRITE : access == ACCESS_READ ? PROT_READ : PROT_NONE;
  if (mprotect((void*)(uintptr_t)ptr, size, prot) != 0) return CUDA_ERROR_UNKNOWN;
  for (size_t i = first; i < end; ++i) g.mappings.v[i].flags = access;
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------
 * Copies and memsets: every device byte checked at the call, the operation
 * queued on its stream (run later: "Queued work" above). */

static CUresult CheckDevice(const char* fn, const char* role, CUdeviceptr va, size_t bytes, int access) {
  if (Accessible(va, bytes, access)) return CUDA_SUCCESS;
  return Violation(CUDA_ERROR_ILLEGAL_ADDRESS, "%s: %s [%#llx, +%zu) is not mapped %s", fn, role, va, bytes,
                   access == ACCESS_READWRITE ? "read-write" : "readable");
}

static CUresult CheckStream(const char* fn, const Queue* q, CUstream s) {
  if (q != NULL) return CUDA_SUCCESS;
  return Violation(CUDA_ERROR_INVALID_HANDLE, "%s: %p is not a live stream", fn, (void*)s);
}

/* Queues a copy of `bytes` from src to dst on q: it reads device memory
 * `read`, writes `write` (either empty for a host copy) and uses `host`
 * (NULL: none). */
static CUresult QueueCopy(int fn, Queue* q, void* dst, const void* src, size_t bytes, DeviceUse read,
                          DeviceUse write, const void* host) {
  if (bytes == 0) return CUDA_SUCCESS;
  Op* op = NewOp(OP_COPY, fn);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  op->dst = dst;
  op->src = src;
  op->bytes = bytes;
  op->device[0] = read;
  op->device[1] = write;
  op->host = host;
  op->host_bytes = host != NULL ? bytes : 0;
  return Enqueue(q, op);
}

FAKE_ENTRY(cuMemcpyDtoDAsync, NEEDS_CONTEXT,
           (CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
           (dstDevice, srcDevice, ByteCount, hStream)) {
  Queue* q = StreamQueue(hStream);
  CUresult r = CheckStream("cuMemcpyDtoDAsync", q, hStream);
  if (r == CUDA_SUCCESS) r = CheckDevice("cuMemcpyDtoDAsync", "source", srcDevice, ByteCount, ACCESS_READ);
  if (r == CUDA_SUCCESS) r = CheckDevice("cuMemcpyDtoDAsync", "destination", dstDevice, ByteCount, ACCESS_READWRITE);
  if (r != CUDA_SUCCESS) return r;
  return QueueCopy(FN_cuMemcpyDtoDAsync, q, (void*)(uintptr_t)dstDevice, (const void*)(uintptr_t)srcDevice,
                   ByteCount, (DeviceUse){srcDevice, ByteCount, ACCESS_READ},
                   (DeviceUse){dstDevice, ByteCount, ACCESS_READWRITE}, NULL);
}

FAKE_ENTRY(cuMemcpyDtoHAsync, NEEDS_CONTEXT, (void* dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream),
           (dstHost, srcDevice, ByteCount, hStream)) {
  if (dstHost == NULL && ByteCount > 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemcpyDtoHAsync: dstHost is NULL");
  Queue* q = StreamQueue(hStream);
  CUresult r = CheckStream("cuMemcpyDtoHAsync", q, hStream);
  if (r == CUDA_SUCCESS) r = CheckDevice("cuMemcpyDtoHAsync", "source", srcDevice, ByteCount, ACCESS_READ);
  if (r != CUDA_SUCCESS) return r;
  return QueueCopy(FN_cuMemcpyDtoHAsync, q, dstHost, (const void*)(uintptr_t)srcDevice, ByteCount,
                   (DeviceUse){srcDevice, ByteCount, ACCESS_READ}, (DeviceUse){0, 0, 0}, dstHost);
}

FAKE_ENTRY(cuMemcpyHtoDAsync, NEEDS_CONTEXT,
           (CUdeviceptr dstDevice, const void* srcHost, size_t ByteCount, CUstream hStream),
           (dstDevice, srcHost, ByteCount, hStream)) {
  if (srcHost == NULL && ByteCount > 0)
    return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemcpyHtoDAsync: srcHost is NULL");
  Queue* q = StreamQueue(hStream);
  CUresult r = CheckStream("cuMemcpyHtoDAsync", q, hStream);
  if (r == CUDA_SUCCESS) r = CheckDevice("cuMemcpyHtoDAsync", "destination", dstDevice, ByteCount, ACCESS_READWRITE);
  if (r != CUDA_SUCCESS) return r;
  return QueueCopy(FN_cuMemcpyHtoDAsync, q, (void*)(uintptr_t)dstDevice, srcHost, ByteCount, (DeviceUse){0, 0, 0},
                   (DeviceUse){dstDevice, ByteCount, ACCESS_READWRITE}, srcHost);
}

FAKE_ENTRY(cuMemsetD8Async, NEEDS_CONTEXT, (CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream),
           (dstDevice, uc, N, hStream)) {
  Queue* q = StreamQueue(hStream);
  CUresult r = CheckStream("cuMemsetD8Async", q, hStream);
  if (r == CUDA_SUCCESS) r = CheckDevice("cuMemsetD8Async", "destination", dstDevice, N, ACCESS_READWRITE);
  if (r != CUDA_SUCCESS || N == 0) return r;
  Op* op = NewOp(OP_MEMSET, FN_cuMemsetD8Async);
  if (op == NULL) return CUDA_ERROR_OUT_OF_MEMORY;
  op->dst = (void*)(uintptr_t)dstDevice;
  op->bytes = N;
  op->value = uc;
  op->device[0] = (DeviceUse){dstDevice, N, ACCESS_READWRITE};
  return Enqueue(q, op);
}

/* ------------------------------------------------------------------------
 * Page-locked host memory. */

FAKE_ENTRY(cuMemHostAlloc, NEEDS_CONTEXT, (void** pp, size_t bytesize, unsigned int Flags), (pp, bytesize, Flags)) {
  const unsigned known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if (pp == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc: pp is NULL");
  if (Flags & ~known) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc: flags %#x", Flags);
  if (bytesize == 0) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc: bytesize 0");
  if (g.host_bytes != 0 && bytesize > g.host_bytes - g.host_used) return CUDA_ERROR_OUT_OF_MEMORY;
  void* p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  if (Insert(&g.host, (Entry){(uintptr_t)p, bytesize, NULL, 0}) != 0) {
    munmap(p, bytesize);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  g.host_used += bytesize;
  *pp = p;
  return CUDA_SUCCESS;
}

FAKE_ENTRY(cuMemFreeHost, NEEDS_CONTEXT, (void* p), (p)) {
  Entry* e = Find(&g.host, (uintptr_t)p);
  if (e == NULL) return Violation(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost: %p was not returned by cuMemHostAlloc", p);
  const Queue* q = NULL;
  const Op* op = QueuedHostUse(p, e->bytes, &q);
  if (op != NULL) return InUse("cuMemFreeHost", "the memory", op, q);
  munmap(p, e->bytes);
  g.host_used -= e->bytes;
  Erase(&g.host, e);
  return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------
 * Test controls. */

static int EntryIndex(const char* name) {
  if (name == NULL) return -1;
  size_t len = strlen(name);
  if (len > 3 && strcmp(name + len - 3, "_v2") == 0) len -= 3;  /* the exported symbol's name */
  for (int i = 0; i < FN_COUNT; ++i)
    if (strlen(kEntryNames[i]) == len && strncmp(kEntryNames[i], name, len) == 0) return i;
  return -1;
}

static void SetFault(int fn, long long nth, long long count, CUresult error) {
  EntryState* e = &g.entries[fn];
  e->fail_from = e->calls + (nth < 1 ? 1 : nth);
  e->fail_until = count < 0 ? LLONG_MAX : e->fail_from + count;
  e->fail_error = error;
}

FAKE_API int fake_cuda_fail(const char* entry, long long nth, long long count, int error) {
  const int fn = EntryIndex(entry);
  if (fn < 0) return -1;
  pthread_mutex_lock(&g.mu);
  SetFault(fn, nth, count, (CUresult)error);
  pthread_mutex_unlock(&g.mu);
  return 0;
}

FAKE_API void fake_cuda_clear_faults(void) {
  pthread_mutex_lock(&g.mu);
  for (int i = 0; i < FN_COUNT; ++i) g.entries[i].fail_from = g.entries[i].fail_until = 0;
  pthread_mutex_unlock(&g.mu);
}

FAKE_API long long fake_cuda_calls(const char* entry) {
  const int fn = EntryIndex(entry);
  if (fn < 0) return -1;
  pthread_mutex_lock(&g.mu);
  const long long n = g.entries[fn].calls;
  pthread_mutex_unlock(&g.mu);
  return n;
}

/* The calls of `entry` made while work was queued and not yet run: what
 * a caller did while its copies were in flight (e.g. cuMemMap, mapping a
 * match's pages under its restore's copies). */
FAKE_API long long fake_cuda_calls_behind(const char* entry) {
  const int fn = EntryIndex(entry);
  if (fn < 0) return -1;
  pthread_mutex_lock(&g.mu);
  const long long n = g.entries[fn].behind;
  pthread_mutex_unlock(&g.mu);
  return n;
}

FAKE_API long long fake_cuda_injected(const char* entry) {
  const int fn = EntryIndex(entry);
  if (fn < 0) return -1;
  pthread_mutex_lock(&g.mu);
  const long long n = g.entries[fn].injected;
  pthread_mutex_unlock(&g.mu);
  return n;
}

/* Zeroes the counters; faults already set keep their place relative to
 * the calls still to come. */
FAKE_API void fake_cuda_reset_counters(void) {
  pthread_mutex_lock(&g.mu);
  for (int i = 0; i < FN_COUNT; ++i) {
    EntryState* e = &g.entries[i];
    if (e->fail_until > e->calls) {
      e->fail_from -= e->calls;
      if (e->fail_until != LLONG_MAX) e->fail_until -= e->calls;
    } else {
      e->fail_from = e->fail_until = 0;
    }
    e->calls = 0;
    e->injected = 0;
    e->behind = 0;
  }
  g.violations = 0;
  g.last_violation[0] = '\0';
  pthread_mutex_unlock(&g.mu);
}

static long long CountOurMemfds(void) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == NULL) return -1;
  long long n = 0;
  const int own = dirfd(dir);
  for (struct dirent* d; (d = readdir(dir)) != NULL;) {
    const int fd = atoi(d->d_name);
    if (d->d_name[0] == '.' || fd == own) continue;
    n += IsOurMemfd(fd);
  }
  closedir(dir);
  return n;
}

FAKE_API long long fake_cuda_live(const char* what) {
  if (what == NULL) return -1;
  if (strcmp(what, "memfds") == 0) return CountOurMemfds();
  long long n = -1;
  pthread_mutex_lock(&g.mu);
  if (strcmp(what, "handles") == 0) n = (long long)g.handles.n;
  else if (strcmp(what, "allocations") == 0) n = (long long)g.allocations.n;
  else if (strcmp(what, "device_bytes") == 0) n = (long long)g.device_used;
  else if (strcmp(what, "mappings") == 0) n = (long long)g.mappings.n;
  else if (strcmp(what, "reservations") == 0) n = (long long)g.reservations.n;
  else if (strcmp(what, "host_allocations") == 0) n = (long long)g.host.n;
  else if (strcmp(what, "streams") == 0) n = (long long)g.streams.n;
  else if (strcmp(what, "events") == 0) n = (long long)g.events.n;
  else if (strcmp(what, "context_refs") == 0) n = g.primary.refs;
  else if (strcmp(what, "context_reclaimed") == 0) n = g.context_reclaimed;
  else if (strcmp(what, "queued") == 0) n = g.queued;
  pthread_mutex_unlock(&g.mu);
  return n;
}

/* The i-th (by address) of "mappings" or "reservations": 0 and its range,
 * or -1 past the last. */
FAKE_API int fake_cuda_range(const char* what, size_t i, unsigned long long* va, size_t* size) {
  int found = -1;
  pthread_mutex_lock(&g.mu);
  const Table* t = strcmp(what, "mappings") == 0 ? &g.mappings : strcmp(what, "reservations") == 0 ? &g.reservations
                                                                                                   : NULL;
  if (t != NULL && i < t->n) {
    *va = t->v[i].key;
    *size = t->v[i].bytes;
    found = 0;
  }
  pthread_mutex_unlock(&g.mu);
  return found;
}

FAKE_API long long fake_cuda_violations(void) {
  pthread_mutex_lock(&g.mu);
  const long long n = g.violations;
  pthread_mutex_unlock(&g.mu);
  return n;
}

/* Copies the last violation's message into buf; its length. */
FAKE_API int fake_cuda_last_violation(char* buf, size_t len) {
  pthread_mutex_lock(&g.mu);
  const int n = snprintf(buf, len, "%s", g.last_violation);
  pthread_mutex_unlock(&g.mu);
  return n;
}

FAKE_API int fake_cuda_set_option(const char* name, long long value) {
  int known = 1;
  pthread_mutex_lock(&g.mu);
  if (strcmp(name, "device_bytes") == 0) g.device_bytes = (size_t)value;
  else if (strcmp(name, "host_bytes") == 0) g.host_bytes = (size_t)value;
  else if (strcmp(name, "import_same_handle") == 0) g.import_same_handle = value != 0;
  else if (strcmp(name, "poison") == 0) g.poison = (int)value;
  else if (strcmp(name, "verbose") == 0) g.verbose = (int)value;
  else if (strcmp(name, "eager") == 0) g.eager = value != 0;
  else known = 0;
  pthread_mutex_unlock(&g.mu);
  return known ? 0 : -1;
}

/* ------------------------------------------------------------------------
 * Load time: the environment's faults and options, and fork handling. */

static CUresult ParseError(const char* text) {
  for (size_t i = 0; i < sizeof(kErrors) / sizeof(kErrors[0]); ++i)
    if (strcmp(kErrors[i].name, text) == 0) return kErrors[i].code;
  char* end = NULL;
  const long code = strtol(text, &end, 10);
  return end != text && *end == '\0' ? (CUresult)code : CUDA_ERROR_UNKNOWN;
}

/* FAKE_CUDA_FAIL="entry[:nth[:count[:error]]],..." */
static void ParseFaults(const char* spec) {
  char* copy = strdup(spec);
  if (copy == NULL) return;
  char* save = NULL;
  for (char* item = strtok_r(copy, ",", &save); item != NULL; item = strtok_r(NULL, ",", &save)) {
    char* fields[4] = {NULL, NULL, NULL, NULL};
    char* save_field = NULL;
    int n = 0;
    for (char* f = strtok_r(item, ":", &save_field); f != NULL && n < 4; f = strtok_r(NULL, ":", &save_field))
      fields[n++] = f;
    const int fn = EntryIndex(fields[0]);
    if (fn < 0) {
      fprintf(stderr, "fake libcuda: FAKE_CUDA_FAIL names no entry point: %s\n", fields[0] ? fields[0] : "");
      continue;
    }
    SetFault(fn, fields[1] ? atoll(fields[1]) : 1, fields[2] ? atoll(fields[2]) : 1,
             fields[3] ? ParseError(fields[3]) : CUDA_ERROR_UNKNOWN);
  }
  free(copy);
}

static void BeforeFork(void) { pthread_mutex_lock(&g.mu); }
static void AfterForkParent(void) { pthread_mutex_unlock(&g.mu); }
static void AfterForkChild(void) {
  /* As with the driver, a forked child cannot use what its parent set up. */
  if (g.initialized) g.forked = 1;
  pthread_mutex_unlock(&g.mu);
}

__attribute__((constructor)) static void Load(void) {
  const char* faults = getenv("FAKE_CUDA_FAIL");
  if (faults != NULL) ParseFaults(faults);
  const char* device = getenv("FAKE_CUDA_DEVICE_BYTES");
  if (device != NULL) g.device_bytes = (size_t)strtoull(device, NULL, 10);
  const char* host = getenv("FAKE_CUDA_HOST_BYTES");
  if (host != NULL) g.host_bytes = (size_t)strtoull(host, NULL, 10);
  const char* poison = getenv("FAKE_CUDA_POISON");
  if (poison != NULL) g.poison = atoi(poison);
  const char* verbose = getenv("FAKE_CUDA_VERBOSE");
  if (verbose != NULL) g.verbose = atoi(verbose);
  const char* eager = getenv("FAKE_CUDA_EAGER");
  if (eager != NULL) g.eager = atoi(eager) != 0;
  pthread_atfork(BeforeFork, AfterForkParent, AfterForkChild);
}
