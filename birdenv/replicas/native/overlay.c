/*
 * birdenv.replicas.native._overlay: a copy-on-write page-overlay SQLite VFS.
 *
 * One session = a private sparse file P (same byte layout as the logical database), a side file
 * P-ovl (header + block bitmap) and a read-only base file B named by the `base=` URI parameter.
 * Block i of the logical file comes from P when bit i is set, else from B when it lies below the
 * "base limit" (which only ever shrinks, on truncation), else it reads as zeros.
 *
 * Design rules, each one load-bearing:
 *  - The VFS behaves exactly like a plain file whose every xWrite/xTruncate is persisted (to the
 *    OS page cache) before it returns.  SQLite's own journal/WAL protocol then gives crash safety:
 *    data blocks are written to P first, their bits second, the header (size, generation) last,
 *    so a SIGKILL at any point leaves a state that hot-journal rollback or WAL recovery repairs.
 *    Nothing is deferred to xSync/xUnlock, because with synchronous=OFF the journal is deleted
 *    before the write lock is released.
 *  - P carries the session's real POSIX locks: all locking and shared memory is delegated to a
 *    default-VFS ("unix") file opened on P.  We never open P with a raw fd (closing one would drop
 *    the process's POSIX locks on it).
 *  - Another connection to the same session may change P-ovl.  The header carries a generation
 *    number; it is checked (one 64-byte pread) whenever a file lock or a WAL shm lock is taken,
 *    and the bitmap is reloaded when it changed.  SQLite's locking guarantees nobody writes the
 *    blocks a reader uses while it holds those locks.
 *  - A write whose content equals the current view of a block with a clear bit is skipped: no
 *    private bytes for rewrites of identical pages, and a journal rollback (which only rewrites
 *    original content) can never fail on the maxbytes cap.
 *  - No global mutable state except the registered sqlite3_vfs structs, the table of shared
 *    base descriptors (under its own mutex): every session of a process on the same base reads
 *    it through one read-only descriptor, so a session costs no descriptor for its base; and the
 *    registry of shared-pages sessions and their page stores (under another).
 *
 * A session opened with `pages=<prefix>` keeps no private page file and no side file: its changed
 * pages live in a content-addressed page store shared by the process's sessions on the same base,
 * and its map of them in this process's memory (see overlay_pages.c). Its file P then only
 * carries its locks, and a marker P-shared says that its state lives in its owner's process.
 *
 * The code is split by job around one header (overlay.h), and compiled as this one translation
 * unit: overlay_file.c (private-file mode), overlay_pages.c (shared-pages mode), overlay_vfs.c (the
 * capped journal/WAL and the VFS), overlay_selftest.c (the fuzz self-test), and below, the Python
 * module.
 */
#include "overlay.h"

#include "overlay_file.c"
#include "overlay_pages.c"
#include "overlay_vfs.c"
#include "overlay_selftest.c"

/* ---------------------------------------------------------------- Python module */

static PyObject *py_register(PyObject *self, PyObject *args) {
  const char *name;
  if (!PyArg_ParseTuple(args, "s:register", &name)) return NULL;
  int rc = ovlRegister(name);
  if (rc == SQLITE_ERROR) {
    PyErr_Format(PyExc_RuntimeError, "a different SQLite VFS named %s is already registered", name);
    return NULL;
  }
  if (rc) {
    PyErr_Format(PyExc_RuntimeError, "sqlite3_vfs_register(%s) failed: %s", name,
                 sqlite3_errstr(rc));
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *py_libversion(PyObject *self, PyObject *noargs) {
  return PyUnicode_FromString(sqlite3_libversion());
}

static PyObject *py_selftest(PyObject *self, PyObject *args) {
  const char *vfs, *sess, *base, *pages = "";
  unsigned long long seed;
  long steps;
  char msg[256];
  const char *err;
  if (!PyArg_ParseTuple(args, "sssKl|s:_selftest", &vfs, &sess, &base, &seed, &steps, &pages))
    return NULL;
  Py_BEGIN_ALLOW_THREADS err = selftest(vfs, sess, base, pages, seed, steps, msg, sizeof msg);
  Py_END_ALLOW_THREADS if (err) {
    PyErr_SetString(PyExc_AssertionError, err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *py_release(PyObject *self, PyObject *args) {
  const char *path;
  int found;
  if (!PyArg_ParseTuple(args, "s:release", &path)) return NULL;
  Py_BEGIN_ALLOW_THREADS found = shRelease(path);
  Py_END_ALLOW_THREADS return PyBool_FromLong(found);
}

static PyObject *py_hold_base(PyObject *self, PyObject *args) {
  const char *path;
  int fd = -1, rc;
  i64 size;
  if (!PyArg_ParseTuple(args, "s:hold_base", &path)) return NULL;
  Py_BEGIN_ALLOW_THREADS errno = 0;
  rc = baseAcquire(path, &fd, &size);
  if (rc != SQLITE_OK && !errno) errno = EINVAL; /* there, but not a regular file */
  Py_END_ALLOW_THREADS if (rc != SQLITE_OK) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  return PyLong_FromLong(fd);
}

static PyObject *py_release_base(PyObject *self, PyObject *args) {
  int fd;
  if (!PyArg_ParseTuple(args, "i:release_base", &fd)) return NULL;
  Py_BEGIN_ALLOW_THREADS baseRelease(fd);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

typedef struct {
  char *zPrefix;
  long long sessions, units, bytes, refs;
  unsigned long long puts, shared;
} StoreFigures;

static PyObject *py_page_stores(PyObject *self, PyObject *noargs) {
  /* copied out under the locks, turned into Python objects after: building them may run a
   * finalizer that closes a connection, which takes these locks */
  StoreFigures *fig = NULL;
  Py_ssize_t n = 0, i;
  int oom = 0;
  pthread_mutex_lock(&gMu);
  for (PgStore *s = gStores; s; s = s->next) n += !inherited(s);
  if (n && !(fig = calloc((size_t)n, sizeof *fig))) oom = 1;
  i = 0;
  for (PgStore *s = gStores; s && !oom; s = s->next) {
    if (inherited(s)) continue;
    pthread_mutex_lock(&s->mu);
    fig[i].zPrefix = strdup(s->zPrefix);
    fig[i].sessions = s->nStates;
    fig[i].units = s->nUnits;
    fig[i].bytes = s->nBytes;
    fig[i].refs = s->nRefs;
    fig[i].puts = s->nPuts;
    fig[i].shared = s->nShared;
    pthread_mutex_unlock(&s->mu);
    oom = !fig[i++].zPrefix;
  }
  pthread_mutex_unlock(&gMu);
  PyObject *out = oom ? NULL : PyList_New(0);
  for (i = 0; i < n && out; i++) {
    PyObject *d = Py_BuildValue(
        "{s:s,s:L,s:L,s:L,s:L,s:K,s:K}", "pages", fig[i].zPrefix, "sessions", fig[i].sessions,
        "units", fig[i].units, "stored_bytes", fig[i].bytes, "mapped_bytes",
        fig[i].refs * (long long)OVL_BLK, "writes", fig[i].puts, "shared_writes", fig[i].shared);
    if (!d || PyList_Append(out, d) < 0) Py_CLEAR(out);
    Py_XDECREF(d);
  }
  for (i = 0; i < n && fig; i++) free(fig[i].zPrefix);
  free(fig);
  if (oom) return PyErr_NoMemory();
  return out;
}

static PyObject *py_hash_cost(PyObject *self, PyObject *args) {
  long long unit, iterations;
  if (!PyArg_ParseTuple(args, "LL:_hash_cost", &unit, &iterations)) return NULL;
  if (unit < 32 || unit % 32 || unit > (1 << 20) || iterations < 1) {
    PyErr_SetString(PyExc_ValueError, "unit must be a multiple of 32 up to 1 MiB, iterations >= 1");
    return NULL;
  }
  uint8_t *buf = malloc((size_t)unit);
  if (!buf) return PyErr_NoMemory();
  uint64_t x = 0x2545F4914F6CDD1DULL, acc = 0;
  for (long long i = 0; i < unit; i++) buf[i] = (uint8_t)xorshift(&x);
  struct timespec t0, t1;
  Py_BEGIN_ALLOW_THREADS clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long long i = 0; i < iterations; i++) {
    buf[i % unit] ^= (uint8_t)i; /* a different page each time */
    acc ^= pageHash(buf, unit);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  Py_END_ALLOW_THREADS free(buf);
  volatile uint64_t sink = acc;
  (void)sink;
  return PyFloat_FromDouble(((double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9) /
                            (double)iterations);
}

static PyMethodDef methods[] = {
    {"register", py_register, METH_VARARGS,
     "register(name) -> None: register the overlay VFS under name (idempotent, never default)."},
    {"libversion", py_libversion, METH_NOARGS,
     "libversion() -> str: sqlite3_libversion() of the library this module is linked against."},
    {"release", py_release, METH_VARARGS,
     "release(path) -> bool: forget the shared-pages session at path (its real path), releasing "
     "its pages once no connection uses it; False when there was none."},
    {"hold_base", py_hold_base, METH_VARARGS,
     "hold_base(path) -> int: take a reference to this process's shared descriptor of the base "
     "at path (and to its map, once made); the int is for release_base."},
    {"release_base", py_release_base, METH_VARARGS,
     "release_base(handle) -> None: drop a reference taken by hold_base."},
    {"page_stores", py_page_stores, METH_NOARGS,
     "page_stores() -> list[dict]: figures of this process's shared page stores."},
    {"_selftest", py_selftest, METH_VARARGS,
     "_selftest(vfs, session_path, base_path, seed, steps, pages=''): fuzz the VFS file methods "
     "of two sessions (sharing a page store when pages is set) against in-memory mirrors; "
     "raises AssertionError on the first difference."},
    {"_hash_cost", py_hash_cost, METH_VARARGS,
     "_hash_cost(unit, iterations) -> float: seconds per content hash of a unit-byte page."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_overlay",
    "Copy-on-write page-overlay SQLite VFS (see birdenv.replicas.overlay).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__overlay(void) {
  PyObject *m = PyModule_Create(&moduledef);
  if (m && PyModule_AddIntConstant(m, "BLOCK_SIZE", OVL_BLK) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
