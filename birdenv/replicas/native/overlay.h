/*
 * overlay.h: what the parts of the overlay VFS share: the constants, the per-file state of both
 * modes (a private page file, or shared pages) and the small helpers on them.
 *
 * The extension is one translation unit: overlay.c includes this header and then the parts in
 * order (overlay_file.c, overlay_pages.c, overlay_vfs.c, overlay_selftest.c), so every function
 * stays static, the compiler inlines the hot paths across parts, and the module exports only
 * PyInit__overlay. A part uses what the parts before it define.
 */
#ifndef BIRDENV_OVERLAY_H
#define BIRDENV_OVERLAY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sqlite3.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define OVL_BLK 512 /* the smallest SQLite page size: no read-modify-write for real pages */
#define OVL_HDR 64  /* header bytes at the start of P-ovl; the bitmap follows */
#define OVL_VERSION 1
#define GEN_UNKNOWN UINT64_MAX
#define STACK_BLOCKS 256

typedef sqlite3_int64 i64;

static const uint8_t OVL_MAGIC[8] = {'B', 'I', 'R', 'D', 'O', 'V', 'L', '1'};

typedef struct OvlFile {
  sqlite3_file base;    /* must be first */
  sqlite3_file *pReal;  /* default-VFS file (P for main dbs), stored right after this struct */
  sqlite3_vfs *pVfs;    /* our VFS (for its name) */
  i64 maxBytes;         /* cap on private data / journal / WAL bytes; 0 = none */
  /* main database only */
  int baseFd;           /* B, O_RDONLY, shared with the process's other sessions on B */
  int ovlFd;            /* P-ovl, or -1 (read-only session without one) */
  int readOnly;
  int lockLevel;
  int hdrDirty;         /* a change whose header write failed: retry on sync/unlock */
  uint64_t gen;         /* generation of the side-file state we hold in memory */
  i64 size;             /* logical file size */
  i64 baseLimit;        /* bytes of B still visible (shrinks on truncation, never grows) */
  i64 baseSize;         /* st_size of B at open (also recorded in the header) */
  uint8_t *bits;        /* block bitmap, capBytes long, bits >= nblocks(size) always clear */
  i64 capBytes;
  i64 nSet;             /* number of set bits = private data blocks */
  char *zOvl;           /* path of P-ovl */
  struct ShState *sh;   /* shared-pages sessions: the session's state (else NULL) */
  i64 mmapLimit;        /* SQLite's mmap_size: base pages below it may be read in place */
  const uint8_t *map;   /* the base's read-only map (see baseMap), once a fetch asked for it */
  i64 mapLen;
} OvlFile;

typedef struct OvlHdr {
  uint64_t gen;
  i64 size, baseLimit, baseSize;
} OvlHdr;

#define ORIG_VFS(v) ((sqlite3_vfs *)((v)->pAppData))

static i64 nblocks(i64 size) { return (size + OVL_BLK - 1) / OVL_BLK; }
static i64 imin(i64 a, i64 b) { return a < b ? a : b; }
static i64 imax(i64 a, i64 b) { return a > b ? a : b; }

/* ---------------------------------------------------------------- shared pages: state
 * (the store and its invariant are described in overlay_pages.c) */

#define NCLASS 8            /* unit sizes OVL_BLK << c, c = 0..7: 512 .. 65536 bytes */
#define GRP 8               /* blocks per entry of a session's map */
#define LOC_IDX_BITS 29     /* a location: (class << 29 | 512-byte index in the class file) + 1 */
#define LOC_MAX_IDX ((((uint32_t)1) << LOC_IDX_BITS) - 2)
#define STACK_LOCS 256

static uint32_t locMake(int cls, i64 idx) { return (((uint32_t)cls << LOC_IDX_BITS) | (uint32_t)idx) + 1; }
static int locClass(uint32_t loc) { return (int)((loc - 1) >> LOC_IDX_BITS); }
static i64 locIndex(uint32_t loc) { return (i64)((loc - 1) & ((((uint32_t)1) << LOC_IDX_BITS) - 1)); }

typedef struct PgClass {
  int fd;            /* the class's store file, -1 until first used */
  i64 unit;          /* bytes per slot */
  i64 nSlots, cap;   /* slots in the file (live or free); capacity of refs/hashes */
  uint32_t *refs;    /* per slot: blocks mapped to it, over all sessions */
  uint64_t *hashes;  /* per slot: content hash, valid while refs > 0 */
  i64 *freeSlots;     /* reused last in, first out; [0, nClean) have had their disk punched out */
  i64 nFree, capFree, nClean;
  uint64_t *idxHash; /* content index, open addressing: hash -> slot + 1 (0: empty) */
  uint32_t *idxSlot;
  i64 idxCap, idxLen;
} PgClass;

typedef struct PgStore {
  struct PgStore *next;
  char *zPrefix;
  int baseFd;
  dev_t baseDev;
  ino_t baseIno;
  i64 baseSize;
  int nStates; /* session states attached */
  pid_t owner; /* the process whose store this is; a forked child inherits a copy of it */
  pthread_mutex_t mu;
  PgClass cls[NCLASS];
  uint64_t nPuts, nShared; /* units stored, and those that found an identical stored unit */
  i64 nUnits, nBytes, nRefs; /* live slots, their bytes, and the blocks mapped to them */
  i64 dirtyBytes;            /* free slots whose disk has not been given back yet */
  i64 trimFloor;             /* ... given back past max(this, a quarter of the live bytes) */
} PgStore;

typedef struct ShGroup {
  i64 key; /* block / GRP, or -1 when the entry is empty */
  uint32_t loc[GRP];
} ShGroup;

/* One session's view, shared by every connection of this process to it. */
typedef struct ShState {
  struct ShState *next;
  char *zPath, *zMarker;
  dev_t markerDev;
  ino_t markerIno;
  PgStore *store;
  pthread_mutex_t mu;
  int nRef; /* open files, plus one while registered (findable by path) */
  i64 size, baseLimit, nMapped;
  ShGroup *groups; /* open addressing on key */
  i64 gCap, gLen;
} ShState;

#endif /* BIRDENV_OVERLAY_H */
