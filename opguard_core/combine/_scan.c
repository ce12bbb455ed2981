/* The combine's per-callsite hot path in C (performance.md, "Folding from the bytes").
 *
 * ``StackTable`` interns stacks (sequences of global frame ids) as dense ids, stored
 * end to end in one array of uint32 with an open-addressing hash table over them: a
 * stack seen before is found without building a tuple or a Python int per frame.
 *
 * ``find_callsites(data)`` finds where the value of a document's top-level
 * ``callsites`` starts, skipping the members before it without decoding them, so the
 * header can be decoded by msgspec from the bytes before it alone.
 *
 * ``scan_callsites(data, offset, closes, remap, table, apis, ops, roles, dtypes,
 * require_role)`` reads the ``callsites`` array at ``offset`` straight from the JSON
 * bytes (with ``closes``, the document's closing brace must follow it): every stack's
 * frame ids are mapped through ``remap`` (the file's frame ids -> the accumulator's,
 * uint32 bytes) and interned in ``table``, api, op, role and dtype are interned in the
 * dicts ``apis``/``ops``/``roles``/``dtypes``, and it returns ``(keys, counts, total)``:
 * one key ``(stack id, api, op, role, dtype)`` and one count per callsite, in file
 * order, and the sum of the counts; a callsite without a role has its raw stream (an
 * int, 0 when absent) in the role's place, for the caller to map (a version 1 or 2
 * file), and with ``require_role`` the scan gives up on it; one without a dtype has
 * None there. Roles and dtypes are interned as they are written: the caller checks the
 * (few) names its dicts then hold against their patterns and reads the file with
 * msgspec where one is not a name. It accepts only the plain shape a tracer writes (the
 * keys ``stack``, ``api``, ``op``, ``stream``, ``role``, ``dtype``, ``count``, each at
 * most once; strings without escapes; ids within ``remap``; integers of at most 18
 * digits) and returns None for anything else, without raising: the caller then decodes
 * the file with msgspec (the reference path), which explains any error. A None may
 * leave stacks, roles and dtypes interned that no key refers to; nothing else is
 * touched.
 *
 * ``site_order(keys, canonical)`` sorts a combine's sites into canonical order and
 * ``merge_packed`` folds a helper's partial in.
 *
 * ``fold_rank(sites, keys, counts, mask, collective_apis, max_distinct)`` is the
 * one-rank loop of ``TraceAccumulator._fold_file``, which stays the reference, with
 * ``add_rank_count``'s per-rank statistics for a count that differs.
 *
 * The pure-Python ``PyStackTable`` (opguard_core/combine/stack_table.py) is the table's
 * reference. CPython >= 3.11; the package works without this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- StackTable */

typedef struct {
    PyObject_HEAD
    uint32_t *flat;      /* every stack's frame ids, end to end */
    size_t flat_len, flat_cap;
    uint64_t *starts;    /* stack i is flat[starts[i] : starts[i + 1]] */
    uint64_t *hashes;    /* hash of stack i */
    size_t count, cap;   /* stacks held; room in starts (cap + 1) and hashes */
    uint32_t *slots;     /* hash table: stack id + 1, 0 when empty */
    size_t mask;         /* number of slots - 1 (a power of two) */
} StackTable;

/* Room for ``n`` ids in ``*buffer`` (``*cap`` now), doubling; -1 with MemoryError set. */
static int
reserve_ids(uint32_t **buffer, size_t *cap, size_t n)
{
    if (n <= *cap)
        return 0;
    size_t size = *cap ? *cap : 256;
    while (size < n)
        size *= 2;
    uint32_t *grown = PyMem_Realloc(*buffer, size * sizeof(uint32_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *buffer = grown;
    *cap = size;
    return 0;
}

static uint64_t
hash_ids(const uint32_t *ids, size_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ n;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ ids[i]) * 0xFF51AFD7ED558CCDULL;
        h ^= h >> 29;
    }
    return h;
}

static int
table_grow_slots(StackTable *t)
{
    size_t size = (t->mask + 1) * 2;
    uint32_t *slots = PyMem_Calloc(size, sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t id = 0; id < t->count; id++) {
        size_t at = (size_t)t->hashes[id] & (size - 1);
        while (slots[at])
            at = (at + 1) & (size - 1);
        slots[at] = (uint32_t)(id + 1);
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->mask = size - 1;
    return 0;
}

/* The id of ``ids[:n]``, interned if new; -1 with an exception set on failure. */
static Py_ssize_t
table_intern(StackTable *t, const uint32_t *ids, size_t n)
{
    uint64_t h = hash_ids(ids, n);
    size_t at = (size_t)h & t->mask;
    uint32_t slot;
    while ((slot = t->slots[at]) != 0) {
        size_t id = slot - 1;
        uint64_t start = t->starts[id];
        if (t->hashes[id] == h && t->starts[id + 1] - start == n &&
            memcmp(t->flat + start, ids, n * sizeof(uint32_t)) == 0)
            return (Py_ssize_t)id;
        at = (at + 1) & t->mask;
    }
    if (t->count >= UINT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "too many distinct stacks");
        return -1;
    }
    if (t->count == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 1024;
        uint64_t *starts = PyMem_Realloc(t->starts, (cap + 1) * sizeof(uint64_t));
        if (starts == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->starts = starts;
        uint64_t *hashes = PyMem_Realloc(t->hashes, cap * sizeof(uint64_t));
        if (hashes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        t->hashes = hashes;
        t->cap = cap;
    }
    if (reserve_ids(&t->flat, &t->flat_cap, t->flat_len + n) < 0)
        return -1;
    size_t id = t->count;
    if (n)
        memcpy(t->flat + t->flat_len, ids, n * sizeof(uint32_t));
    t->flat_len += n;
    t->hashes[id] = h;
    t->starts[id + 1] = t->flat_len;
    t->count++;
    t->slots[at] = (uint32_t)(id + 1);
    if (t->count * 2 > t->mask + 1 && table_grow_slots(t) < 0) {
        t->count--; /* keep the table consistent: forget the stack just added */
        t->flat_len -= n;
        return -1;
    }
    return (Py_ssize_t)id;
}

static StackTable *
table_alloc(PyTypeObject *type)
{
    StackTable *t = (StackTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->starts = PyMem_Calloc(1, sizeof(uint64_t));
    t->slots = PyMem_Calloc(1024, sizeof(uint32_t));
    if (t->starts == NULL || t->slots == NULL) {
        Py_DECREF(t);
        PyErr_NoMemory();
        return NULL;
    }
    t->mask = 1023;
    return t;
}

static PyObject *
table_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "StackTable() takes no arguments");
        return NULL;
    }
    return (PyObject *)table_alloc(type);
}

static void
table_dealloc(StackTable *t)
{
    PyMem_Free(t->flat);
    PyMem_Free(t->starts);
    PyMem_Free(t->hashes);
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
table_len(StackTable *t)
{
    return (Py_ssize_t)t->count;
}

static PyObject *
table_item(StackTable *t, Py_ssize_t id)
{
    if (id < 0 || (size_t)id >= t->count) {
        PyErr_SetString(PyExc_IndexError, "stack id out of range");
        return NULL;
    }
    uint64_t start = t->starts[id], n = t->starts[id + 1] - start;
    PyObject *stack = PyTuple_New((Py_ssize_t)n);
    if (stack == NULL)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromUnsignedLong(t->flat[start + i]);
        if (value == NULL) {
            Py_DECREF(stack);
            return NULL;
        }
        PyTuple_SET_ITEM(stack, (Py_ssize_t)i, value);
    }
    return stack;
}

/* Frame ids of a Python sequence of ints into ``*buffer`` (grown as needed). */
static Py_ssize_t
ids_from_sequence(PyObject *seq, uint32_t **buffer, size_t *cap)
{
    PyObject *fast = PySequence_Fast(seq, "a stack must be a sequence of frame ids");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (reserve_ids(buffer, cap, (size_t)n) < 0) {
        Py_DECREF(fast);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long value = PyLong_AsUnsignedLong(items[i]);
        if (value == (unsigned long)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (value > UINT32_MAX) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_OverflowError, "frame id too large");
            return -1;
        }
        (*buffer)[i] = (uint32_t)value;
    }
    Py_DECREF(fast);
    return n;
}

static PyObject *
table_intern_py(StackTable *t, PyObject *stack)
{
    uint32_t *buffer = NULL;
    size_t cap = 0;
    Py_ssize_t n = ids_from_sequence(stack, &buffer, &cap);
    if (n < 0) {
        PyMem_Free(buffer);
        return NULL;
    }
    Py_ssize_t id = table_intern(t, buffer, (size_t)n);
    PyMem_Free(buffer);
    return id < 0 ? NULL : PyLong_FromSsize_t(id);
}

/* absorb(other, remap): intern every stack of ``other`` with each frame id i replaced
 * by remap[i] (kept when remap is None); return the new ids as a list, by old id. */
static PyObject *
table_absorb(StackTable *t, PyObject *args)
{
    StackTable *other;
    PyObject *remap_obj;
    if (!PyArg_ParseTuple(args, "O!O", Py_TYPE(t), &other, &remap_obj))
        return NULL;
    uint32_t *remap = NULL, *buffer = NULL;
    size_t remap_len = 0, cap = 0;
    PyObject *result = NULL;
    if (remap_obj != Py_None) {
        Py_ssize_t n = ids_from_sequence(remap_obj, &remap, &remap_len);
        if (n < 0)
            goto done;
        remap_len = (size_t)n;
    }
    result = PyList_New((Py_ssize_t)other->count);
    if (result == NULL)
        goto done;
    for (size_t id = 0; id < other->count; id++) {
        uint64_t start = other->starts[id], n = other->starts[id + 1] - start;
        const uint32_t *ids = other->flat + start;
        if (remap_obj != Py_None) {
            if (reserve_ids(&buffer, &cap, n) < 0) {
                Py_CLEAR(result);
                goto done;
            }
            for (uint64_t i = 0; i < n; i++) {
                if (other->flat[start + i] >= remap_len) {
                    PyErr_SetString(PyExc_IndexError, "frame id out of range of remap");
                    Py_CLEAR(result);
                    goto done;
                }
                buffer[i] = remap[other->flat[start + i]];
            }
            ids = buffer;
        }
        Py_ssize_t new_id = table_intern(t, ids, n);
        PyObject *value = new_id < 0 ? NULL : PyLong_FromSsize_t(new_id);
        if (value == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)id, value);
    }
done:
    PyMem_Free(remap);
    PyMem_Free(buffer);
    return result;
}

/* Pickled as (flat ids, lengths), both native uint32 bytes, rebuilt by ``from_flat``. */
static PyObject *
table_flat(StackTable *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *lengths = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(t->count * sizeof(uint32_t)));
    if (lengths == NULL)
        return NULL;
    uint32_t *out = (uint32_t *)PyBytes_AS_STRING(lengths);
    for (size_t id = 0; id < t->count; id++)
        out[id] = (uint32_t)(t->starts[id + 1] - t->starts[id]);
    PyObject *flat = PyBytes_FromStringAndSize((const char *)t->flat,
                                               (Py_ssize_t)(t->flat_len * sizeof(uint32_t)));
    if (flat == NULL) {
        Py_DECREF(lengths);
        return NULL;
    }
    return Py_BuildValue("(NN)", flat, lengths);
}

/* canonical(new_id) -> list: for every stack id, (its ids through new_id as big-endian
 * uint32 bytes, the same ids as a tuple); the tuple holds new_id's own int objects */
static PyObject *
table_canonical(StackTable *t, PyObject *new_id)
{
    if (!PyList_Check(new_id)) {
        PyErr_SetString(PyExc_TypeError, "StackTable.canonical: new_id must be a list");
        return NULL;
    }
    Py_ssize_t frames = PyList_GET_SIZE(new_id);
    uint32_t *mapped = PyMem_Malloc((size_t)(frames ? frames : 1) * sizeof(uint32_t));
    PyObject *out = PyList_New((Py_ssize_t)t->count);
    if (mapped == NULL || out == NULL) {
        PyMem_Free(mapped);
        Py_XDECREF(out);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < frames; i++) {
        long value = PyLong_AsLong(PyList_GET_ITEM(new_id, i));
        if (value == -1 && PyErr_Occurred())
            goto fail;
        if (value < 0 || (unsigned long)value > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "StackTable.canonical: an id out of range");
            goto fail;
        }
        mapped[i] = (uint32_t)value;
    }
    /* every tuple first, then the sort keys and the pairs: the keys and the pairs go
     * once the result is built, the tuples stay with it; made apart, the ones that go
     * leave whole arenas free (given back) instead of a free pool beside each tuple's */
    for (size_t id = 0; id < t->count; id++) {
        const uint32_t *ids = t->flat + t->starts[id];
        Py_ssize_t n = (Py_ssize_t)(t->starts[id + 1] - t->starts[id]);
        PyObject *stack = PyTuple_New(n);
        if (stack == NULL)
            goto fail;
        PyList_SET_ITEM(out, (Py_ssize_t)id, stack); /* the pair takes its place below */
        for (Py_ssize_t j = 0; j < n; j++) {
            if ((Py_ssize_t)ids[j] >= frames) {
                PyErr_SetString(PyExc_IndexError, "StackTable.canonical: frame id out of range");
                goto fail;
            }
            PyTuple_SET_ITEM(stack, j, Py_NewRef(PyList_GET_ITEM(new_id, ids[j])));
        }
    }
    for (size_t id = 0; id < t->count; id++) {
        const uint32_t *ids = t->flat + t->starts[id];
        Py_ssize_t n = (Py_ssize_t)(t->starts[id + 1] - t->starts[id]);
        PyObject *stack = PyList_GET_ITEM(out, (Py_ssize_t)id);
        PyObject *key = PyBytes_FromStringAndSize(NULL, n * 4);
        PyObject *pair = key ? PyTuple_Pack(2, key, stack) : NULL;
        Py_XDECREF(key);
        if (pair == NULL)
            goto fail;
        PyList_SET_ITEM(out, (Py_ssize_t)id, pair); /* the list's reference to the tuple */
        Py_DECREF(stack);                          /* is now the pair's */
        unsigned char *bytes = (unsigned char *)PyBytes_AS_STRING(key);
        for (Py_ssize_t j = 0; j < n; j++) {
            uint32_t value = mapped[ids[j]];
            bytes[4 * j] = (unsigned char)(value >> 24);
            bytes[4 * j + 1] = (unsigned char)(value >> 16);
            bytes[4 * j + 2] = (unsigned char)(value >> 8);
            bytes[4 * j + 3] = (unsigned char)value;
        }
    }
    PyMem_Free(mapped);
    return out;
fail:
    PyMem_Free(mapped);
    Py_DECREF(out);
    return NULL;
}

static PyObject *table_from_flat(PyObject *cls, PyObject *args);

static PyObject *
table_reduce(StackTable *t, PyObject *Py_UNUSED(ignored))
{
    PyObject *flat = table_flat(t, NULL);
    if (flat == NULL)
        return NULL;
    PyObject *builder = PyObject_GetAttrString((PyObject *)Py_TYPE(t), "from_flat");
    if (builder == NULL) {
        Py_DECREF(flat);
        return NULL;
    }
    return Py_BuildValue("(NN)", builder, flat);
}

static PyMethodDef table_methods[] = {
    {"intern", (PyCFunction)table_intern_py, METH_O,
     "intern(stack) -> id: the id of a sequence of frame ids, added if new."},
    {"absorb", (PyCFunction)table_absorb, METH_VARARGS,
     "absorb(other, remap) -> list: intern other's stacks (frame ids through remap, "
     "unless None); their new ids, by old id."},
    {"canonical", (PyCFunction)table_canonical, METH_O,
     "canonical(new_id) -> list: per stack id, (big-endian uint32 bytes, tuple) of its "
     "frame ids through new_id."},
    {"flat", (PyCFunction)table_flat, METH_NOARGS,
     "flat() -> (ids, lengths): every stack end to end and their lengths, uint32 bytes."},
    {"from_flat", (PyCFunction)table_from_flat, METH_VARARGS | METH_CLASS,
     "from_flat(ids, lengths) -> StackTable: the inverse of flat()."},
    {"__reduce__", (PyCFunction)table_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods table_as_sequence = {
    .sq_length = (lenfunc)table_len,
    .sq_item = (ssizeargfunc)table_item,
};

static PyTypeObject StackTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "opguard_core.combine._scan.StackTable",
    .tp_basicsize = sizeof(StackTable),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_as_sequence = &table_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Stacks (sequences of frame ids) interned as dense ids.",
    .tp_methods = table_methods,
    .tp_new = table_new,
};

static PyObject *
table_from_flat(PyObject *cls, PyObject *args)
{
    Py_buffer flat, lengths;
    if (!PyArg_ParseTuple(args, "y*y*", &flat, &lengths))
        return NULL;
    PyObject *result = NULL;
    StackTable *t = NULL;
    if (flat.len % sizeof(uint32_t) || lengths.len % sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError, "StackTable.from_flat: not uint32 arrays");
        goto done;
    }
    t = table_alloc((PyTypeObject *)cls);
    if (t == NULL)
        goto done;
    const uint32_t *ids = flat.buf, *lens = lengths.buf;
    size_t n_ids = (size_t)flat.len / sizeof(uint32_t), used = 0;
    for (Py_ssize_t i = 0; i < lengths.len / (Py_ssize_t)sizeof(uint32_t); i++) {
        if (lens[i] > n_ids - used) {
            PyErr_SetString(PyExc_ValueError, "StackTable.from_flat: lengths exceed ids");
            goto done;
        }
        if (table_intern(t, ids + used, lens[i]) != i) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "StackTable.from_flat: a stack twice");
            goto done;
        }
        used += lens[i];
    }
    result = (PyObject *)t;
    t = NULL;
done:
    Py_XDECREF(t);
    PyBuffer_Release(&flat);
    PyBuffer_Release(&lengths);
    return result;
}

/* ------------------------------------------------------------- scan_callsites */

typedef struct {
    const char *p, *end;
} Cursor;

static inline void
skip_ws(Cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t'))
        c->p++;
}

static inline int
expect(Cursor *c, char ch)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* After a member: 1 past a ',', 0 past ``close``, -1 for anything else. */
static inline int
comma_or(Cursor *c, char close)
{
    skip_ws(c);
    if (c->p < c->end && *c->p == ',') {
        c->p++;
        return 1;
    }
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 0;
    }
    return -1;
}

/* A string without escapes or control characters: [*start, *start + *len). */
static inline int
read_string(Cursor *c, const char **start, Py_ssize_t *len)
{
    skip_ws(c);
    if (c->p >= c->end || *c->p != '"')
        return 0;
    const char *s = ++c->p;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *start = s;
            *len = c->p - s;
            c->p++;
            return 1;
        }
        if (ch == '\\' || ch < 0x20)
            return 0;
        c->p++;
    }
    return 0;
}

/* A JSON integer of at most 18 digits (no fraction, exponent or leading zero). */
static inline int
read_int(Cursor *c, int allow_negative, int64_t *out)
{
    skip_ws(c);
    int negative = 0;
    if (allow_negative && c->p < c->end && *c->p == '-') {
        negative = 1;
        c->p++;
    }
    const char *s = c->p;
    int64_t value = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        value = value * 10 + (*c->p - '0');
        c->p++;
    }
    Py_ssize_t digits = c->p - s;
    if (digits == 0 || digits > 18 || (digits > 1 && *s == '0'))
        return 0;
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E'))
        return 0;
    *out = negative ? -value : value;
    return 1;
}

#define CACHE_SIZE 256

typedef struct {
    const char *bytes; /* into the scanned buffer */
    Py_ssize_t len;
    PyObject *value;   /* borrowed from the intern dict */
} CacheEntry;

/* The interned str of bytes [s, s + n): a small cache by content, then the dict. */
static PyObject *
intern_string(CacheEntry *cache, PyObject *table, const char *s, Py_ssize_t n)
{
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ULL;
    CacheEntry *entry = &cache[(h ^ (h >> 32)) & (CACHE_SIZE - 1)];
    if (entry->value != NULL && entry->len == n && memcmp(entry->bytes, s, (size_t)n) == 0)
        return entry->value;
    PyObject *text = PyUnicode_DecodeUTF8(s, n, NULL);
    if (text == NULL)
        return NULL;
    PyObject *interned = PyDict_SetDefault(table, text, text);
    Py_DECREF(text);
    if (interned == NULL)
        return NULL;
    entry->bytes = s;
    entry->len = n;
    entry->value = interned;
    return interned;
}

enum {
    HAS_STACK = 1,
    HAS_API = 2,
    HAS_OP = 4,
    HAS_STREAM = 8,
    HAS_COUNT = 16,
    HAS_ROLE = 32,
    HAS_DTYPE = 64,
};

/* Past one JSON value (not checked: the decoder checks the text around the callsites);
 * 0 if the text ends first. Strings skip their escapes; brackets count depth. */
static int
skip_value(Cursor *c)
{
    int depth = 0;
    skip_ws(c);
    do {
        if (c->p >= c->end)
            return 0;
        char ch = *c->p++;
        if (ch == '"') {
            while (c->p < c->end && *c->p != '"')
                c->p += (*c->p == '\\') ? 2 : 1;
            if (c->p >= c->end)
                return 0;
            c->p++;
        }
        else if (ch == '[' || ch == '{')
            depth++;
        else if (ch == ']' || ch == '}')
            depth--;
        else if (depth == 0) { /* a scalar: up to the next delimiter */
            while (c->p < c->end && !strchr(",]} \n\r\t", *c->p))
                c->p++;
        }
    } while (depth > 0);
    return depth == 0;
}

/* find_callsites(data) -> offset or None: where the value of the top-level key
 * "callsites" starts, the members before it skipped (not decoded). */
static PyObject *
find_callsites(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    Cursor c = {data.buf, (const char *)data.buf + data.len};
    PyObject *result = NULL;
    if (!expect(&c, '{'))
        goto done;
    for (;;) {
        const char *key;
        Py_ssize_t key_len;
        if (!read_string(&c, &key, &key_len) || !expect(&c, ':'))
            goto done;
        skip_ws(&c);
        if (key_len == 9 && memcmp(key, "callsites", 9) == 0) {
            result = PyLong_FromSsize_t(c.p - (const char *)data.buf);
            goto done;
        }
        if (!skip_value(&c) || !expect(&c, ','))
            goto done;
    }
done:
    PyBuffer_Release(&data);
    return result == NULL && !PyErr_Occurred() ? Py_NewRef(Py_None) : result;
}

static PyObject *
scan_callsites(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer data, remap_buf;
    Py_ssize_t offset;
    int closes;
    StackTable *table;
    PyObject *apis, *ops, *roles, *dtypes;
    int require_role;
    if (!PyArg_ParseTuple(args, "y*npy*O!O!O!O!O!p", &data, &offset, &closes, &remap_buf,
                          &StackTableType, &table, &PyDict_Type, &apis, &PyDict_Type, &ops,
                          &PyDict_Type, &roles, &PyDict_Type, &dtypes, &require_role))
        return NULL;
    const uint32_t *remap = remap_buf.buf;
    size_t n_frames = (size_t)remap_buf.len / sizeof(uint32_t);
    CacheEntry api_cache[CACHE_SIZE] = {{0}}, op_cache[CACHE_SIZE] = {{0}};
    CacheEntry role_cache[CACHE_SIZE] = {{0}}, dtype_cache[CACHE_SIZE] = {{0}};
    uint32_t *ids = NULL;
    size_t ids_cap = 0;
    int64_t total = 0;
    PyObject *keys = PyList_New(0), *counts = PyList_New(0), *result = NULL;
    if (keys == NULL || counts == NULL)
        goto fail;
    if (offset < 0 || offset > data.len)
        goto fallback;
    Cursor c = {(const char *)data.buf + offset, (const char *)data.buf + data.len};
    if (!expect(&c, '['))
        goto fallback;
    skip_ws(&c);
    if (c.p < c.end && *c.p == ']') {
        c.p++;
        goto finish;
    }
    for (;;) {
        if (!expect(&c, '{'))
            goto fallback;
        int seen = 0;
        size_t n_ids = 0;
        PyObject *api = Py_None, *op = NULL, *role = NULL, *dtype = Py_None;
        int64_t stream = 0, count = 0;
        skip_ws(&c);
        if (c.p < c.end && *c.p == '}') {
            goto fallback; /* no op, stack or count */
        }
        for (;;) {
            const char *key;
            Py_ssize_t key_len;
            if (!read_string(&c, &key, &key_len) || !expect(&c, ':'))
                goto fallback;
            int field = 0;
            if (key_len == 5 && memcmp(key, "stack", 5) == 0)
                field = HAS_STACK;
            else if (key_len == 3 && memcmp(key, "api", 3) == 0)
                field = HAS_API;
            else if (key_len == 2 && memcmp(key, "op", 2) == 0)
                field = HAS_OP;
            else if (key_len == 6 && memcmp(key, "stream", 6) == 0)
                field = HAS_STREAM;
            else if (key_len == 4 && memcmp(key, "role", 4) == 0)
                field = HAS_ROLE;
            else if (key_len == 5 && memcmp(key, "dtype", 5) == 0)
                field = HAS_DTYPE;
            else if (key_len == 5 && memcmp(key, "count", 5) == 0)
                field = HAS_COUNT;
            if (field == 0 || (seen & field))
                goto fallback; /* another field, or one twice: msgspec decides */
            seen |= field;
            if (field == HAS_STACK) {
                if (!expect(&c, '['))
                    goto fallback;
                skip_ws(&c);
                if (c.p < c.end && *c.p == ']') {
                    c.p++;
                }
                else {
                    for (;;) {
                        int64_t id;
                        if (!read_int(&c, 0, &id) || (uint64_t)id >= n_frames)
                            goto fallback;
                        if (reserve_ids(&ids, &ids_cap, n_ids + 1) < 0)
                            goto fail;
                        ids[n_ids++] = remap[id];
                        int more = comma_or(&c, ']');
                        if (more < 0)
                            goto fallback;
                        if (!more)
                            break;
                    }
                }
            }
            else if (field == HAS_API || field == HAS_OP || field == HAS_ROLE ||
                     field == HAS_DTYPE) {
                const char *s;
                Py_ssize_t n;
                skip_ws(&c);
                if ((field == HAS_API || field == HAS_DTYPE) && c.end - c.p >= 4 &&
                    memcmp(c.p, "null", 4) == 0) {
                    c.p += 4; /* api and dtype may be null, as msgspec reads them */
                }
                else {
                    if (!read_string(&c, &s, &n))
                        goto fallback;
                    CacheEntry *cache = field == HAS_API     ? api_cache
                                        : field == HAS_OP    ? op_cache
                                        : field == HAS_ROLE  ? role_cache
                                                             : dtype_cache;
                    PyObject *table_of = field == HAS_API     ? apis
                                         : field == HAS_OP    ? ops
                                         : field == HAS_ROLE  ? roles
                                                              : dtypes;
                    PyObject *text = intern_string(cache, table_of, s, n);
                    if (text == NULL) {
                        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                            goto fail;
                        PyErr_Clear();
                        goto fallback;
                    }
                    if (field == HAS_API)
                        api = text;
                    else if (field == HAS_OP)
                        op = text;
                    else if (field == HAS_ROLE)
                        role = text;
                    else
                        dtype = text;
                }
            }
            else if (field == HAS_STREAM) {
                if (!read_int(&c, 1, &stream))
                    goto fallback;
            }
            else {
                if (!read_int(&c, 0, &count) || count < 1)
                    goto fallback;
            }
            int more = comma_or(&c, '}');
            if (more < 0)
                goto fallback;
            if (!more)
                break;
        }
        if (!(seen & HAS_STACK) || !(seen & HAS_OP) || !(seen & HAS_COUNT))
            goto fallback;
        if (require_role && role == NULL)
            goto fallback; /* msgspec's path names the callsite */
        if (total > INT64_MAX - count)
            goto fallback; /* msgspec's path reports the sum */
        total += count;
        Py_ssize_t id = table_intern(table, ids, n_ids);
        if (id < 0)
            goto fail;
        PyObject *key = PyTuple_New(5);
        if (key == NULL)
            goto fail;
        PyObject *number = PyLong_FromSsize_t(id);
        if (number == NULL) {
            Py_DECREF(key);
            goto fail;
        }
        PyTuple_SET_ITEM(key, 0, number);
        PyTuple_SET_ITEM(key, 1, Py_NewRef(api));
        PyTuple_SET_ITEM(key, 2, Py_NewRef(op));
        number = role != NULL ? Py_NewRef(role) : PyLong_FromLongLong(stream);
        if (number == NULL) {
            Py_DECREF(key);
            goto fail;
        }
        PyTuple_SET_ITEM(key, 3, number);
        PyTuple_SET_ITEM(key, 4, Py_NewRef(dtype));
        int failed = PyList_Append(keys, key);
        Py_DECREF(key);
        number = failed ? NULL : PyLong_FromLongLong(count);
        if (number == NULL)
            goto fail;
        failed = PyList_Append(counts, number);
        Py_DECREF(number);
        if (failed)
            goto fail;
        int more = comma_or(&c, ']');
        if (more < 0)
            goto fallback;
        if (!more)
            break;
    }
finish:
    if (closes && !expect(&c, '}'))
        goto fallback;
    skip_ws(&c);
    if (c.p != c.end)
        goto fallback;
    result = Py_BuildValue("(OOL)", keys, counts, (long long)total);
    goto fail; /* not a failure: the shared clean-up */
fallback:
    result = Py_NewRef(Py_None);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(counts);
    PyMem_Free(ids);
    PyBuffer_Release(&data);
    PyBuffer_Release(&remap_buf);
    return result;
}


/* ------------------------------------------------------------------ fold_rank */

/* slot[index] += value (op: PyNumber_Add or PyNumber_Or); -1 on failure. */
static int
slot_update(PyObject *slot, Py_ssize_t index, PyObject *value, binaryfunc op)
{
    PyObject *updated = op(PyList_GET_ITEM(slot, index), value);
    if (updated == NULL)
        return -1;
    return PyList_SetItem(slot, index, updated); /* steals updated */
}

/* the slot's item i becomes value (a new reference, stolen; NULL: an error) */
static int
slot_set(PyObject *slot, Py_ssize_t index, PyObject *value)
{
    if (value == NULL)
        return -1;
    return PyList_SetItem(slot, index, value);
}

/* whether the key (stack id, api, op, role, dtype) is a collective: ``is_collective`` */
static int
key_is_collective(PyObject *key, PyObject *collective_apis)
{
    PyObject *op = PyTuple_GET_ITEM(key, 2), *api = PyTuple_GET_ITEM(key, 1);
    if (PyUnicode_Check(op)) {
        static PyObject *prefix = NULL;
        if (prefix == NULL && (prefix = PyUnicode_InternFromString("c10d::")) == NULL)
            return -1;
        Py_ssize_t match = PyUnicode_Tailmatch(op, prefix, 0, PY_SSIZE_T_MAX, -1);
        if (match != 0)
            return match < 0 ? -1 : 1;
    }
    return PySet_Contains(collective_apis, api);
}

/* mine[value] |= mask (0 where it has none) */
static int
hist_join(PyObject *mine, PyObject *value, PyObject *mask)
{
    PyObject *held = PyDict_GetItemWithError(mine, value);
    if (held == NULL && PyErr_Occurred())
        return -1;
    PyObject *joined = held == NULL ? Py_NewRef(mask) : PyNumber_Or(held, mask);
    if (joined == NULL)
        return -1;
    int failed = PyDict_SetItem(mine, value, joined);
    Py_DECREF(joined);
    return failed;
}

/* ``_store_histogram(slot, mine, collective)``: the slot keeps ``mine`` while it holds
 * three to max_distinct counts (any number for a collective), None for two or fewer,
 * False (overflowed) past that or when ``mine`` is NULL */
static int
store_histogram(PyObject *slot, PyObject *mine, PyObject *key, PyObject *collective_apis,
                Py_ssize_t max_distinct)
{
    PyObject *stored = Py_False;
    if (mine != NULL) {
        Py_ssize_t distinct = PyDict_GET_SIZE(mine);
        stored = mine;
        if (distinct <= 2) {
            stored = Py_None;
        }
        else if (distinct > max_distinct) {
            int collective = key_is_collective(key, collective_apis);
            if (collective < 0)
                return -1;
            if (!collective)
                stored = Py_False;
        }
    }
    return slot_set(slot, 6, Py_NewRef(stored));
}

/* ``add_rank_count(slot, count, mask, collective)`` (opguard_core/combine/accumulator.py, the
 * reference) for a slot that is not uniform with this count: min, max, their masks
 * and the histogram (dict, None, or False once it outgrew max_distinct values, unless
 * the key is a collective) follow, step for step. */
static int
add_rank_count(PyObject *slot, PyObject *count, PyObject *mask, PyObject *key,
               PyObject *collective_apis, Py_ssize_t max_distinct)
{
    PyObject *old_min = Py_NewRef(PyList_GET_ITEM(slot, 2));
    PyObject *old_max = Py_NewRef(PyList_GET_ITEM(slot, 4));
    PyObject *min_mask = Py_NewRef(PyList_GET_ITEM(slot, 3));
    PyObject *hist = Py_NewRef(PyList_GET_ITEM(slot, 6));
    PyObject *max_mask = NULL, *mine = NULL;
    int status = -1;
    if (min_mask == Py_None) { /* uniform so far (with another count) */
        int same = PyObject_RichCompareBool(count, old_min, Py_EQ);
        if (same < 0)
            goto done;
        if (same) {
            status = slot_update(slot, 0, count, PyNumber_Add) < 0 ||
                             slot_update(slot, 1, mask, PyNumber_Or) < 0
                         ? -1
                         : 0;
            goto done;
        }
        Py_SETREF(min_mask, Py_NewRef(PyList_GET_ITEM(slot, 1)));
        max_mask = Py_NewRef(min_mask);
        mine = PyDict_New();
        if (mine == NULL || PyDict_SetItem(mine, old_min, min_mask) < 0)
            goto done;
    }
    else {
        max_mask = Py_NewRef(PyList_GET_ITEM(slot, 5));
        if (hist == Py_None) {
            mine = PyDict_New();
            if (mine == NULL || PyDict_SetItem(mine, old_min, min_mask) < 0 ||
                PyDict_SetItem(mine, old_max, max_mask) < 0)
                goto done;
        }
        else if (PyDict_Check(hist)) {
            mine = Py_NewRef(hist);
        }
    }
    if (slot_update(slot, 0, count, PyNumber_Add) < 0 ||
        slot_update(slot, 1, mask, PyNumber_Or) < 0)
        goto done;
    int below = PyObject_RichCompareBool(count, old_min, Py_LT);
    int at_min = below ? 0 : PyObject_RichCompareBool(count, old_min, Py_EQ);
    if (below < 0 || at_min < 0)
        goto done;
    if (below) {
        if (slot_set(slot, 2, Py_NewRef(count)) < 0 || slot_set(slot, 3, Py_NewRef(mask)) < 0)
            goto done;
    }
    else if (slot_set(slot, 3, at_min ? PyNumber_Or(min_mask, mask) : Py_NewRef(min_mask)) < 0)
        goto done;
    int above = PyObject_RichCompareBool(count, old_max, Py_GT);
    int at_max = above ? 0 : PyObject_RichCompareBool(count, old_max, Py_EQ);
    if (above < 0 || at_max < 0)
        goto done;
    if (above) {
        if (slot_set(slot, 4, Py_NewRef(count)) < 0 || slot_set(slot, 5, Py_NewRef(mask)) < 0)
            goto done;
    }
    else if (slot_set(slot, 5, at_max ? PyNumber_Or(max_mask, mask) : Py_NewRef(max_mask)) < 0)
        goto done;
    if (mine != NULL && hist_join(mine, count, mask) < 0)
        goto done;
    status = store_histogram(slot, mine, key, collective_apis, max_distinct);
done:
    Py_DECREF(old_min);
    Py_DECREF(old_max);
    Py_DECREF(min_mask);
    Py_DECREF(hist);
    Py_XDECREF(max_mask);
    Py_XDECREF(mine);
    return status;
}

/* fold_rank(sites, keys, counts, mask, collective_apis, max_distinct) -> bool: the
 * one-rank loop of ``TraceAccumulator._fold_file`` in C. Each key gets a new slot
 * [count, mask, count, None, count, None, None], or, on a slot of other ranks with
 * this count on each (min mask None, min == max == count), its count added and mask
 * or-ed in; a slot that already has a rank of ``mask`` gets the count added (and the
 * result is False: per-rank statistics are no longer exact); any other slot (a count
 * that differs) goes through ``add_rank_count`` above. Returns whether no rank was
 * seen twice. */
static PyObject *
fold_rank(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *keys, *counts, *mask, *collective_apis;
    Py_ssize_t max_distinct;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!n", &PyDict_Type, &sites, &PyList_Type, &keys,
                          &PyList_Type, &counts, &mask, &PyFrozenSet_Type, &collective_apis,
                          &max_distinct))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(counts) != n) {
        PyErr_SetString(PyExc_ValueError, "fold_rank: keys and counts differ in length");
        return NULL;
    }
    int exact = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *count = PyList_GET_ITEM(counts, i);
        PyObject *slot = PyDict_GetItemWithError(sites, key);
        if (slot == NULL) {
            if (PyErr_Occurred())
                return NULL;
            slot = PyList_New(7);
            if (slot == NULL)
                return NULL;
            PyObject *values[7] = {count, mask, count, Py_None, count, Py_None, Py_None};
            for (int j = 0; j < 7; j++)
                PyList_SET_ITEM(slot, j, Py_NewRef(values[j]));
            int failed = PyDict_SetItem(sites, key, slot);
            Py_DECREF(slot);
            if (failed)
                return NULL;
            continue;
        }
        if (!PyList_CheckExact(slot) || PyList_GET_SIZE(slot) != 7) {
            PyErr_SetString(PyExc_TypeError, "fold_rank: a slot is not a list of 7");
            return NULL;
        }
        PyObject *overlap = PyNumber_And(PyList_GET_ITEM(slot, 1), mask);
        if (overlap == NULL)
            return NULL;
        int seen = PyObject_IsTrue(overlap);
        Py_DECREF(overlap);
        if (seen < 0)
            return NULL;
        if (seen) {
            if (slot_update(slot, 0, count, PyNumber_Add) < 0)
                return NULL;
            exact = 0;
            continue;
        }
        int same = PyList_GET_ITEM(slot, 3) == Py_None;
        if (same) {
            same = PyObject_RichCompareBool(count, PyList_GET_ITEM(slot, 2), Py_EQ);
            if (same > 0)
                same = PyObject_RichCompareBool(count, PyList_GET_ITEM(slot, 4), Py_EQ);
            if (same < 0)
                return NULL;
        }
        if (same) {
            if (slot_update(slot, 0, count, PyNumber_Add) < 0 ||
                slot_update(slot, 1, mask, PyNumber_Or) < 0)
                return NULL;
            continue;
        }
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 5) {
            PyErr_SetString(PyExc_TypeError, "fold_rank: a key is not a 5-tuple");
            return NULL;
        }
        if (add_rank_count(slot, count, mask, key, collective_apis, max_distinct) < 0)
            return NULL;
    }
    return PyBool_FromLong(exact);
}

/* ``_histogram(slot)``: a new dict {count: mask}, or NULL with no error when the
 * slot's histogram overflowed (False); NULL with an error on failure */
static PyObject *
slot_histogram(PyObject *slot)
{
    PyObject *hist = PyList_GET_ITEM(slot, 6);
    if (hist == Py_False)
        return NULL;
    if (PyDict_Check(hist))
        return PyDict_Copy(hist);
    PyObject *made = PyDict_New();
    if (made == NULL)
        return NULL;
    int failed;
    if (PyList_GET_ITEM(slot, 3) == Py_None)
        failed = PyDict_SetItem(made, PyList_GET_ITEM(slot, 2), PyList_GET_ITEM(slot, 1));
    else
        failed = PyDict_SetItem(made, PyList_GET_ITEM(slot, 2), PyList_GET_ITEM(slot, 3)) < 0 ||
                 PyDict_SetItem(made, PyList_GET_ITEM(slot, 4), PyList_GET_ITEM(slot, 5)) < 0;
    if (failed) {
        Py_DECREF(made);
        return NULL;
    }
    return made;
}

/* ``acc | _mask_of(slot, value, low)``: a new reference */
static PyObject *
or_mask_of(PyObject *acc, PyObject *slot, PyObject *value, int low)
{
    PyObject *held;
    int at;
    if (PyList_GET_ITEM(slot, 3) == Py_None) {
        held = PyList_GET_ITEM(slot, 1);
        at = 2;
    }
    else {
        held = PyList_GET_ITEM(slot, low ? 3 : 5);
        at = low ? 2 : 4;
    }
    int same = PyObject_RichCompareBool(PyList_GET_ITEM(slot, at), value, Py_EQ);
    if (same < 0)
        return NULL;
    return same ? PyNumber_Or(acc, held) : Py_NewRef(acc);
}

/* ``merge_slot(slot, other, collective)`` (opguard_core/combine/accumulator.py, the reference):
 * fold ``other``, a slot of the same callsite from disjoint ranks, into ``slot`` */
static int
merge_slot(PyObject *slot, PyObject *other, PyObject *key, PyObject *collective_apis,
           Py_ssize_t max_distinct)
{
    if (PyList_GET_ITEM(slot, 3) == Py_None && PyList_GET_ITEM(other, 3) == Py_None) {
        int same = PyObject_RichCompareBool(PyList_GET_ITEM(slot, 2), PyList_GET_ITEM(other, 2),
                                            Py_EQ);
        if (same < 0)
            return -1;
        if (same) /* both uniform with the same count: the common case */
            return slot_update(slot, 0, PyList_GET_ITEM(other, 0), PyNumber_Add) < 0 ||
                           slot_update(slot, 1, PyList_GET_ITEM(other, 1), PyNumber_Or) < 0
                       ? -1
                       : 0;
    }
    PyObject *mine = NULL, *theirs = NULL, *low = NULL, *high = NULL, *zero = NULL;
    PyObject *low_mask = NULL, *high_mask = NULL, *step = NULL;
    int status = -1;
    mine = slot_histogram(slot);
    if (mine == NULL && PyErr_Occurred())
        goto done;
    theirs = slot_histogram(other);
    if (theirs == NULL && PyErr_Occurred())
        goto done;
    PyObject *a = PyList_GET_ITEM(slot, 2), *b = PyList_GET_ITEM(other, 2);
    int less = PyObject_RichCompareBool(b, a, Py_LT); /* min(a, b): a unless b < a */
    if (less < 0)
        goto done;
    low = Py_NewRef(less ? b : a);
    a = PyList_GET_ITEM(slot, 4);
    b = PyList_GET_ITEM(other, 4);
    int more = PyObject_RichCompareBool(b, a, Py_GT); /* max(a, b): a unless b > a */
    if (more < 0)
        goto done;
    high = Py_NewRef(more ? b : a);
    zero = PyLong_FromLong(0);
    if (zero == NULL || (step = or_mask_of(zero, slot, low, 1)) == NULL ||
        (low_mask = or_mask_of(step, other, low, 1)) == NULL)
        goto done;
    Py_SETREF(step, or_mask_of(zero, slot, high, 0));
    if (step == NULL || (high_mask = or_mask_of(step, other, high, 0)) == NULL)
        goto done;
    if (slot_update(slot, 0, PyList_GET_ITEM(other, 0), PyNumber_Add) < 0 ||
        slot_update(slot, 1, PyList_GET_ITEM(other, 1), PyNumber_Or) < 0 ||
        slot_set(slot, 2, Py_NewRef(low)) < 0 || slot_set(slot, 4, Py_NewRef(high)) < 0)
        goto done;
    int flat = PyObject_RichCompareBool(low, high, Py_EQ);
    if (flat < 0)
        goto done;
    if (flat) {
        status = slot_set(slot, 3, Py_NewRef(Py_None)) < 0 ||
                         slot_set(slot, 5, Py_NewRef(Py_None)) < 0 ||
                         slot_set(slot, 6, Py_NewRef(Py_None)) < 0
                     ? -1
                     : 0;
        goto done;
    }
    if (slot_set(slot, 3, Py_NewRef(low_mask)) < 0 || slot_set(slot, 5, Py_NewRef(high_mask)) < 0)
        goto done;
    PyObject *joined = NULL; /* the union of both histograms; NULL: overflowed */
    if (mine != NULL && theirs != NULL) {
        PyObject *value, *mask;
        Py_ssize_t position = 0;
        while (PyDict_Next(theirs, &position, &value, &mask))
            if (hist_join(mine, value, mask) < 0)
                goto done;
        joined = mine;
    }
    status = store_histogram(slot, joined, key, collective_apis, max_distinct);
done:
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    Py_XDECREF(low);
    Py_XDECREF(high);
    Py_XDECREF(zero);
    Py_XDECREF(step);
    Py_XDECREF(low_mask);
    Py_XDECREF(high_mask);
    return status;
}

/* merge_packed(sites, stack_ids, apis, ops, roles, dtypes, counts, masks, mins, stats,
 * collective_apis, max_distinct): ``TraceAccumulator._merge_packed``'s fold in C. The
 * site at each position has key (stack_ids[i], apis[i], ops[i], roles[i], dtypes[i])
 * and slot [counts[i], masks[i], mins[i], *stats[i]] where ``stats`` (a dict by
 * position) has it, else [counts[i], masks[i], mins[i], None, mins[i], None, None]; a
 * new key takes the slot, a known one has it merged in (``merge_slot``). */
static PyObject *
merge_packed(PyObject *Py_UNUSED(module), PyObject *args)
{
    /* the key's five columns, then counts, masks and mins */
    PyObject *sites, *columns[8], *stats, *collective_apis;
    Py_ssize_t max_distinct;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!O!O!n", &PyDict_Type, &sites, &PyList_Type,
                          &columns[0], &PyList_Type, &columns[1], &PyList_Type, &columns[2],
                          &PyList_Type, &columns[3], &PyList_Type, &columns[4], &PyList_Type,
                          &columns[5], &PyList_Type, &columns[6], &PyList_Type, &columns[7],
                          &PyDict_Type, &stats, &PyFrozenSet_Type, &collective_apis,
                          &max_distinct))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(columns[0]);
    for (int c = 1; c < 8; c++) {
        if (PyList_GET_SIZE(columns[c]) != n) {
            PyErr_SetString(PyExc_ValueError, "merge_packed: columns differ in length");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_Pack(5, PyList_GET_ITEM(columns[0], i),
                                     PyList_GET_ITEM(columns[1], i), PyList_GET_ITEM(columns[2], i),
                                     PyList_GET_ITEM(columns[3], i), PyList_GET_ITEM(columns[4], i));
        if (key == NULL)
            return NULL;
        PyObject *low = PyList_GET_ITEM(columns[7], i);
        PyObject *values[7] = {PyList_GET_ITEM(columns[5], i), PyList_GET_ITEM(columns[6], i), low,
                               Py_None, low, Py_None, Py_None};
        PyObject *position = PyLong_FromSsize_t(i);
        PyObject *extra = position == NULL ? NULL : PyDict_GetItemWithError(stats, position);
        Py_XDECREF(position);
        if (extra == NULL && PyErr_Occurred()) {
            Py_DECREF(key);
            return NULL;
        }
        if (extra != NULL) {
            if (!PyTuple_Check(extra) || PyTuple_GET_SIZE(extra) != 4) {
                Py_DECREF(key);
                PyErr_SetString(PyExc_TypeError, "merge_packed: stats are 4-tuples");
                return NULL;
            }
            for (int j = 0; j < 4; j++)
                values[3 + j] = PyTuple_GET_ITEM(extra, j);
        }
        PyObject *incoming = PyList_New(7);
        if (incoming == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        for (int j = 0; j < 7; j++)
            PyList_SET_ITEM(incoming, j, Py_NewRef(values[j]));
        PyObject *slot = PyDict_GetItemWithError(sites, key);
        int failed;
        if (slot == NULL)
            failed = PyErr_Occurred() != NULL || PyDict_SetItem(sites, key, incoming) < 0;
        else if (!PyList_CheckExact(slot) || PyList_GET_SIZE(slot) != 7) {
            PyErr_SetString(PyExc_TypeError, "merge_packed: a slot is not a list of 7");
            failed = 1;
        }
        else
            failed = merge_slot(slot, incoming, key, collective_apis, max_distinct) < 0;
        Py_DECREF(incoming);
        Py_DECREF(key);
        if (failed)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ site_order */

typedef struct {
    const char *data;
    Py_ssize_t len;
    uint32_t id;
} StackKey;

static int
compare_stack_keys(const void *a, const void *b)
{
    const StackKey *x = a, *y = b;
    Py_ssize_t common = x->len < y->len ? x->len : y->len;
    int order = common ? memcmp(x->data, y->data, (size_t)common) : 0;
    if (order)
        return order;
    return (x->len > y->len) - (x->len < y->len);
}

typedef struct {
    uint32_t stack, api, op, stream;
    uint32_t has_dtype, dtype, has_api;
    Py_ssize_t index;
} SiteKeyRank;

static int
compare_site_ranks(const void *a, const void *b)
{
    const SiteKeyRank *x = a, *y = b;
#define ORDER_BY(field)                 \
    if (x->field != y->field)           \
        return x->field < y->field ? -1 : 1;
    ORDER_BY(stack)
    ORDER_BY(api)
    ORDER_BY(op)
    ORDER_BY(stream)
    ORDER_BY(has_dtype)
    ORDER_BY(dtype)
    ORDER_BY(has_api)
#undef ORDER_BY
    return (x->index > y->index) - (x->index < y->index);
}

/* values -> {value: rank}: the distinct values' ranks in Python's sort order */
static PyObject *
value_ranks(PyObject *distinct)
{
    PyObject *sorted = PyDict_Keys(distinct);
    if (sorted == NULL || PyList_Sort(sorted) < 0) {
        Py_XDECREF(sorted);
        return NULL;
    }
    PyObject *ranks = PyDict_New();
    for (Py_ssize_t i = 0; ranks != NULL && i < PyList_GET_SIZE(sorted); i++) {
        PyObject *rank = PyLong_FromSsize_t(i);
        if (rank == NULL || PyDict_SetItem(ranks, PyList_GET_ITEM(sorted, i), rank) < 0)
            Py_CLEAR(ranks);
        Py_XDECREF(rank);
    }
    Py_DECREF(sorted);
    return ranks;
}

static int
rank_of(PyObject *ranks, PyObject *value, uint32_t *out)
{
    PyObject *rank = PyDict_GetItemWithError(ranks, value);
    if (rank == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_KeyError, "site_order: a value without a rank");
        return -1;
    }
    *out = (uint32_t)PyLong_AsSsize_t(rank);
    return 0;
}

/* site_order(keys, canonical) -> list: the positions of the keys (stack id, api, op,
 * role, dtype) sorted by (canonical[stack id][0], api or "", op, role, dtype is not
 * None, dtype or "", api is not None): stacks by their canonical bytes, the rest by
 * Python's order of their values (``py_site_order``, the reference) */
static PyObject *
site_order(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *keys, *canonical;
    if (!PyArg_ParseTuple(args, "O!O!:site_order", &PyList_Type, &keys, &PyList_Type, &canonical))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), stacks = PyList_GET_SIZE(canonical);
    StackKey *stack_keys = PyMem_Malloc((size_t)(stacks ? stacks : 1) * sizeof(StackKey));
    uint32_t *stack_rank = PyMem_Malloc((size_t)(stacks ? stacks : 1) * sizeof(uint32_t));
    SiteKeyRank *sites = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(SiteKeyRank));
    PyObject *apis = PyDict_New(), *ops = PyDict_New(), *streams = PyDict_New();
    PyObject *dtypes = PyDict_New();
    PyObject *api_ranks = NULL, *op_ranks = NULL, *stream_ranks = NULL, *dtype_ranks = NULL;
    PyObject *result = NULL;
    PyObject *empty = PyUnicode_FromString("");
    if (!stack_keys || !stack_rank || !sites) {
        PyErr_NoMemory();
        goto done;
    }
    if (!apis || !ops || !streams || !dtypes || !empty)
        goto done;
    for (Py_ssize_t i = 0; i < stacks; i++) {
        PyObject *pair = PyList_GET_ITEM(canonical, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) < 1 ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "site_order: canonical holds (bytes, stack) pairs");
            goto done;
        }
        PyObject *bytes = PyTuple_GET_ITEM(pair, 0);
        stack_keys[i] = (StackKey){PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes), (uint32_t)i};
    }
    qsort(stack_keys, (size_t)stacks, sizeof(StackKey), compare_stack_keys);
    uint32_t rank = 0; /* equal bytes (no two stacks of one table) share a rank */
    for (Py_ssize_t i = 0; i < stacks; i++) {
        if (i > 0 && compare_stack_keys(&stack_keys[i - 1], &stack_keys[i]) != 0)
            rank = (uint32_t)i;
        stack_rank[stack_keys[i].id] = rank;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* the distinct values */
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 5) {
            PyErr_SetString(PyExc_TypeError, "site_order: a key is not a 5-tuple");
            goto done;
        }
        PyObject *api = PyTuple_GET_ITEM(key, 1), *dtype = PyTuple_GET_ITEM(key, 4);
        if (PyDict_SetItem(apis, api == Py_None ? empty : api, Py_None) < 0 ||
            PyDict_SetItem(ops, PyTuple_GET_ITEM(key, 2), Py_None) < 0 ||
            PyDict_SetItem(streams, PyTuple_GET_ITEM(key, 3), Py_None) < 0 ||
            PyDict_SetItem(dtypes, dtype == Py_None ? empty : dtype, Py_None) < 0)
            goto done;
    }
    api_ranks = value_ranks(apis);
    op_ranks = api_ranks ? value_ranks(ops) : NULL;
    stream_ranks = op_ranks ? value_ranks(streams) : NULL;
    dtype_ranks = stream_ranks ? value_ranks(dtypes) : NULL;
    if (dtype_ranks == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i), *api = PyTuple_GET_ITEM(key, 1);
        PyObject *dtype = PyTuple_GET_ITEM(key, 4);
        Py_ssize_t stack = PyLong_AsSsize_t(PyTuple_GET_ITEM(key, 0));
        if (stack == -1 && PyErr_Occurred())
            goto done;
        if (stack < 0 || stack >= stacks) {
            PyErr_SetString(PyExc_IndexError, "site_order: a stack id out of range");
            goto done;
        }
        SiteKeyRank *site = &sites[i];
        site->stack = stack_rank[stack];
        site->has_api = api != Py_None;
        site->has_dtype = dtype != Py_None;
        site->index = i;
        if (rank_of(api_ranks, api == Py_None ? empty : api, &site->api) < 0 ||
            rank_of(op_ranks, PyTuple_GET_ITEM(key, 2), &site->op) < 0 ||
            rank_of(stream_ranks, PyTuple_GET_ITEM(key, 3), &site->stream) < 0 ||
            rank_of(dtype_ranks, dtype == Py_None ? empty : dtype, &site->dtype) < 0)
            goto done;
    }
    qsort(sites, (size_t)n, sizeof(SiteKeyRank), compare_site_ranks);
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *index = PyLong_FromSsize_t(sites[i].index);
        if (index == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, index);
    }
done:
    PyMem_Free(stack_keys);
    PyMem_Free(stack_rank);
    PyMem_Free(sites);
    Py_XDECREF(apis);
    Py_XDECREF(ops);
    Py_XDECREF(streams);
    Py_XDECREF(dtypes);
    Py_XDECREF(api_ranks);
    Py_XDECREF(op_ranks);
    Py_XDECREF(stream_ranks);
    Py_XDECREF(dtype_ranks);
    Py_XDECREF(empty);
    return result;
}

/* A tuple of interned names, made once (keyword names for a vectorcall). */
static PyObject *
names_tuple(PyObject **cache, const char *const *names, Py_ssize_t n)
{
    if (*cache != NULL)
        return *cache;
    PyObject *tuple = PyTuple_New(n);
    for (Py_ssize_t i = 0; tuple != NULL && i < n; i++) {
        PyObject *name = PyUnicode_InternFromString(names[i]);
        if (name == NULL)
            Py_CLEAR(tuple);
        else
            PyTuple_SET_ITEM(tuple, i, name);
    }
    return *cache = tuple;
}

/* ranks_of[mask] (a dict by mask whose __missing__ makes a new list): a new reference */
static PyObject *
rank_list(PyObject *ranks_of, PyObject *mask)
{
    PyObject *found = PyDict_GetItemWithError(ranks_of, mask);
    if (found != NULL)
        return Py_NewRef(found);
    return PyErr_Occurred() ? NULL : PyObject_GetItem(ranks_of, mask);
}

/* A slot's PerRank (accumulator._per_rank): a new reference */
static PyObject *
slot_per_rank(PyObject *slot, PyObject *ranks_of, PyObject *per_rank_type)
{
    static PyObject *kwnames = NULL;
    static const char *const names[] = {"min", "min_ranks", "max", "max_ranks", "counts"};
    if (names_tuple(&kwnames, names, 5) == NULL)
        return NULL;
    PyObject *hist = PyList_GET_ITEM(slot, 6), *own = NULL, *keys = NULL, *counts = NULL;
    PyObject *low = NULL, *high = NULL, *result = NULL;
    if (hist == Py_None) { /* two values: min and max say it all */
        hist = own = PyDict_New();
        if (own == NULL || PyDict_SetItem(own, PyList_GET_ITEM(slot, 2), PyList_GET_ITEM(slot, 3)) < 0 ||
            PyDict_SetItem(own, PyList_GET_ITEM(slot, 4), PyList_GET_ITEM(slot, 5)) < 0)
            goto done;
    }
    if (hist == Py_False) { /* overflowed */
        counts = Py_NewRef(Py_None);
    } else {
        if (!PyDict_Check(hist)) {
            PyErr_SetString(PyExc_TypeError, "build_callsites: a histogram is not a dict");
            goto done;
        }
        keys = PyDict_Keys(hist);
        if (keys == NULL || PyList_Sort(keys) < 0)
            goto done;
        Py_ssize_t size = PyList_GET_SIZE(keys);
        counts = PyList_New(size);
        for (Py_ssize_t j = 0; counts != NULL && j < size; j++) {
            PyObject *value = PyList_GET_ITEM(keys, j);
            PyObject *mask = PyDict_GetItemWithError(hist, value);
            PyObject *ranks = mask == NULL ? NULL : rank_list(ranks_of, mask);
            PyObject *pair = ranks == NULL ? NULL : PyTuple_Pack(2, value, ranks);
            Py_XDECREF(ranks);
            if (pair == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_KeyError, "build_callsites: a histogram changed");
                goto done;
            }
            PyList_SET_ITEM(counts, j, pair);
        }
        if (counts == NULL)
            goto done;
    }
    low = rank_list(ranks_of, PyList_GET_ITEM(slot, 3));
    high = low == NULL ? NULL : rank_list(ranks_of, PyList_GET_ITEM(slot, 5));
    if (high != NULL) {
        PyObject *values[] = {PyList_GET_ITEM(slot, 2), low, PyList_GET_ITEM(slot, 4), high, counts};
        result = PyObject_Vectorcall(per_rank_type, values, 0, kwnames);
    }
done:
    Py_XDECREF(own);
    Py_XDECREF(keys);
    Py_XDECREF(counts);
    Py_XDECREF(low);
    Py_XDECREF(high);
    return result;
}

/* build_callsites(sites, order, canonical, all_mask, stats_valid, ranks_of, callsite_type,
 * per_rank_type) -> list: the combined trace's callsites, ``sites`` ((key, slot) pairs)
 * in ``order``, as accumulator.py_build_callsites (the reference) makes them */
static PyObject *
build_callsites(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *order, *canonical, *all_mask, *ranks_of, *callsite_type, *per_rank_type;
    int stats_valid;
    if (!PyArg_ParseTuple(args, "O!O!O!OpO!OO:build_callsites", &PyList_Type, &sites,
                          &PyList_Type, &order, &PyList_Type, &canonical, &all_mask, &stats_valid,
                          &PyDict_Type, &ranks_of, &callsite_type, &per_rank_type))
        return NULL;
    static PyObject *kwnames = NULL;
    static const char *const names[] = {"stack", "api", "op", "role", "dtype", "count", "ranks",
                                        "per_rank"};
    if (names_tuple(&kwnames, names, 8) == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(order), nsites = PyList_GET_SIZE(sites);
    Py_ssize_t stacks = PyList_GET_SIZE(canonical);
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Py_ssize_t index = PyLong_AsSsize_t(PyList_GET_ITEM(order, i));
        if (index == -1 && PyErr_Occurred())
            goto fail;
        if (index < 0 || index >= nsites) {
            PyErr_SetString(PyExc_IndexError, "build_callsites: a position out of range");
            goto fail;
        }
        PyObject *pair = PyList_GET_ITEM(sites, index), *key, *slot;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyTuple_Check(key = PyTuple_GET_ITEM(pair, 0)) || PyTuple_GET_SIZE(key) != 5 ||
            !PyList_Check(slot = PyTuple_GET_ITEM(pair, 1)) || PyList_GET_SIZE(slot) != 7) {
            PyErr_SetString(PyExc_TypeError, "build_callsites: a site is not (5-tuple, 7-list)");
            goto fail;
        }
        Py_ssize_t stack_id = PyLong_AsSsize_t(PyTuple_GET_ITEM(key, 0));
        if (stack_id == -1 && PyErr_Occurred())
            goto fail;
        PyObject *stack_pair = stack_id >= 0 && stack_id < stacks ? PyList_GET_ITEM(canonical, stack_id)
                                                                  : NULL;
        if (stack_pair == NULL || !PyTuple_Check(stack_pair) || PyTuple_GET_SIZE(stack_pair) != 2) {
            PyErr_SetString(PyExc_IndexError, "build_callsites: a stack id out of range");
            goto fail;
        }
        PyObject *mask = PyList_GET_ITEM(slot, 1);
        int every = PyObject_RichCompareBool(mask, all_mask, Py_EQ);
        if (every < 0)
            goto fail;
        PyObject *ranks = every ? Py_NewRef(Py_None) : rank_list(ranks_of, mask);
        if (ranks == NULL)
            goto fail;
        PyObject *stats = stats_valid && PyList_GET_ITEM(slot, 3) != Py_None
                              ? slot_per_rank(slot, ranks_of, per_rank_type)
                              : Py_NewRef(Py_None);
        if (stats == NULL) {
            Py_DECREF(ranks);
            goto fail;
        }
        PyObject *values[] = {PyTuple_GET_ITEM(stack_pair, 1), PyTuple_GET_ITEM(key, 1),
                              PyTuple_GET_ITEM(key, 2), PyTuple_GET_ITEM(key, 3),
                              PyTuple_GET_ITEM(key, 4), PyList_GET_ITEM(slot, 0), ranks, stats};
        PyObject *site = PyObject_Vectorcall(callsite_type, values, 0, kwnames);
        Py_DECREF(ranks);
        Py_DECREF(stats);
        if (site == NULL)
            goto fail;
        PyList_SET_ITEM(result, i, site);
    }
    return result;
fail:
    Py_XDECREF(result);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"find_callsites", find_callsites, METH_O,
     "find_callsites(data) -> offset or None: where the top-level callsites value starts."},
    {"scan_callsites", scan_callsites, METH_VARARGS,
     "scan_callsites(data, offset, closes, remap, table, apis, ops, roles, dtypes, "
     "require_role) -> (keys, counts, total) or None."},
    {"fold_rank", fold_rank, METH_VARARGS,
     "fold_rank(sites, keys, counts, mask, collective_apis, max_distinct) -> bool: fold "
     "one rank's callsites."},
    {"site_order", site_order, METH_VARARGS,
     "site_order(keys, canonical) -> list: the keys' positions in canonical order."},
    {"build_callsites", build_callsites, METH_VARARGS,
     "build_callsites(sites, order, canonical, all_mask, stats_valid, ranks_of, callsite_type, "
     "per_rank_type) -> list: the combined trace's callsites."},
    {"merge_packed", merge_packed, METH_VARARGS,
     "merge_packed(sites, stack_ids, apis, ops, roles, dtypes, counts, masks, mins, stats, "
     "collective_apis, max_distinct): fold a packed partial's sites in."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "opguard_core.combine._scan",
    .m_doc = "The combine's per-callsite hot path: stacks interned and callsites read "
             "straight from a rank file's bytes.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__scan(void)
{
    if (PyType_Ready(&StackTableType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&scan_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "StackTable", (PyObject *)&StackTableType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
