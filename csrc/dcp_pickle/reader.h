/* reader.h: the values, the reader's state and what machine.c and summary.c share.

   A bounded reader of the pickles DCP writes as `.metadata`: the summary dcp_summary.summarize gives, or None.

   Why native: CPython's C unpickler is unsafe on a hostile file in this process (a forged memo index makes it
   allocate and zero gigabytes, keys sharing one hash value make filling a dict quadratic), so dcp_metadata runs it
   in a limited child; that, and turning its records into the summary in Python, takes longer than DCP's own
   read_metadata. This reader runs a strict subset of the pickle machine and writes the summary in one pass.

   It either gives exactly what summarize would give from the records of the C unpickler, or declines (returns
   None), and the caller reads the file the general way, which also names whatever is wrong with it. It declines on
   any opcode, global, call, key or layout outside what DCP writes. Bounds, whatever the input:
   - every read is checked against the buffer's end;
   - the memo only grows by one (MEMOIZE, or PUT of the next index), and GET names a slot already set;
   - each opcode makes at most one value, and containers only gain values popped from the stack; the values' memory
     is counted against `memory`;
   - nothing is hashed here: dict keys are strings (hashed by Python, whose string hash is salted) or records
     (by identity, each a key once);
   - records hold at most MAX_FIELDS fields, the summary's walk is bounded by the budget (declining past half of
     it, where summarize would raise) and nests at most MAX_DEPTH deep. */

#ifndef TENSORMORPH_DCP_PICKLE_READER_H
#define TENSORMORPH_DCP_PICKLE_READER_H


#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_FIELDS 64
#define MAX_DEPTH 100
#define BLOCK_VALUES 4096
#define ARENA_BYTES (1 << 20)
#define SMALL_INTS 256
#define MAX_PATHS 16        /* path joins per file: DCP pickles one (its checkpoint_id) */
#define MAX_PATH_PARTS 256  /* parts of one path */
#define UNIT_BYTES 64       /* memory counted per unit of the walk's budget: the Python objects it makes */
#define MAX_PICKLE_BYTES ((Py_ssize_t)1 << 31)  /* counts of items are 32-bit: fewer than the input's bytes */

typedef enum { V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_PYSTR, V_TUPLE, V_LIST, V_DICT, V_RECORD, V_GLOBAL,
               V_DTYPE } Kind;
/* the allowlist's codes, as dcp_metadata._NATIVE_CODES and _NATIVE_CALLS give them (keep the two alike);
   G_PATH's argument is the Python function that joins a path's parts */
enum { G_RECORD, G_DTYPE, G_CONST, G_TUPLE, G_STR, G_INT, G_OTHER, G_PATH };

typedef struct Val Val;
typedef struct { Val **items; uint32_t len, cap; } Vec;  /* items in the reader's arena; fewer items than bytes */

struct Val {
    unsigned char kind;
    unsigned char keyed;         /* a record already used as a dict key */
    unsigned char state_record;  /* a record whose state may be other than a dict (STATE_RECORDS) */
    union {
        int64_t i;
        double f;
        struct { const char *p; Py_ssize_t n; PyObject *decoded; } s;  /* V_STR: UTF-8 bytes inside the pickle */
        PyObject *o;  /* V_PYSTR, V_DTYPE's torch name: borrowed from the allowlist, or held in Reader.owned */
        Vec v;                                      /* tuple, list; dict: key, value, key, value, ... */
        struct { PyObject *kind; Vec fields; } r;  /* fields: name, value, name, value, ... */
        struct { int code; PyObject *arg; } g;
    } u;
};

typedef struct Block { struct Block *next; Py_ssize_t used; Val vals[BLOCK_VALUES]; } Block;
typedef struct Chunk { struct Chunk *next; size_t used, size; char bytes[]; } Chunk;  /* the items' arena */

typedef struct {
    const unsigned char *p, *end;
    const unsigned char *frame_end;  /* the open frame's end (NULL: none) */
    int paths;                       /* path joins so far */
    Block *blocks;
    Chunk *arena;
    Val **stack, **memo;
    Py_ssize_t nstack, capstack, nmemo, capmemo;
    Py_ssize_t *marks, nmarks, capmarks;
    Py_ssize_t memory, memory_limit;
    PyObject *allowlist, *state_kinds;
    PyObject *owned;      /* strings made here (joined paths), released with the reader */
    int64_t used, limit;  /* the walk's budget units */
    int depth;
    int declined;         /* set with no Python error: the caller reads the file the general way */
} Reader;

#if defined(__GNUC__)
#pragma GCC visibility push(hidden)  /* names shared by the two files bind inside the module, never to another's */
#endif

extern Val NONE_VAL;
extern PyObject *STATE_NAME, *ARGS_NAME;  /* "state", "args": interned at import */

#define DECLINE(r) do { (r)->declined = 1; return NULL; } while (0)
#define DECLINE_INT(r) do { (r)->declined = 1; return -1; } while (0)

int machine_init(void);                          /* at import */
int charge_memory(Reader *r, Py_ssize_t bytes);  /* counts against Reader.memory_limit; declines past it */
void free_reader(Reader *r);
int is_text(Val *v);
PyObject *text(Reader *r, Val *v);               /* a new reference, or NULL */
Py_ssize_t text_length(Val *v);
Val *run(Reader *r);                             /* the value STOP leaves, or NULL (declined or an error) */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
