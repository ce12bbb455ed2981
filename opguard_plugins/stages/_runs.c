/* Compress's (and divergence's) per-callsite work in C (performance.md, "Compiled
 * per-site work").
 *
 * ``Runs(paths, counts, masks, all_mask, ops, streams, dtypes, width)`` holds a trace's
 * callsites in the sorted order of their paths (bytes, ``width`` bytes an id), with
 * the prefix sums of their counts, and answers what ``build_tree`` asks of the runs
 * of callsites below its nodes: ``weight``, ``mask``, ``uniform``, ``skip_ended``,
 * ``run_end``, ``id_at``, ``ranked_prefix``, ``tally``, ``distinct_prefixes`` and the
 * whole ``divergent`` search. ``callsite_paths(stacks, apis, api_index, tables, width)``
 * builds the paths (4-byte ids only) and ``frames_at`` reads a node's frames from
 * them; ``visible_frames(stacks, hidden, user)`` gives divergence given stacks'
 * visible frames and calling function, ``site_summary`` every callsite's caller, the
 * union of the frames every rank ran, which ran on every rank and which are
 * collectives, the callsites read in place. Each does what the pure-Python ``PyRuns``,
 * ``py_callsite_paths``, ``py_frames_at``, ``py_visible_frames`` and
 * ``py_site_summary`` (opguard_plugins/stages/sorted_runs.py) do, which stay the reference:
 * tests/test_compress_runs.py holds the two to the same answers. ``skew_fold``
 * is divergence's count_skew fold (``py_skew_fold`` in
 * opguard_plugins/stages/divergence.py; tests/test_divergence_groups.py),
 * ``skew_findings`` builds its findings (``py_skew_findings`` there), and
 * ``collective_histograms`` reads its collective callsites' per-rank counts
 * (``py_collective_histograms`` there); ``site_visible_frames`` and
 * ``site_touching`` are ``visible_frames`` of some callsites' stacks and the callsites
 * whose stack has a marked frame, read in place (``py_site_visible_frames``, ``py_site_touching`` in sorted_runs.py).
 *
 * Positions are checked against the number of paths (ValueError), and a sum of
 * counts past 2**63-1 is an OverflowError. CPython >= 3.11; the package works
 * without this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h> /* T_OBJECT_EX: how msgspec keeps a Struct's fields */

/* An int as a Py_ssize_t: a small one (a frame id, a rank, a position) read straight
 * from the object, any other through PyLong_AsSsize_t (-1 and an exception when it is
 * not an int or does not fit). Frame ids are read this way millions of times a run. */
static inline Py_ssize_t
as_index(PyObject *obj)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(obj) && PyUnstable_Long_IsCompact((PyLongObject *)obj))
        return (Py_ssize_t)PyUnstable_Long_CompactValue((PyLongObject *)obj);
#else
    if (PyLong_CheckExact(obj) && (Py_SIZE(obj) == 0 || Py_SIZE(obj) == 1))
        return Py_SIZE(obj) ? (Py_ssize_t)((PyLongObject *)obj)->ob_digit[0] : 0;
#endif
    return PyLong_AsSsize_t(obj);
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, width;
    PyObject *paths;   /* tuple of bytes */
    PyObject *masks;   /* tuple of ints */
    PyObject *all_mask;
    PyObject *ops;     /* tuple */
    PyObject *streams; /* tuple */
    PyObject *dtypes;  /* tuple: a name, or None for an op without a dtype */
    const unsigned char **data;
    Py_ssize_t *lens;
    long long *below;  /* n + 1 prefix sums of the counts */
    Py_ssize_t *full;  /* n + 1: how many positions before i have every rank */
    Py_ssize_t *changes; /* n + 2: how many 0 < j < i have masks[j] != masks[j - 1] */
} Runs;

/* a lower bound on a weight, given as a Python int of any size */
typedef struct {
    long long value;
    int never; /* the bound exceeds every int64 weight */
} Bound;

static int
to_bound(PyObject *number, Bound *bound)
{
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (value == -1 && PyErr_Occurred())
        return -1;
    bound->never = overflow > 0;
    bound->value = overflow < 0 ? LLONG_MIN : value;
    return 0;
}

static inline int
reaches(long long weight, const Bound *bound)
{
    return !bound->never && weight >= bound->value;
}

static void
runs_dealloc(Runs *r)
{
    Py_XDECREF(r->paths);
    Py_XDECREF(r->masks);
    Py_XDECREF(r->all_mask);
    Py_XDECREF(r->ops);
    Py_XDECREF(r->streams);
    Py_XDECREF(r->dtypes);
    PyMem_Free(r->data);
    PyMem_Free(r->lens);
    PyMem_Free(r->below);
    PyMem_Free(r->full);
    PyMem_Free(r->changes);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *
as_tuple(PyObject *sequence, Py_ssize_t n, const char *what)
{
    PyObject *tuple = PySequence_Tuple(sequence);
    if (tuple != NULL && PyTuple_GET_SIZE(tuple) != n) {
        PyErr_Format(PyExc_ValueError, "Runs: %s has %zd items, paths %zd", what,
                     PyTuple_GET_SIZE(tuple), n);
        Py_CLEAR(tuple);
    }
    return tuple;
}

static PyObject *
runs_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"paths", "counts", "masks",  "all_mask", "ops",
                            "streams", "dtypes", "width", NULL};
    PyObject *paths, *counts, *masks, *all_mask, *ops, *streams, *dtypes;
    Py_ssize_t width;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOn:Runs", names, &paths, &counts,
                                     &masks, &all_mask, &ops, &streams, &dtypes, &width))
        return NULL;
    if (width <= 0) {
        PyErr_SetString(PyExc_ValueError, "Runs: width must be positive");
        return NULL;
    }
    Runs *r = (Runs *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    r->width = width;
    r->paths = PySequence_Tuple(paths);
    if (r->paths == NULL)
        goto fail;
    Py_ssize_t n = r->n = PyTuple_GET_SIZE(r->paths);
    PyObject *count_tuple = as_tuple(counts, n, "counts");
    if (count_tuple == NULL)
        goto fail;
    r->masks = as_tuple(masks, n, "masks");
    r->ops = as_tuple(ops, n, "ops");
    r->streams = as_tuple(streams, n, "streams");
    r->dtypes = as_tuple(dtypes, n, "dtypes");
    Py_INCREF(all_mask);
    r->all_mask = all_mask;
    r->data = PyMem_Calloc((size_t)n + 1, sizeof(*r->data));
    r->lens = PyMem_Calloc((size_t)n + 1, sizeof(*r->lens));
    r->below = PyMem_Calloc((size_t)n + 1, sizeof(*r->below));
    r->full = PyMem_Calloc((size_t)n + 1, sizeof(*r->full));
    r->changes = PyMem_Calloc((size_t)n + 2, sizeof(*r->changes));
    if (r->masks == NULL || r->ops == NULL || r->streams == NULL || r->dtypes == NULL) {
        Py_DECREF(count_tuple);
        goto fail;
    }
    if (!r->data || !r->lens || !r->below || !r->full || !r->changes) {
        Py_DECREF(count_tuple);
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path = PyTuple_GET_ITEM(r->paths, i);
        if (!PyBytes_Check(path)) {
            Py_DECREF(count_tuple);
            PyErr_SetString(PyExc_TypeError, "Runs: paths must be bytes");
            goto fail;
        }
        r->data[i] = (const unsigned char *)PyBytes_AS_STRING(path);
        r->lens[i] = PyBytes_GET_SIZE(path);
        long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(count_tuple, i));
        if (count == -1 && PyErr_Occurred()) {
            Py_DECREF(count_tuple);
            goto fail;
        }
        if (count < 0 || count > LLONG_MAX - r->below[i]) {
            Py_DECREF(count_tuple);
            PyErr_SetString(PyExc_OverflowError, "Runs: counts must be >= 0 and sum below 2**63");
            goto fail;
        }
        r->below[i + 1] = r->below[i] + count;
        PyObject *mask = PyTuple_GET_ITEM(r->masks, i);
        int every = PyObject_RichCompareBool(mask, all_mask, Py_EQ);
        if (every < 0) {
            Py_DECREF(count_tuple);
            goto fail;
        }
        r->full[i + 1] = r->full[i] + every;
        if (i >= 1) {
            int differs = PyObject_RichCompareBool(PyTuple_GET_ITEM(r->masks, i - 1), mask, Py_NE);
            if (differs < 0) {
                Py_DECREF(count_tuple);
                goto fail;
            }
            r->changes[i + 1] = r->changes[i] + differs;
        }
    }
    Py_DECREF(count_tuple);
    return (PyObject *)r;
fail:
    Py_DECREF(r);
    return NULL;
}

/* ------------------------------------------------------------ the primitives */

static int
check_run(Runs *r, Py_ssize_t start, Py_ssize_t end, int nonempty)
{
    if (start < 0 || end > r->n || start > end || (nonempty && start == end)) {
        PyErr_Format(PyExc_ValueError, "Runs: positions %zd to %zd out of range (%zd paths)",
                     start, end, r->n);
        return -1;
    }
    return 0;
}

/* the union of the ranks of a non-empty run: a new reference */
static PyObject *
run_mask(Runs *r, Py_ssize_t start, Py_ssize_t end)
{
    if (r->full[end] > r->full[start])
        return Py_NewRef(r->all_mask);
    PyObject *acc = Py_NewRef(PyTuple_GET_ITEM(r->masks, start));
    if (r->changes[end] == r->changes[start + 1])
        return acc;
    for (Py_ssize_t i = start + 1; i < end; i++) {
        PyObject *mask = PyTuple_GET_ITEM(r->masks, i);
        if (mask == PyTuple_GET_ITEM(r->masks, i - 1))
            continue; /* the same object: nothing new */
        PyObject *next = PyNumber_Or(acc, mask);
        Py_DECREF(acc);
        if (next == NULL)
            return NULL;
        acc = next;
    }
    return acc;
}

static inline Py_ssize_t
skip_ended(Runs *r, Py_ssize_t own, Py_ssize_t start, Py_ssize_t end)
{
    while (start < end && r->lens[start] == own)
        start++;
    return start;
}

/* compare path[own:own + width] of position i with the piece (as bytes compare) */
static inline int
compare_at(Runs *r, Py_ssize_t i, Py_ssize_t own, const unsigned char *piece, Py_ssize_t size)
{
    Py_ssize_t have = r->lens[i] - own;
    if (have < 0)
        have = 0;
    if (have > r->width)
        have = r->width;
    Py_ssize_t common = have < size ? have : size;
    int order = common ? memcmp(r->data[i] + own, piece, (size_t)common) : 0;
    if (order)
        return order;
    return (have > size) - (have < size);
}

/* bisect_right of the id at ``own`` of position ``start`` within [start, end) */
static Py_ssize_t
run_end(Runs *r, Py_ssize_t own, Py_ssize_t start, Py_ssize_t end)
{
    Py_ssize_t size = r->lens[start] - own;
    if (size < 0)
        size = 0;
    if (size > r->width)
        size = r->width;
    const unsigned char *piece = r->data[start] + (size ? own : 0);
    Py_ssize_t low = start, high = end;
    while (low < high) {
        Py_ssize_t middle = low + (high - low) / 2;
        if (compare_at(r, middle, own, piece, size) <= 0)
            low = middle + 1;
        else
            high = middle;
    }
    return low;
}

static int
parse_positions(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t *out,
                const char *name)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "Runs.%s takes %zd arguments (%zd given)", name, want,
                     nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        out[i] = as_index(args[i]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static PyObject *
runs_weight(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (parse_positions(args, nargs, 2, at, "weight") < 0 || check_run(r, at[0], at[1], 0) < 0)
        return NULL;
    return PyLong_FromLongLong(r->below[at[1]] - r->below[at[0]]);
}

static PyObject *
runs_mask(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (parse_positions(args, nargs, 2, at, "mask") < 0 || check_run(r, at[0], at[1], 1) < 0)
        return NULL;
    return run_mask(r, at[0], at[1]);
}

static PyObject *
runs_uniform(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (parse_positions(args, nargs, 2, at, "uniform") < 0 || check_run(r, at[0], at[1], 1) < 0)
        return NULL;
    return PyBool_FromLong(r->changes[at[1]] == r->changes[at[0] + 1]);
}

static PyObject *
runs_skip_ended(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[3];
    if (parse_positions(args, nargs, 3, at, "skip_ended") < 0 ||
        check_run(r, at[1], at[2], 0) < 0)
        return NULL;
    return PyLong_FromSsize_t(skip_ended(r, at[0], at[1], at[2]));
}

static PyObject *
runs_run_end(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[3];
    if (parse_positions(args, nargs, 3, at, "run_end") < 0 || check_run(r, at[1], at[2], 1) < 0)
        return NULL;
    if (at[0] < 0) {
        PyErr_SetString(PyExc_ValueError, "Runs.run_end: negative offset");
        return NULL;
    }
    return PyLong_FromSsize_t(run_end(r, at[0], at[1], at[2]));
}

/* path[begin:stop] of one position, clamped as a slice is */
static PyObject *
path_slice(Runs *r, Py_ssize_t position, Py_ssize_t begin, Py_ssize_t stop)
{
    if (check_run(r, position, position + 1, 1) < 0)
        return NULL;
    if (begin < 0 || stop < begin) {
        PyErr_SetString(PyExc_ValueError, "Runs: negative offset");
        return NULL;
    }
    Py_ssize_t len = r->lens[position];
    if (stop > len)
        stop = len;
    if (begin > stop)
        begin = stop;
    return PyBytes_FromStringAndSize((const char *)r->data[position] + begin, stop - begin);
}

static PyObject *
runs_id_at(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (parse_positions(args, nargs, 2, at, "id_at") < 0)
        return NULL;
    if (at[0] > PY_SSIZE_T_MAX - r->width) {
        PyErr_SetString(PyExc_ValueError, "Runs.id_at: offset out of range");
        return NULL;
    }
    return path_slice(r, at[1], at[0], at[0] + r->width);
}

/* ranked_prefix(own, position, ranks) -> bytes: the ids of the first own bytes of the
 * position's path (4-byte ids) replaced by ranks[id] (a uint32 buffer), big-endian */
static PyObject *
runs_ranked_prefix(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (nargs != 3 || r->width != 4) {
        PyErr_SetString(PyExc_TypeError, "Runs.ranked_prefix(own, position, ranks): 4-byte ids");
        return NULL;
    }
    if (parse_positions(args, 2, 2, at, "ranked_prefix") < 0 ||
        check_run(r, at[1], at[1] + 1, 1) < 0)
        return NULL;
    Py_buffer ranks;
    if (PyObject_GetBuffer(args[2], &ranks, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t own = at[0] < 0 ? 0 : at[0], len = r->lens[at[1]];
    if (own > len)
        own = len;
    own -= own % 4;
    PyObject *out = PyBytes_FromStringAndSize(NULL, own);
    if (out == NULL)
        goto done;
    const unsigned char *in = r->data[at[1]];
    unsigned char *bytes = (unsigned char *)PyBytes_AS_STRING(out);
    const uint32_t *table = ranks.buf;
    Py_ssize_t size = ranks.len / 4;
    for (Py_ssize_t j = 0; j < own; j += 4) {
        uint32_t id = (uint32_t)in[j] << 24 | (uint32_t)in[j + 1] << 16 |
                      (uint32_t)in[j + 2] << 8 | in[j + 3];
        if ((Py_ssize_t)id >= size) {
            PyErr_SetString(PyExc_IndexError, "Runs.ranked_prefix: an id past the ranks");
            Py_CLEAR(out);
            goto done;
        }
        uint32_t rank = table[id];
        bytes[j] = (unsigned char)(rank >> 24);
        bytes[j + 1] = (unsigned char)(rank >> 16);
        bytes[j + 2] = (unsigned char)(rank >> 8);
        bytes[j + 3] = (unsigned char)rank;
    }
done:
    PyBuffer_Release(&ranks);
    return out;
}

/* into[key] = combine(into.get(key), value), or value where key is new: a count added
 * (PyNumber_Add), a rank mask or-ed (PyNumber_Or) */
static int
merge_value(PyObject *into, PyObject *key, PyObject *value, binaryfunc combine)
{
    PyObject *old = PyDict_GetItemWithError(into, key);
    if (old == NULL) {
        if (PyErr_Occurred())
            return -1;
        return PyDict_SetItem(into, key, value);
    }
    PyObject *both = combine(old, value);
    if (both == NULL)
        return -1;
    int status = PyDict_SetItem(into, key, both);
    Py_DECREF(both);
    return status;
}

/* tally(start, end, ops, streams, dtypes, op_masks): the run's counts added by op, by
 * stream role and, for the positions with a dtype (not None), by dtype; each op's rank
 * masks or-ed into op_masks (``PyRuns.tally``) */
static PyObject *
runs_tally(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t at[2];
    if (nargs != 6 || !PyDict_Check(args[2]) || !PyDict_Check(args[3]) ||
        !PyDict_Check(args[4]) || !PyDict_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "Runs.tally(start, end, ops, streams, dtypes, op_masks): four dicts");
        return NULL;
    }
    if (parse_positions(args, 2, 2, at, "tally") < 0 || check_run(r, at[0], at[1], 0) < 0)
        return NULL;
    for (Py_ssize_t i = at[0]; i < at[1]; i++) {
        PyObject *count = PyLong_FromLongLong(r->below[i + 1] - r->below[i]);
        if (count == NULL)
            return NULL;
        PyObject *dtype = PyTuple_GET_ITEM(r->dtypes, i);
        PyObject *op = PyTuple_GET_ITEM(r->ops, i);
        int status = merge_value(args[2], op, count, PyNumber_Add);
        if (status == 0)
            status = merge_value(args[3], PyTuple_GET_ITEM(r->streams, i), count, PyNumber_Add);
        if (status == 0 && dtype != Py_None)
            status = merge_value(args[4], dtype, count, PyNumber_Add);
        if (status == 0)
            status = merge_value(args[5], op, PyTuple_GET_ITEM(r->masks, i), PyNumber_Or);
        Py_DECREF(count);
        if (status < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
runs_distinct_prefixes(Runs *r, PyObject *Py_UNUSED(ignored))
{
    long long total = 0;
    Py_ssize_t width = r->width;
    for (Py_ssize_t i = 0; i < r->n; i++) {
        Py_ssize_t shared = 0; /* whole ids in common with the previous path */
        if (i > 0) {
            Py_ssize_t size = r->lens[i - 1] < r->lens[i] ? r->lens[i - 1] : r->lens[i];
            while ((shared + 1) * width <= size &&
                   memcmp(r->data[i - 1] + shared * width, r->data[i] + shared * width,
                          (size_t)width) == 0)
                shared++;
        }
        total += r->lens[i] / width - shared;
    }
    return PyLong_FromLongLong(total);
}

/* ------------------------------------------------------------ the divergent search */

typedef struct {
    Py_ssize_t own, start, end, parent;
    PyObject *mask; /* owned */
} Pending;

typedef struct {
    Pending *items;
    Py_ssize_t size, cap;
} PendingStack;

static int
push(PendingStack *s, Py_ssize_t own, Py_ssize_t start, Py_ssize_t end, PyObject *mask,
     Py_ssize_t parent)
{
    if (s->size == s->cap) {
        Py_ssize_t cap = s->cap ? s->cap * 2 : 64;
        Pending *items = PyMem_Realloc(s->items, (size_t)cap * sizeof(Pending));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = items;
        s->cap = cap;
    }
    Py_INCREF(mask);
    s->items[s->size++] = (Pending){own, start, end, parent, mask};
    return 0;
}

static void
clear_stack(PendingStack *s)
{
    for (Py_ssize_t i = 0; i < s->size; i++)
        Py_DECREF(s->items[i].mask);
    PyMem_Free(s->items);
}

static int
append_pair(PyObject *list, long long first, Py_ssize_t second)
{
    PyObject *pair = Py_BuildValue("(Ln)", first, second);
    if (pair == NULL)
        return -1;
    int status = PyList_Append(list, pair);
    Py_DECREF(pair);
    return status;
}

static int
append_index(PyObject *list, Py_ssize_t value)
{
    PyObject *number = PyLong_FromSsize_t(value);
    if (number == NULL)
        return -1;
    int status = PyList_Append(list, number);
    Py_DECREF(number);
    return status;
}

static PyObject *
runs_divergent(Runs *r, PyObject *const *args, Py_ssize_t nargs)
{
    Bound floor, rank_floor;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "Runs.divergent(floor, rank_floor)");
        return NULL;
    }
    if (to_bound(args[0], &floor) < 0 || to_bound(args[1], &rank_floor) < 0)
        return NULL;
    PyObject *parent_of = PyList_New(0), *idents = PyList_New(0), *found = PyList_New(0);
    PendingStack skeleton = {0}, search = {0};
    PyObject *result = NULL;
    Py_ssize_t width = r->width;
    if (parent_of == NULL || idents == NULL || found == NULL)
        goto done;
    if (push(&skeleton, 0, 0, r->n, r->all_mask, -1) < 0)
        goto done;
    while (skeleton.size) { /* the nodes at or above floor (as the build makes them) */
        Pending at = skeleton.items[--skeleton.size];
        Py_ssize_t start = skip_ended(r, at.own, at.start, at.end);
        int failed = 0;
        while (start < at.end && !failed) {
            Py_ssize_t stop = run_end(r, at.own, start, at.end);
            long long weight = r->below[stop] - r->below[start];
            if (reaches(weight, &floor)) {
                PyObject *mask = run_mask(r, start, stop);
                failed = mask == NULL || push(&skeleton, at.own + width, start, stop, mask, -1) < 0;
                Py_XDECREF(mask);
            }
            else if (reaches(weight, &rank_floor)) {
                failed = push(&search, at.own + width, start, stop, at.mask, -1) < 0;
            }
            start = stop;
        }
        Py_DECREF(at.mask);
        if (failed)
            goto done;
    }
    while (search.size) { /* below floor: every node that is or may hold a divergent one */
        Pending at = search.items[--search.size];
        long long weight = r->below[at.end] - r->below[at.start];
        if (!reaches(weight, &rank_floor)) {
            Py_DECREF(at.mask);
            continue; /* counts only shrink downwards: nothing below qualifies */
        }
        Py_ssize_t node = PyList_GET_SIZE(parent_of);
        PyObject *mask = NULL;
        int failed = append_index(parent_of, at.parent) < 0 ||
                     append_pair(idents, at.own, at.start) < 0 ||
                     (mask = run_mask(r, at.start, at.end)) == NULL;
        if (!failed) {
            int differs = PyObject_RichCompareBool(mask, at.mask, Py_NE);
            failed = differs < 0 || (differs && append_pair(found, weight, node) < 0);
        }
        if (!failed && r->changes[at.end] != r->changes[at.start + 1]) {
            Py_ssize_t start = skip_ended(r, at.own, at.start, at.end);
            while (start < at.end && !failed) {
                Py_ssize_t stop = run_end(r, at.own, start, at.end);
                failed = push(&search, at.own + width, start, stop, mask, node) < 0;
                start = stop;
            }
        }
        Py_XDECREF(mask);
        Py_DECREF(at.mask);
        if (failed)
            goto done;
    }
    result = PyTuple_Pack(3, parent_of, idents, found);
done:
    clear_stack(&skeleton);
    clear_stack(&search);
    Py_XDECREF(parent_of);
    Py_XDECREF(idents);
    Py_XDECREF(found);
    return result;
}

/* ------------------------------------------------------------ the paths */

typedef struct {
    Py_buffer view;
    const int *items;
    Py_ssize_t size;
} IntTable;

static int
open_table(PyObject *source, IntTable *table, const char *what)
{
    if (PyObject_GetBuffer(source, &table->view, PyBUF_SIMPLE) < 0)
        return -1;
    if (table->view.len % (Py_ssize_t)sizeof(int)) {
        PyBuffer_Release(&table->view);
        table->view.obj = NULL;
        PyErr_Format(PyExc_ValueError, "callsite_paths: %s is not an int32 array", what);
        return -1;
    }
    table->items = table->view.buf;
    table->size = table->view.len / (Py_ssize_t)sizeof(int);
    return 0;
}

static inline void
put_id(unsigned char *out, uint32_t id)
{
    out[0] = (unsigned char)(id >> 24);
    out[1] = (unsigned char)(id >> 16);
    out[2] = (unsigned char)(id >> 8);
    out[3] = (unsigned char)id;
}

/* callsite_paths(stacks, apis, api_index, tables, width) -> (paths, frame_paths) */
static PyObject *
callsite_paths(PyObject *Py_UNUSED(module), PyObject *args)
{
    static const char *names[8] = {"frame_keys", "frame_quals", "frame_mods", "frame_torch",
                                   "api_keys",   "api_quals",   "api_mods",   "api_torch"};
    PyObject *stacks, *apis, *api_index, *tables;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "O!O!O!On:callsite_paths", &PyList_Type, &stacks, &PyList_Type,
                          &apis, &PyDict_Type, &api_index, &tables, &width))
        return NULL;
    if (width != 4) {
        PyErr_SetString(PyExc_ValueError, "callsite_paths: only 4-byte ids");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(stacks);
    if (PyList_GET_SIZE(apis) != n) {
        PyErr_SetString(PyExc_ValueError, "callsite_paths: one api per stack");
        return NULL;
    }
    if (!PyTuple_Check(tables) || PyTuple_GET_SIZE(tables) != 8) {
        PyErr_SetString(PyExc_TypeError, "callsite_paths: tables is a PathTables");
        return NULL;
    }
    IntTable t[8];
    int opened = 0;
    PyObject *paths = NULL, *frame_paths = NULL, *result = NULL;
    unsigned char *path = NULL, *frame_path = NULL;
    Py_ssize_t cap = 0;
    for (; opened < 8; opened++)
        if (open_table(PyTuple_GET_ITEM(tables, opened), &t[opened], names[opened]) < 0)
            goto done;
    const int *keys = t[0].items, *quals = t[1].items, *mods = t[2].items, *torch = t[3].items;
    const int *api_keys = t[4].items, *api_quals = t[5].items, *api_mods = t[6].items,
              *api_torch = t[7].items;
    Py_ssize_t frames = t[0].size, n_apis = t[4].size;
    for (int i = 1; i < 8; i++) {
        if (t[i].size != (i < 4 ? frames : n_apis)) {
            PyErr_Format(PyExc_ValueError, "callsite_paths: %s has the wrong length", names[i]);
            goto done;
        }
    }
    paths = PyList_New(n);
    frame_paths = PyList_New(n);
    if (paths == NULL || frame_paths == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *stack = PyList_GET_ITEM(stacks, i);
        if (!PyTuple_Check(stack)) {
            PyErr_SetString(PyExc_TypeError, "callsite_paths: a stack is not a tuple");
            goto done;
        }
        Py_ssize_t depth = PyTuple_GET_SIZE(stack);
        if (depth + 1 > cap) {
            cap = (depth + 1) * 2;
            PyMem_Free(path);
            PyMem_Free(frame_path);
            path = PyMem_Malloc((size_t)cap * 4);
            frame_path = PyMem_Malloc((size_t)cap * 4);
            if (path == NULL || frame_path == NULL) {
                PyErr_NoMemory();
                goto done;
            }
        }
        Py_ssize_t used = 0;
        for (Py_ssize_t j = 0; j < depth; j++) {
            Py_ssize_t frame = as_index(PyTuple_GET_ITEM(stack, j));
            if (frame == -1 && PyErr_Occurred())
                goto done;
            if (frame < 0 || frame >= frames) {
                PyErr_SetString(PyExc_IndexError, "callsite_paths: frame id out of range");
                goto done;
            }
            if (keys[frame] < 0)
                continue; /* hidden */
            put_id(path + used * 4, (uint32_t)keys[frame]);
            put_id(frame_path + used * 4, (uint32_t)frame);
            used++;
        }
        Py_ssize_t frame_used = used;
        PyObject *api = PyList_GET_ITEM(apis, i);
        if (api != Py_None) {
            PyObject *found = PyDict_GetItemWithError(api_index, api);
            if (found == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, api);
                goto done;
            }
            Py_ssize_t index = as_index(found);
            if (index == -1 && PyErr_Occurred())
                goto done;
            if (index < 0 || index >= n_apis) {
                PyErr_SetString(PyExc_IndexError, "callsite_paths: api index out of range");
                goto done;
            }
            if (used) {
                const unsigned char *tail = frame_path + (used - 1) * 4;
                uint32_t last = (uint32_t)tail[0] << 24 | (uint32_t)tail[1] << 16 |
                                (uint32_t)tail[2] << 8 | tail[3];
                if (mods[last] >= 0 && quals[last] == api_quals[index] &&
                    (mods[last] == api_mods[index] || (api_torch[index] && torch[last]))) {
                    used--; /* the api's own Python function: the api replaces it */
                    frame_used--;
                }
            }
            put_id(path + used * 4, (uint32_t)api_keys[index]);
            used++;
        }
        PyObject *made = PyBytes_FromStringAndSize((const char *)path, used * 4);
        if (made == NULL)
            goto done;
        PyList_SET_ITEM(paths, i, made);
        made = PyBytes_FromStringAndSize((const char *)frame_path, frame_used * 4);
        if (made == NULL)
            goto done;
        PyList_SET_ITEM(frame_paths, i, made);
    }
    result = PyTuple_Pack(2, paths, frame_paths);
done:
    for (int i = 0; i < opened; i++)
        PyBuffer_Release(&t[i].view);
    PyMem_Free(path);
    PyMem_Free(frame_path);
    Py_XDECREF(paths);
    Py_XDECREF(frame_paths);
    return result;
}

/* A callsite's (or its per_rank's) fields read in place. msgspec keeps a Struct's
 * fields in slots: where the first object's type has a member descriptor (T_OBJECT_EX)
 * for every name, an object of exactly that type is read at those offsets, a borrowed
 * read that writes no reference count (in the forked helper that runs divergence,
 * the callsites' pages then stay shared with the main process); an object of any
 * other type (a test's namespace, a subclass) is read through getattr, the value held
 * in ``held`` until the call returns. */
#define MAX_FIELDS 8
typedef struct {
    PyTypeObject *type; /* strong; NULL: every object through getattr */
    Py_ssize_t offset[MAX_FIELDS];
    PyObject *const *names;
    int count;
    PyObject *held; /* list, made on first use */
} Fields;

static void
fields_open(Fields *f, PyObject *const *names, int count, PyObject *first)
{
    f->type = NULL;
    f->names = names;
    f->count = count;
    f->held = NULL;
    if (first == NULL)
        return;
    PyTypeObject *type = Py_TYPE(first);
    for (int k = 0; k < count; k++) {
        PyObject *descr = _PyType_Lookup(type, names[k]); /* borrowed, no error set */
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
            return;
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX)
            return;
        f->offset[k] = member->offset;
    }
    f->type = (PyTypeObject *)Py_NewRef(type);
}

static void
fields_close(Fields *f)
{
    Py_CLEAR(f->type);
    Py_CLEAR(f->held);
}

/* field ``k`` of ``obj``, borrowed (NULL with an exception set where it has none) */
static PyObject *
field(Fields *f, PyObject *obj, int k)
{
    if (Py_TYPE(obj) == f->type) {
        PyObject *value = *(PyObject **)((char *)obj + f->offset[k]);
        if (value == NULL)
            PyErr_SetObject(PyExc_AttributeError, f->names[k]);
        return value;
    }
    PyObject *value = PyObject_GetAttr(obj, f->names[k]);
    if (value == NULL)
        return NULL;
    if (f->held == NULL && (f->held = PyList_New(0)) == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    int failed = PyList_Append(f->held, value);
    Py_DECREF(value);
    return failed < 0 ? NULL : value;
}

/* the interned names of a Callsite's fields read here, and of a PerRank's */
enum {
    SITE_STACK,
    SITE_OP,
    SITE_API,
    SITE_COUNT,
    SITE_RANKS,
    SITE_PER_RANK,
    SITE_DTYPE,
    SITE_FIELDS
};
enum { STATS_COUNTS, STATS_MIN, STATS_MAX, STATS_MIN_RANKS, STATS_MAX_RANKS, STATS_FIELDS };
static PyObject *site_names[SITE_FIELDS], *stats_names[STATS_FIELDS];

static int
field_names_ready(void)
{
    if (site_names[0] != NULL)
        return 0;
    const char *site[] = {"stack", "op", "api", "count", "ranks", "per_rank", "dtype"};
    const char *stats[] = {"counts", "min", "max", "min_ranks", "max_ranks"};
    for (int k = 0; k < SITE_FIELDS; k++)
        if ((site_names[k] = PyUnicode_InternFromString(site[k])) == NULL)
            return -1;
    for (int k = 0; k < STATS_FIELDS; k++)
        if ((stats_names[k] = PyUnicode_InternFromString(stats[k])) == NULL)
            return -1;
    return 0;
}

/* object pointer -> a byte, open addressing (a power of two slots, at most half used) */
typedef struct {
    PyObject **keys;
    unsigned char *values;
    size_t slots, used;
} PointerFlags;

static inline size_t
pointer_slot(const PointerFlags *t, PyObject *key)
{
    size_t slot = ((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ULL & (t->slots - 1);
    while (t->keys[slot] != NULL && t->keys[slot] != key)
        slot = (slot + 1) & (t->slots - 1);
    return slot;
}

static int
pointer_put(PointerFlags *t, PyObject *key, unsigned char value)
{
    if (2 * (t->used + 1) > t->slots) {
        PointerFlags grown = {NULL, NULL, t->slots ? 2 * t->slots : 16, 0};
        grown.keys = PyMem_Calloc(grown.slots, sizeof(PyObject *));
        grown.values = PyMem_Calloc(grown.slots, 1);
        if (grown.keys == NULL || grown.values == NULL) {
            PyMem_Free(grown.keys);
            PyMem_Free(grown.values);
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < t->slots; i++)
            if (t->keys[i] != NULL) {
                size_t slot = pointer_slot(&grown, t->keys[i]);
                grown.keys[slot] = t->keys[i];
                grown.values[slot] = t->values[i];
                grown.used++;
            }
        PyMem_Free(t->keys);
        PyMem_Free(t->values);
        *t = grown;
    }
    size_t slot = pointer_slot(t, key);
    t->used += t->keys[slot] == NULL;
    t->keys[slot] = key;
    t->values[slot] = value;
    return 0;
}

/* visible_frames(stacks, hidden, user) -> (visible, callers): per stack (a tuple of
 * frame ids), its frame ids without the hidden ones (a list, one per distinct tuple
 * object) and its caller: the position of the innermost visible user frame, else of
 * the innermost visible frame, else None. ``hidden`` and ``user`` are bytes by frame
 * id (non-zero: true). */
static PyObject *
visible_core(PyObject *const *stacks, Py_ssize_t n, Py_buffer hidden, Py_buffer user)
{
    PyObject *visible = NULL, *callers = NULL, *result = NULL;
    const unsigned char *is_hidden = hidden.buf, *is_user = user.buf;
    Py_ssize_t frames = hidden.len;
    /* id(stack) -> index + 1 of its first site: open addressing, a power of two */
    size_t slots = 16;
    while (slots < (size_t)n * 2)
        slots *= 2;
    PyObject **seen_key = PyMem_Calloc(slots, sizeof(PyObject *));
    Py_ssize_t *seen_at = PyMem_Calloc(slots, sizeof(Py_ssize_t));
    if (seen_key == NULL || seen_at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (user.len != frames) {
        PyErr_SetString(PyExc_ValueError, "visible_frames: hidden and user differ in length");
        goto done;
    }
    visible = PyList_New(n);
    callers = PyList_New(n);
    if (visible == NULL || callers == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *stack = stacks[i];
        size_t slot = ((uintptr_t)stack >> 4) * 0x9E3779B97F4A7C15ULL & (slots - 1);
        while (seen_key[slot] != NULL && seen_key[slot] != stack)
            slot = (slot + 1) & (slots - 1);
        if (seen_key[slot] == stack) {
            Py_ssize_t at = seen_at[slot];
            PyList_SET_ITEM(visible, i, Py_NewRef(PyList_GET_ITEM(visible, at)));
            PyList_SET_ITEM(callers, i, Py_NewRef(PyList_GET_ITEM(callers, at)));
            continue;
        }
        seen_key[slot] = stack; /* borrowed: the list holds it while we run */
        seen_at[slot] = i;
        if (!PyTuple_Check(stack)) {
            PyErr_SetString(PyExc_TypeError, "visible_frames: a stack is not a tuple");
            goto done;
        }
        Py_ssize_t depth = PyTuple_GET_SIZE(stack), kept = 0, innermost_user = -1;
        for (Py_ssize_t j = 0; j < depth; j++) {
            Py_ssize_t frame = as_index(PyTuple_GET_ITEM(stack, j));
            if (frame == -1 && PyErr_Occurred())
                goto done;
            if (frame < 0 || frame >= frames) {
                PyErr_SetString(PyExc_IndexError, "visible_frames: frame id out of range");
                goto done;
            }
            kept += !is_hidden[frame];
        }
        PyObject *frames_of = PyList_New(kept);
        if (frames_of == NULL)
            goto done;
        PyList_SET_ITEM(visible, i, frames_of);
        kept = 0;
        for (Py_ssize_t j = 0; j < depth; j++) {
            PyObject *item = PyTuple_GET_ITEM(stack, j);
            Py_ssize_t frame = as_index(item);
            if (is_hidden[frame])
                continue;
            PyList_SET_ITEM(frames_of, kept, Py_NewRef(item));
            if (is_user[frame])
                innermost_user = kept;
            kept++;
        }
        Py_ssize_t caller = innermost_user >= 0 ? innermost_user : kept - 1;
        PyObject *position = caller >= 0 ? PyLong_FromSsize_t(caller) : Py_NewRef(Py_None);
        if (position == NULL)
            goto done;
        PyList_SET_ITEM(callers, i, position);
    }
    result = PyTuple_Pack(2, visible, callers);
done:
    PyMem_Free(seen_key);
    PyMem_Free(seen_at);
    Py_XDECREF(visible);
    Py_XDECREF(callers);
    return result;
}

static PyObject *
visible_frames(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *stacks;
    Py_buffer hidden, user;
    if (!PyArg_ParseTuple(args, "O!y*y*:visible_frames", &PyList_Type, &stacks, &hidden, &user))
        return NULL;
    PyObject *result = visible_core(PySequence_Fast_ITEMS(stacks), PyList_GET_SIZE(stacks),
                                    hidden, user);
    PyBuffer_Release(&hidden);
    PyBuffer_Release(&user);
    return result;
}

/* site_visible_frames(sites, indices, hidden, user) -> ``visible_frames`` of the
 * stacks of ``sites[i]`` for ``i`` in ``indices``, each read in place (``Fields``): no
 * list of the stacks, no reference count of a callsite or its stack written.
 * ``py_site_visible_frames`` in sorted_runs.py is the reference. */
static PyObject *
site_visible_frames(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *indices, *result = NULL;
    Py_buffer hidden, user;
    if (!PyArg_ParseTuple(args, "O!O!y*y*:site_visible_frames", &PyList_Type, &sites,
                          &PyList_Type, &indices, &hidden, &user))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(indices), nsites = PyList_GET_SIZE(sites);
    PyObject **stacks = PyMem_Malloc((n + 1) * sizeof(PyObject *));
    Fields f;
    fields_open(&f, site_names, SITE_FIELDS, NULL);
    if (stacks == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (field_names_ready() < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t index = as_index(PyList_GET_ITEM(indices, i));
        if (index == -1 && PyErr_Occurred())
            goto done;
        if (index < 0 || index >= nsites) {
            PyErr_SetString(PyExc_IndexError, "site_visible_frames: index out of range");
            goto done;
        }
        if (i == 0)
            fields_open(&f, site_names, SITE_FIELDS, PyList_GET_ITEM(sites, index));
        if ((stacks[i] = field(&f, PyList_GET_ITEM(sites, index), SITE_STACK)) == NULL)
            goto done;
    }
    result = visible_core(stacks, n, hidden, user);
done:
    fields_close(&f);
    PyMem_Free(stacks);
    PyBuffer_Release(&hidden);
    PyBuffer_Release(&user);
    return result;
}

/* One frame id of a stack tuple, checked against the number of frames (IndexError). */
static int
stack_frame(PyObject *stack, Py_ssize_t j, Py_ssize_t frames, const char *who, Py_ssize_t *out)
{
    Py_ssize_t frame = as_index(PyTuple_GET_ITEM(stack, j));
    if (frame == -1 && PyErr_Occurred())
        return -1;
    if (frame < 0 || frame >= frames) {
        PyErr_Format(PyExc_IndexError, "%s: frame id out of range", who);
        return -1;
    }
    *out = frame;
    return 0;
}

/* site_summary(sites, hidden, user, all_mask, mask_of, collective_op, collective_apis)
 * -> (callers, union, outside, full, collective, partial_dtyped): divergence's one
 * pass over every callsite, its fields read in place (``Fields``): ``py_stack_summary`` of the sites'
 * stacks with ``full`` (per site: its ranks are None, or ``mask_of(ranks) ==
 * all_mask``, asked once per ranks list object), and per site whether it is a
 * collective (``collective_op(op)``, asked once per op string, or its api is in
 * ``collective_apis``), as bytes; and the sites some ranks never ran (not ``full``)
 * whose dtype is not None, ascending. ``py_site_summary`` in sorted_runs.py is the
 * reference. */
static PyObject *
site_summary(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *all_mask, *mask_of, *collective_op, *collective_apis;
    Py_buffer hidden, user;
    if (!PyArg_ParseTuple(args, "O!y*y*OOOO:site_summary", &PyList_Type, &sites, &hidden, &user,
                          &all_mask, &mask_of, &collective_op, &collective_apis))
        return NULL;
    PyObject *callers = NULL, *union_ = NULL, *outside = NULL, *full = NULL, *collective = NULL;
    PyObject *result = NULL, *known_ops = NULL, *partial_dtyped = NULL;
    PointerFlags full_of = {NULL, NULL, 0, 0};
    Fields f;
    const unsigned char *is_hidden = hidden.buf, *is_user = user.buf;
    Py_ssize_t n = PyList_GET_SIZE(sites), frames = hidden.len;
    fields_open(&f, site_names, SITE_FIELDS, NULL);
    if (field_names_ready() < 0)
        goto done;
    fields_open(&f, site_names, SITE_FIELDS, n ? PyList_GET_ITEM(sites, 0) : NULL);
    if (user.len != frames) {
        PyErr_SetString(PyExc_ValueError, "site_summary: lengths differ");
        goto done;
    }
    if (frames > INT32_MAX) { /* callers are 4-byte frame ids */
        PyErr_SetString(PyExc_OverflowError, "site_summary: too many frames");
        goto done;
    }
    callers = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    union_ = PyByteArray_FromStringAndSize(NULL, frames);
    outside = PyList_New(0);
    full = PyBytes_FromStringAndSize(NULL, n);
    collective = PyBytes_FromStringAndSize(NULL, n);
    partial_dtyped = PyList_New(0);
    known_ops = PyDict_New();
    if (!callers || !union_ || !outside || !full || !collective || !partial_dtyped || !known_ops)
        goto done;
    int32_t *caller_of = (int32_t *)PyBytes_AS_STRING(callers);
    unsigned char *in_union = (unsigned char *)PyByteArray_AS_STRING(union_);
    unsigned char *is_full = (unsigned char *)PyBytes_AS_STRING(full);
    unsigned char *is_collective = (unsigned char *)PyBytes_AS_STRING(collective);
    memset(in_union, 0, (size_t)frames);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *site = PyList_GET_ITEM(sites, i);
        PyObject *stack = field(&f, site, SITE_STACK);
        PyObject *ranks = stack ? field(&f, site, SITE_RANKS) : NULL;
        PyObject *op = ranks ? field(&f, site, SITE_OP) : NULL;
        if (op == NULL)
            goto done;
        if (!PyTuple_Check(stack)) {
            PyErr_SetString(PyExc_TypeError, "site_summary: a stack is not a tuple");
            goto done;
        }
        if (ranks == Py_None) {
            is_full[i] = 1;
        } else {
            size_t slot = full_of.slots ? pointer_slot(&full_of, ranks) : 0;
            if (full_of.slots && full_of.keys[slot] == ranks) {
                is_full[i] = full_of.values[slot];
            } else {
                PyObject *mask = PyObject_CallOneArg(mask_of, ranks);
                int equal = mask ? PyObject_RichCompareBool(mask, all_mask, Py_EQ) : -1;
                Py_XDECREF(mask);
                if (equal < 0 || pointer_put(&full_of, ranks, (unsigned char)equal) < 0)
                    goto done;
                is_full[i] = (unsigned char)equal;
            }
        }
        PyObject *known = PyDict_GetItemWithError(known_ops, op); /* borrowed */
        if (known == NULL) {
            if (PyErr_Occurred())
                goto done;
            PyObject *answer = PyObject_CallOneArg(collective_op, op);
            int truth = answer ? PyObject_IsTrue(answer) : -1;
            Py_XDECREF(answer);
            if (truth < 0 || PyDict_SetItem(known_ops, op, truth ? Py_True : Py_False) < 0)
                goto done;
            known = truth ? Py_True : Py_False;
        }
        int is_c = known == Py_True;
        if (!is_c) {
            PyObject *api = field(&f, site, SITE_API);
            if (api == NULL || (is_c = PySequence_Contains(collective_apis, api)) < 0)
                goto done;
        }
        is_collective[i] = (unsigned char)is_c;
        if (!is_full[i]) { /* some ranks never ran it: with a dtype, dtype_mismatch reads it */
            PyObject *dtype = field(&f, site, SITE_DTYPE);
            if (dtype == NULL || (dtype != Py_None && append_index(partial_dtyped, i) < 0))
                goto done;
        }
        Py_ssize_t depth = PyTuple_GET_SIZE(stack), last = -1, innermost_user = -1, frame;
        for (Py_ssize_t j = 0; j < depth; j++) {
            if (stack_frame(stack, j, frames, "site_summary", &frame) < 0)
                goto done;
            if (is_hidden[frame])
                continue;
            last = frame;
            if (is_user[frame])
                innermost_user = frame;
            if (is_full[i])
                in_union[frame] = 1;
        }
        caller_of[i] = (int32_t)(innermost_user >= 0 ? innermost_user : last);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (is_full[i])
            continue;
        PyObject *stack = field(&f, PyList_GET_ITEM(sites, i), SITE_STACK); /* checked */
        if (stack == NULL)
            goto done;
        Py_ssize_t depth = PyTuple_GET_SIZE(stack), frame;
        for (Py_ssize_t j = 0; j < depth; j++) {
            frame = as_index(PyTuple_GET_ITEM(stack, j)); /* checked above */
            if (!is_hidden[frame] && !in_union[frame]) {
                if (append_index(outside, i) < 0)
                    goto done;
                break;
            }
        }
    }
    result = PyTuple_Pack(6, callers, union_, outside, full, collective, partial_dtyped);
done:
    fields_close(&f);
    PyMem_Free(full_of.keys);
    PyMem_Free(full_of.values);
    PyBuffer_Release(&hidden);
    PyBuffer_Release(&user);
    Py_XDECREF(callers);
    Py_XDECREF(union_);
    Py_XDECREF(outside);
    Py_XDECREF(full);
    Py_XDECREF(collective);
    Py_XDECREF(partial_dtyped);
    Py_XDECREF(known_ops);
    return result;
}

/* the positions ``i`` of ``sites`` whose stack (read through ``f``) has a frame id
 * marked (non-zero in ``marked``, bytes by frame id) */
static PyObject *
touching_core(PyObject *sites, Fields *f, Py_ssize_t n, Py_buffer marked)
{
    const unsigned char *is_marked = marked.buf;
    Py_ssize_t frames = marked.len, frame;
    PyObject *found = PyList_New(0);
    if (found == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *stack = field(f, PyList_GET_ITEM(sites, i), SITE_STACK);
        if (stack == NULL)
            goto fail;
        if (!PyTuple_Check(stack)) {
            PyErr_SetString(PyExc_TypeError, "touching: a stack is not a tuple");
            goto fail;
        }
        Py_ssize_t depth = PyTuple_GET_SIZE(stack);
        for (Py_ssize_t j = 0; j < depth; j++) {
            if (stack_frame(stack, j, frames, "touching", &frame) < 0)
                goto fail;
            if (is_marked[frame]) {
                if (append_index(found, i) < 0)
                    goto fail;
                break;
            }
        }
    }
    return found;
fail:
    Py_XDECREF(found);
    return NULL;
}

/* site_touching(sites, marked) -> ``py_touching`` of the sites' stacks, each read in place
 * (``Fields``): no list of them, no reference count written. ``py_site_touching`` in
 * sorted_runs.py is the reference. */
static PyObject *
site_touching(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *found = NULL;
    Py_buffer marked;
    if (!PyArg_ParseTuple(args, "O!y*:site_touching", &PyList_Type, &sites, &marked))
        return NULL;
    Fields f;
    fields_open(&f, site_names, SITE_FIELDS, NULL);
    if (field_names_ready() == 0) {
        Py_ssize_t n = PyList_GET_SIZE(sites);
        fields_open(&f, site_names, SITE_FIELDS, n ? PyList_GET_ITEM(sites, 0) : NULL);
        found = touching_core(sites, &f, n, marked);
    }
    fields_close(&f);
    PyBuffer_Release(&marked);
    return found;
}

static int
compare_ids(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* frames_at(frame_paths, origins, own, start, end) -> (first, distinct): over the
 * positions start..end of the sorted frame paths (4-byte big-endian frame ids), the
 * frame id at byte own of the position whose origin (index in trace order) is least,
 * and every distinct frame id at byte own, ascending */
static PyObject *
frames_at(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *frame_paths, *origins;
    Py_ssize_t own, start, end;
    if (!PyArg_ParseTuple(args, "O!O!nnn:frames_at", &PyList_Type, &frame_paths, &PyList_Type,
                          &origins, &own, &start, &end))
        return NULL;
    if (own < 0 || start < 0 || start >= end || end > PyList_GET_SIZE(frame_paths) ||
        PyList_GET_SIZE(origins) != PyList_GET_SIZE(frame_paths)) {
        PyErr_SetString(PyExc_ValueError, "frames_at: positions out of range");
        return NULL;
    }
    uint32_t *ids = PyMem_Malloc((size_t)(end - start) * sizeof(uint32_t));
    if (ids == NULL)
        return PyErr_NoMemory();
    Py_ssize_t used = 0, least = PY_SSIZE_T_MAX;
    uint32_t first = 0;
    PyObject *result = NULL, *distinct = NULL;
    for (Py_ssize_t i = start; i < end; i++) {
        PyObject *path = PyList_GET_ITEM(frame_paths, i);
        if (!PyBytes_Check(path) || own > PyBytes_GET_SIZE(path) - 4) {
            PyErr_SetString(PyExc_ValueError, "frames_at: a frame path has no id there");
            goto done;
        }
        const unsigned char *at = (const unsigned char *)PyBytes_AS_STRING(path) + own;
        uint32_t id = (uint32_t)at[0] << 24 | (uint32_t)at[1] << 16 | (uint32_t)at[2] << 8 | at[3];
        Py_ssize_t origin = as_index(PyList_GET_ITEM(origins, i));
        if (origin == -1 && PyErr_Occurred())
            goto done;
        if (origin < least) {
            least = origin;
            first = id;
        }
        if (used == 0 || ids[used - 1] != id) /* runs are sorted: repeats come together */
            ids[used++] = id;
    }
    qsort(ids, (size_t)used, sizeof(uint32_t), compare_ids);
    distinct = PyList_New(0);
    if (distinct == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < used; i++) {
        if (i > 0 && ids[i] == ids[i - 1])
            continue;
        PyObject *number = PyLong_FromUnsignedLong(ids[i]);
        if (number == NULL || PyList_Append(distinct, number) < 0) {
            Py_XDECREF(number);
            goto done;
        }
        Py_DECREF(number);
    }
    result = Py_BuildValue("(kO)", (unsigned long)first, distinct);
done:
    PyMem_Free(ids);
    Py_XDECREF(distinct);
    return result;
}

/* skew_fold(sites, callers, function, skip, functions, ranks, skew) -> (ops, full,
 * example, found): divergence's count_skew fold over the callsites not
 * ``skip``ped (bytes, one a site: the collectives), the same numbers as the Python
 * reference ``py_skew_fold`` (opguard_plugins/stages/divergence.py), bit for bit: the
 * same additions in the same order. A site's calling function is
 * ``function[callers[i]]`` (native 4-byte ints: ``callers`` by site, -1 for none, the
 * last slot; ``function`` by frame id); ``example`` holds positions in ``sites``;
 * ``full`` says per slot whether every rank ran a callsite of it (one whose ranks are
 * None, or the ranks of its others together: a rank outside ``ranks`` spoils that). A site is read in place (``Fields``: count, ranks, per_rank and
 * per_rank's counts, min, max, min_ranks, max_ranks). A rank outside ``ranks`` is a
 * ValueError, a sum of ops past 2**63-1 an OverflowError. */

/* mark the positions of ``present``'s ranks in ``*cover`` (made on first use),
 * counting new ones in ``*covered``; a rank outside the trace's makes it -1 */
static int
cover_ranks(unsigned char **cover, Py_ssize_t *covered, PyObject *present, Py_ssize_t nranks,
            const Py_ssize_t *position, Py_ssize_t limit)
{
    if (*cover == NULL && (*cover = PyMem_Calloc(nranks, 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *fast = PySequence_Fast(present, "skew_fold: ranks must be a list");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t rank = as_index(items[j]);
        if (rank == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (rank < 0 || rank >= limit || position[rank] < 0) {
            *covered = -1;
            break;
        }
        if (!(*cover)[position[rank]]) { /* a rank outside spoils even a covered slot */
            (*cover)[position[rank]] = 1;
            ++*covered;
        }
    }
    Py_DECREF(fast);
    return 0;
}

static int
compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* the position of ``rank`` in the trace's ranks, or -1 with ValueError set */
static inline Py_ssize_t
rank_position(PyObject *rank, const Py_ssize_t *position, Py_ssize_t limit)
{
    Py_ssize_t value = as_index(rank);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value >= limit || position[value] < 0) {
        PyErr_Format(PyExc_ValueError, "skew_fold: rank %zd is not one of the trace's", value);
        return -1;
    }
    return position[value];
}

/* row[position of each rank in ``holders``] += value */
static int
add_to_ranks(double *row, PyObject *holders, double value, const Py_ssize_t *position,
             Py_ssize_t limit)
{
    PyObject *fast = PySequence_Fast(holders, "skew_fold: ranks must be a list");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t at = rank_position(items[j], position, limit);
        if (at < 0) {
            Py_DECREF(fast);
            return -1;
        }
        row[at] += value;
    }
    Py_DECREF(fast);
    return 0;
}

static PyObject *
skew_fold(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *ranks;
    Py_buffer callers_buf, function_buf, skip_buf;
    Py_ssize_t functions;
    double skew;
    if (!PyArg_ParseTuple(args, "O!y*y*y*nO!d:skew_fold", &PyList_Type, &sites, &callers_buf,
                          &function_buf, &skip_buf, &functions, &PyList_Type, &ranks, &skew))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(sites), nranks = PyList_GET_SIZE(ranks), size = functions + 1;
    Py_ssize_t nframes = function_buf.len / (Py_ssize_t)sizeof(int32_t);
    const int32_t *caller_of = callers_buf.buf, *function_of = function_buf.buf;
    const unsigned char *skipped = skip_buf.buf;
    PyObject *result = NULL, *found = NULL, *ops_list = NULL;
    unsigned char **cover = NULL; /* per slot, per rank position: ran a partial callsite */
    Py_ssize_t *covered = NULL;   /* per slot: how many positions; -1: a rank outside */
    PyObject *full = NULL, *example_list = NULL;
    double *totals = NULL, *sorted_totals = NULL;
    long long *ops = NULL, *best = NULL;
    double *uniform = NULL, **rows = NULL;
    Py_ssize_t *example = NULL, *order = NULL;
    Py_ssize_t varied_count = 0, limit = 0, *position = NULL;
    char *is_full = NULL;
    int stats_open = 0;
    Fields f, g;
    fields_open(&f, site_names, SITE_FIELDS, NULL);
    fields_open(&g, stats_names, STATS_FIELDS, NULL);
    if (field_names_ready() < 0)
        goto done;
    if (callers_buf.len != n * (Py_ssize_t)sizeof(int32_t) || skip_buf.len != n
        || function_buf.len % (Py_ssize_t)sizeof(int32_t) || functions < 0 || nranks == 0) {
        PyErr_SetString(PyExc_ValueError, "skew_fold: sites, callers and skip differ in length, "
                                          "or no function or rank");
        goto done;
    }
    fields_open(&f, site_names, SITE_FIELDS, n ? PyList_GET_ITEM(sites, 0) : NULL);
    ops = PyMem_Calloc(size, sizeof(long long));
    uniform = PyMem_Calloc(size, sizeof(double));
    best = PyMem_Malloc(size * sizeof(long long));
    example = PyMem_Malloc(size * sizeof(Py_ssize_t));
    rows = PyMem_Calloc(size, sizeof(double *));
    order = PyMem_Malloc(size * sizeof(Py_ssize_t)); /* slots as first varied */
    is_full = PyMem_Calloc(size, 1);
    cover = PyMem_Calloc(size, sizeof(unsigned char *));
    covered = PyMem_Calloc(size, sizeof(Py_ssize_t));
    if (!ops || !uniform || !best || !example || !rows || !order || !is_full || !cover
        || !covered) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        best[i] = -1;
        example[i] = -1;
    }
    for (Py_ssize_t i = 0; i < nranks; i++) {
        Py_ssize_t rank = as_index(PyList_GET_ITEM(ranks, i));
        if (rank == -1 && PyErr_Occurred())
            goto done;
        if (rank < 0) {
            PyErr_SetString(PyExc_ValueError, "skew_fold: a rank is negative");
            goto done;
        }
        if (rank + 1 > limit)
            limit = rank + 1;
    }
    position = PyMem_Malloc(limit * sizeof(Py_ssize_t));
    if (position == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < limit; i++)
        position[i] = -1;
    for (Py_ssize_t i = 0; i < nranks; i++)
        position[as_index(PyList_GET_ITEM(ranks, i))] = i;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (skipped[i])
            continue;
        PyObject *site = PyList_GET_ITEM(sites, i);
        Py_ssize_t frame = caller_of[i], number = -1;
        if (frame >= nframes || frame < -1) {
            PyErr_SetString(PyExc_IndexError, "skew_fold: caller frame id out of range");
            goto done;
        }
        if (frame >= 0)
            number = function_of[frame];
        if (number < -1 || number >= functions) {
            PyErr_SetString(PyExc_IndexError, "skew_fold: function number out of range");
            goto done;
        }
        Py_ssize_t slot = number >= 0 ? number : functions;
        PyObject *count_obj = field(&f, site, SITE_COUNT);
        if (count_obj == NULL)
            goto done;
        long long count = PyLong_AsLongLong(count_obj);
        if (count == -1 && PyErr_Occurred())
            goto done;
        if (number >= 0 && count > best[slot]) {
            best[slot] = count;
            example[slot] = i;
        }
        if (__builtin_add_overflow(ops[slot], count, &ops[slot])) {
            PyErr_SetString(PyExc_OverflowError, "skew_fold: ops past 2**63-1");
            goto done;
        }
        PyObject *present = field(&f, site, SITE_RANKS);
        PyObject *stats = present ? field(&f, site, SITE_PER_RANK) : NULL;
        if (stats == NULL)
            goto done;
        if (stats != Py_None && !stats_open) { /* the first per_rank's type */
            fields_open(&g, stats_names, STATS_FIELDS, stats);
            stats_open = 1;
        }
        int failed = 0;
        if (present == Py_None) {
            is_full[slot] = 1;
        } else if (covered[slot] >= 0) {
            failed = cover_ranks(&cover[slot], &covered[slot], present, nranks, position, limit);
        }
        if (failed) {
        } else if (stats == Py_None && present == Py_None) {
            uniform[slot] += (double)(count / nranks);
        } else {
            double *row = rows[slot];
            if (row == NULL) {
                row = rows[slot] = PyMem_Calloc(nranks, sizeof(double));
                if (row == NULL) {
                    PyErr_NoMemory();
                    failed = 1;
                } else {
                    order[varied_count++] = slot;
                }
            }
            if (failed) {
            } else if (stats == Py_None) {
                Py_ssize_t len = PyObject_Length(present);
                failed = len <= 0
                    || add_to_ranks(row, present, (double)(count / len), position, limit) < 0;
                if (len == 0)
                    PyErr_SetString(PyExc_ValueError, "skew_fold: a callsite with no rank");
            } else {
                PyObject *counts = field(&g, stats, STATS_COUNTS);
                if (counts == NULL) {
                    failed = 1;
                } else if (counts != Py_None) {
                    PyObject *fast = PySequence_Fast(counts, "skew_fold: counts must be a list");
                    failed = fast == NULL;
                    for (Py_ssize_t j = 0; !failed && j < PySequence_Fast_GET_SIZE(fast); j++) {
                        PyObject *pair = PySequence_Fast_GET_ITEM(fast, j);
                        PyObject *value_obj = NULL, *holders = NULL;
                        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                            PyErr_SetString(PyExc_TypeError, "skew_fold: a count is not a pair");
                            failed = 1;
                            break;
                        }
                        value_obj = PyTuple_GET_ITEM(pair, 0);
                        holders = PyTuple_GET_ITEM(pair, 1);
                        long long value = PyLong_AsLongLong(value_obj);
                        failed = (value == -1 && PyErr_Occurred())
                            || add_to_ranks(row, holders, (double)value, position, limit) < 0;
                    }
                    Py_XDECREF(fast);
                } else {
                    PyObject *low = field(&g, stats, STATS_MIN_RANKS);
                    PyObject *high = low ? field(&g, stats, STATS_MAX_RANKS) : NULL;
                    PyObject *low_value = high ? field(&g, stats, STATS_MIN) : NULL;
                    PyObject *high_value = low_value ? field(&g, stats, STATS_MAX) : NULL;
                    failed = !low || !high || !low_value || !high_value;
                    long long lo = failed ? 0 : PyLong_AsLongLong(low_value);
                    long long hi = failed ? 0 : PyLong_AsLongLong(high_value);
                    Py_ssize_t nlow = failed ? 0 : PyObject_Length(low);
                    Py_ssize_t nhigh = failed ? 0 : PyObject_Length(high);
                    Py_ssize_t npresent = present == Py_None ? nranks : PyObject_Length(present);
                    failed = failed || PyErr_Occurred() != NULL || nlow < 0 || nhigh < 0
                        || npresent < 0;
                    if (!failed) {
                        Py_ssize_t rest = npresent - nlow - nhigh;
                        /* Python: (count - min * len(low) - max * len(high)) / rest, an
                           int division rounded once: in doubles only while the numerator
                           is exact in one (|n| <= 2**53), else Python's own division */
                        long long numerator = count - lo * nlow - hi * nhigh;
                        double share = 0.0;
                        if (rest && numerator <= (1LL << 53) && numerator >= -(1LL << 53)) {
                            share = (double)numerator / (double)rest;
                        } else if (rest) {
                            PyObject *n = PyLong_FromLongLong(numerator);
                            PyObject *d = n ? PyLong_FromSsize_t(rest) : NULL;
                            PyObject *q = d ? PyNumber_TrueDivide(n, d) : NULL;
                            share = q ? PyFloat_AsDouble(q) : 0.0;
                            failed = q == NULL;
                            Py_XDECREF(n);
                            Py_XDECREF(d);
                            Py_XDECREF(q);
                        }
                        if (failed) {
                            /* the division's error is set */
                        } else if (present == Py_None)
                            uniform[slot] += share;
                        else
                            failed = add_to_ranks(row, present, share, position, limit) < 0;
                        failed = failed
                            || add_to_ranks(row, low, (double)lo - share, position, limit) < 0
                            || add_to_ranks(row, high, (double)hi - share, position, limit) < 0;
                    }
                }
            }
        }
        if (failed)
            goto done;
    }
    ops_list = PyList_New(size);
    example_list = PyList_New(size);
    for (Py_ssize_t i = 0; i < size; i++)
        is_full[i] |= covered[i] == nranks;
    full = PyByteArray_FromStringAndSize(is_full, size);
    found = PyList_New(0);
    totals = PyMem_Malloc(nranks * sizeof(double));
    sorted_totals = PyMem_Malloc(nranks * sizeof(double));
    if (!ops_list || !example_list || !full || !found || !totals || !sorted_totals) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        PyObject *op = PyLong_FromLongLong(ops[i]);
        PyObject *at = example[i] >= 0 ? PyLong_FromSsize_t(example[i]) : Py_NewRef(Py_None);
        if (!op || !at) {
            Py_XDECREF(op);
            Py_XDECREF(at);
            goto done;
        }
        PyList_SET_ITEM(ops_list, i, op);
        PyList_SET_ITEM(example_list, i, at);
    }
    for (Py_ssize_t k = 0; k < varied_count; k++) {
        Py_ssize_t slot = order[k];
        for (Py_ssize_t r = 0; r < nranks; r++)
            totals[r] = sorted_totals[r] = uniform[slot] + rows[slot][r];
        qsort(sorted_totals, nranks, sizeof(double), compare_doubles);
        double middle = sorted_totals[(nranks - 1) / 2], limit = skew * middle;
        Py_ssize_t strays = 0;
        for (Py_ssize_t r = 0; r < nranks; r++)
            strays += fabs(totals[r] - middle) > limit;
        if (!strays)
            continue;
        /* the per-rank totals as native doubles (8 bytes each, not a list of floats:
         * at 128 ranks a list is 4 KiB per function, and thousands stray), and the
         * positions of the ranks that stray */
        PyObject *row = PyBytes_FromStringAndSize((const char *)totals,
                                                  nranks * (Py_ssize_t)sizeof(double));
        PyObject *stray = row ? PyList_New(strays) : NULL;
        if (stray == NULL) {
            Py_XDECREF(row);
            goto done;
        }
        for (Py_ssize_t r = 0, at = 0; r < nranks; r++) {
            if (!(fabs(totals[r] - middle) > limit))
                continue;
            PyObject *position_obj = PyLong_FromSsize_t(r);
            if (position_obj == NULL) {
                Py_DECREF(row);
                Py_DECREF(stray);
                goto done;
            }
            PyList_SET_ITEM(stray, at++, position_obj);
        }
        PyObject *item = Py_BuildValue("(ndNN)", slot == functions ? (Py_ssize_t)-1 : slot,
                                       middle, row, stray);
        if (item == NULL || PyList_Append(found, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
    }
    result = PyTuple_Pack(4, ops_list, full, example_list, found);
done:
    fields_close(&f);
    fields_close(&g);
    PyBuffer_Release(&callers_buf);
    PyBuffer_Release(&function_buf);
    PyBuffer_Release(&skip_buf);
    if (rows != NULL)
        for (Py_ssize_t i = 0; i < size; i++)
            PyMem_Free(rows[i]);
    PyMem_Free(rows);
    PyMem_Free(ops);
    PyMem_Free(uniform);
    PyMem_Free(best);
    PyMem_Free(example);
    PyMem_Free(order);
    PyMem_Free(is_full);
    PyMem_Free(position);
    PyMem_Free(totals);
    PyMem_Free(sorted_totals);
    Py_XDECREF(ops_list);
    Py_XDECREF(example_list);
    Py_XDECREF(full);
    Py_XDECREF(found);
    if (cover != NULL)
        for (Py_ssize_t i = 0; i < size; i++)
            PyMem_Free(cover[i]);
    PyMem_Free(cover);
    PyMem_Free(covered);
    return result;
}

/* collective_histograms(sites, indices, ranks, rank_names) -> per index: what a
 * collective_mismatch finding of ``sites[index]`` says, read from its per-rank counts
 * (``per_rank.counts``), where no record ended early: (expected, majority, deviating,
 * counts, size, distribution, holders, reference); False where every rank has one
 * count; None where the statistics are not a clean partition of ``ranks`` (no counts,
 * a rank twice or not one of ``ranks``, ``site.ranks`` not the ranks counted, a count
 * twice or not in 1..2**63-1): the caller's general path. ``rank_names[i]`` is
 * ``str(ranks[i])``. ``py_collective_histograms`` in divergence.py is the reference. */
typedef struct {
    long long value;
    Py_ssize_t held, lowest; /* how many ranks; the lowest rank (a number, not a position) */
} Entry;

static int
compare_entries(const void *a, const void *b)
{
    const Entry *x = a, *y = b; /* the most held first, then by count */
    if (x->held != y->held)
        return x->held > y->held ? -1 : 1;
    return (x->value > y->value) - (x->value < y->value);
}

static PyObject *
histogram_of(Fields *f, Fields *g, int *stats_open, PyObject *site, Py_ssize_t nranks,
             const Py_ssize_t *position, Py_ssize_t limit, const Py_ssize_t *by_rank,
             PyObject *ranks, PyObject *rank_names, Py_ssize_t *owner, Entry *entries,
             unsigned char *in_present)
{
    PyObject *stats = field(f, site, SITE_PER_RANK);
    if (stats == NULL)
        return NULL;
    if (stats == Py_None)
        Py_RETURN_NONE;
    if (!*stats_open) {
        fields_open(g, stats_names, STATS_FIELDS, stats);
        *stats_open = 1;
    }
    PyObject *counts = field(g, stats, STATS_COUNTS);
    PyObject *present = counts ? field(f, site, SITE_RANKS) : NULL;
    if (present == NULL)
        return NULL;
    if (counts == Py_None || !PyList_Check(counts) || (present != Py_None && !PyList_Check(present)))
        Py_RETURN_NONE;
    for (Py_ssize_t p = 0; p < nranks; p++) {
        owner[p] = -1;
        in_present[p] = present == Py_None;
    }
    Py_ssize_t npresent = nranks;
    if (present != Py_None) {
        npresent = PyList_GET_SIZE(present);
        for (Py_ssize_t j = 0; j < npresent; j++) {
            Py_ssize_t rank = as_index(PyList_GET_ITEM(present, j));
            if (rank == -1 && PyErr_Occurred())
                return NULL;
            if (rank < 0 || rank >= limit || position[rank] < 0 || in_present[position[rank]])
                Py_RETURN_NONE;
            in_present[position[rank]] = 1;
        }
    }
    Py_ssize_t k = PyList_GET_SIZE(counts), counted = 0;
    for (Py_ssize_t e = 0; e < k; e++) {
        PyObject *pair = PyList_GET_ITEM(counts, e);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2
            || !PyList_Check(PyTuple_GET_ITEM(pair, 1)))
            Py_RETURN_NONE;
        int overflow = 0;
        long long value = PyLong_Check(PyTuple_GET_ITEM(pair, 0))
            ? PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(pair, 0), &overflow)
            : 0;
        if (value == -1 && PyErr_Occurred())
            return NULL;
        if (overflow || value <= 0)
            Py_RETURN_NONE;
        for (Py_ssize_t d = 0; d < e; d++)
            if (entries[d].value == value)
                Py_RETURN_NONE; /* a count twice */
        PyObject *holders = PyTuple_GET_ITEM(pair, 1);
        Py_ssize_t n = PyList_GET_SIZE(holders), lowest = PY_SSIZE_T_MAX;
        if (n == 0)
            Py_RETURN_NONE;
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_ssize_t rank = as_index(PyList_GET_ITEM(holders, j));
            if (rank == -1 && PyErr_Occurred())
                return NULL;
            if (rank < 0 || rank >= limit || position[rank] < 0 || owner[position[rank]] >= 0
                || !in_present[position[rank]])
                Py_RETURN_NONE;
            owner[position[rank]] = e;
            if (rank < lowest)
                lowest = rank;
        }
        counted += n;
        entries[e] = (Entry){value, n, lowest};
    }
    if (counted != npresent)
        Py_RETURN_NONE; /* a rank of site.ranks with no count */
    if (npresent < nranks) { /* the ranks that never issued it: count 0, last */
        Py_ssize_t lowest = PY_SSIZE_T_MAX;
        for (Py_ssize_t p = 0; p < nranks; p++)
            if (owner[p] < 0) {
                owner[p] = k;
                Py_ssize_t rank = as_index(PyList_GET_ITEM(ranks, p));
                if (rank < lowest)
                    lowest = rank;
            }
        entries[k++] = (Entry){0, nranks - npresent, lowest};
    }
    if (k <= 1)
        Py_RETURN_FALSE;
    Py_ssize_t best = 0, reference = 0;
    for (Py_ssize_t e = 1; e < k; e++) {
        if (entries[e].held > entries[best].held)
            best = e;
        if (entries[e].lowest < entries[reference].lowest)
            reference = e;
    }
    int most = 2 * entries[best].held > nranks;
    Py_ssize_t chosen = most ? best : reference;
    long long expected = entries[chosen].value;
    __int128 size = 0;
    for (Py_ssize_t e = 0; e < k; e++) {
        __int128 gap = (__int128)entries[e].value - expected;
        size += (gap < 0 ? -gap : gap) * entries[e].held;
    }
    PyObject *deviating = PyList_New(nranks - entries[chosen].held);
    PyObject *counts_of = PyDict_New();
    PyObject *shown = NULL, *result = NULL, *size_obj = NULL;
    if (deviating == NULL || counts_of == NULL)
        goto done;
    Py_ssize_t at = 0;
    for (Py_ssize_t o = 0; o < nranks; o++) { /* by rank number */
        Py_ssize_t p = by_rank[o];
        if (owner[p] == chosen)
            continue;
        PyObject *value = PyLong_FromLongLong(entries[owner[p]].value);
        if (value == NULL)
            goto done;
        int failed = PyDict_SetItem(counts_of, PyList_GET_ITEM(rank_names, p), value);
        Py_DECREF(value);
        if (failed < 0)
            goto done;
        PyList_SET_ITEM(deviating, at++, Py_NewRef(PyList_GET_ITEM(ranks, p)));
    }
    if (!most) {
        Entry *sorted_entries = PyMem_Malloc(k * sizeof(Entry));
        shown = sorted_entries ? PyList_New(k) : NULL;
        if (shown != NULL) {
            memcpy(sorted_entries, entries, k * sizeof(Entry));
            qsort(sorted_entries, k, sizeof(Entry), compare_entries);
            for (Py_ssize_t e = 0; e < k; e++) {
                PyObject *item = Py_BuildValue("[Ln]", sorted_entries[e].value,
                                               sorted_entries[e].held);
                if (item == NULL) {
                    Py_CLEAR(shown);
                    break;
                }
                PyList_SET_ITEM(shown, e, item);
            }
        } else if (sorted_entries == NULL) {
            PyErr_NoMemory();
        }
        PyMem_Free(sorted_entries);
        if (shown == NULL)
            goto done;
    }
    unsigned char bytes[16];
    memcpy(bytes, &size, 16);
    size_obj = _PyLong_FromByteArray(bytes, 16, PY_LITTLE_ENDIAN, 1);
    if (size_obj == NULL)
        goto done;
    result = Py_BuildValue("(LONNOOnn)", expected, most ? Py_True : Py_False, deviating,
                           counts_of, size_obj, shown ? shown : Py_None, entries[chosen].held,
                           entries[chosen].lowest);
    deviating = counts_of = NULL; /* stolen by N */
done:
    Py_XDECREF(deviating);
    Py_XDECREF(counts_of);
    Py_XDECREF(shown);
    Py_XDECREF(size_obj);
    return result;
}

static int
compare_ranks(const void *a, const void *b)
{
    const Py_ssize_t *x = a, *y = b; /* (rank, position) pairs by rank */
    return (x[0] > y[0]) - (x[0] < y[0]);
}

static PyObject *
collective_histograms(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *sites, *indices, *ranks, *rank_names;
    if (!PyArg_ParseTuple(args, "O!O!O!O!:collective_histograms", &PyList_Type, &sites,
                          &PyList_Type, &indices, &PyList_Type, &ranks, &PyList_Type,
                          &rank_names))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(indices), nranks = PyList_GET_SIZE(ranks), limit = 0;
    PyObject *out = NULL;
    Py_ssize_t *position = NULL, *owner = NULL, *by_rank = NULL, *pairs = NULL;
    Entry *entries = NULL;
    unsigned char *in_present = NULL;
    int stats_open = 0;
    Fields f, g;
    fields_open(&f, site_names, SITE_FIELDS, NULL);
    fields_open(&g, stats_names, STATS_FIELDS, NULL);
    if (field_names_ready() < 0)
        goto done;
    if (PyList_GET_SIZE(rank_names) != nranks) {
        PyErr_SetString(PyExc_ValueError, "collective_histograms: ranks and names differ");
        goto done;
    }
    for (Py_ssize_t i = 0; i < nranks; i++) {
        Py_ssize_t rank = as_index(PyList_GET_ITEM(ranks, i));
        if (rank == -1 && PyErr_Occurred())
            goto done;
        if (rank < 0) {
            PyErr_SetString(PyExc_ValueError, "collective_histograms: a rank is negative");
            goto done;
        }
        if (rank + 1 > limit)
            limit = rank + 1;
    }
    position = PyMem_Malloc((limit + 1) * sizeof(Py_ssize_t));
    owner = PyMem_Malloc((nranks + 1) * sizeof(Py_ssize_t));
    by_rank = PyMem_Malloc((nranks + 1) * sizeof(Py_ssize_t));
    pairs = PyMem_Malloc((2 * nranks + 1) * sizeof(Py_ssize_t));
    entries = PyMem_Malloc((nranks + 2) * sizeof(Entry));
    in_present = PyMem_Malloc(nranks + 1);
    out = PyList_New(n);
    if (!position || !owner || !by_rank || !pairs || !entries || !in_present) {
        PyErr_NoMemory();
        goto done;
    }
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < limit; i++)
        position[i] = -1;
    for (Py_ssize_t i = 0; i < nranks; i++) {
        Py_ssize_t rank = as_index(PyList_GET_ITEM(ranks, i));
        if (position[rank] >= 0) {
            PyErr_SetString(PyExc_ValueError, "collective_histograms: a rank twice");
            goto done;
        }
        position[rank] = i;
        pairs[2 * i] = rank;
        pairs[2 * i + 1] = i;
    }
    qsort(pairs, nranks, 2 * sizeof(Py_ssize_t), compare_ranks);
    for (Py_ssize_t i = 0; i < nranks; i++)
        by_rank[i] = pairs[2 * i + 1];
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t index = as_index(PyList_GET_ITEM(indices, i));
        if (index == -1 && PyErr_Occurred())
            goto done;
        if (index < 0 || index >= PyList_GET_SIZE(sites)) {
            PyErr_SetString(PyExc_IndexError, "collective_histograms: index out of range");
            goto done;
        }
        if (n && i == 0)
            fields_open(&f, site_names, SITE_FIELDS, PyList_GET_ITEM(sites, index));
        PyObject *item = histogram_of(&f, &g, &stats_open, PyList_GET_ITEM(sites, index),
                                      nranks, position, limit, by_rank, ranks, rank_names,
                                      owner, entries, in_present);
        if (item == NULL)
            goto done;
        PyList_SET_ITEM(out, i, item);
    }
    fields_close(&f);
    fields_close(&g);
    PyMem_Free(position);
    PyMem_Free(owner);
    PyMem_Free(by_rank);
    PyMem_Free(pairs);
    PyMem_Free(entries);
    PyMem_Free(in_present);
    return out;
done:
    fields_close(&f);
    fields_close(&g);
    PyMem_Free(position);
    PyMem_Free(owner);
    PyMem_Free(by_rank);
    PyMem_Free(pairs);
    PyMem_Free(entries);
    PyMem_Free(in_present);
    Py_XDECREF(out);
    return NULL;
}

/* skew_findings(kept, site_indices, visible, callers, function_names, frame_names,
 * ranks, rank_names, ops, threshold, number, size_of, list_ranks) -> the count_skew
 * findings of ``kept`` ((number, slot, middle, row, stray) per function, as
 * ``skew_fold`` found them), each a dict as ``py_skew_findings`` in divergence.py
 * (the reference) builds it: ``visible`` and ``callers`` are the visible frames of
 * the ``site_indices`` that are not None, in order; ``number`` is ``_number``
 * (asked only for a value that is not a whole number), ``size_of(middle, strayed)``
 * a finding's size, ``list_ranks`` the message's ranks. */
static PyObject *
number_of(double value, PyObject *number)
{
    if (isfinite(value) && floor(value) == value)
        return PyLong_FromDouble(value);
    PyObject *boxed = PyFloat_FromDouble(value);
    if (boxed == NULL)
        return NULL;
    PyObject *result = PyObject_CallOneArg(number, boxed);
    Py_DECREF(boxed);
    return result;
}

static PyObject *
names_of(PyObject *frames, Py_ssize_t start, Py_ssize_t stop, PyObject *frame_names)
{
    PyObject *out = PyList_New(stop > start ? stop - start : 0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = start; j < stop; j++) {
        Py_ssize_t frame = as_index(PyList_GET_ITEM(frames, j));
        if (frame == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (frame < 0 || frame >= PyList_GET_SIZE(frame_names)) {
            PyErr_SetString(PyExc_IndexError, "skew_findings: frame id out of range");
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j - start, Py_NewRef(PyList_GET_ITEM(frame_names, frame)));
    }
    return out;
}

static PyObject *skew_keys[12];

static PyObject *
skew_findings(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *kept, *site_indices, *visible, *callers, *function_names, *frame_names, *ranks;
    PyObject *rank_names, *ops, *threshold, *number, *size_of, *list_ranks;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!UOOO:skew_findings", &PyList_Type, &kept,
                          &PyList_Type, &site_indices, &PyList_Type, &visible, &PyList_Type,
                          &callers, &PyList_Type, &function_names, &PyList_Type, &frame_names,
                          &PyList_Type, &ranks, &PyList_Type, &rank_names, &PyList_Type, &ops,
                          &threshold, &number, &size_of, &list_ranks))
        return NULL;
    if (skew_keys[0] == NULL) {
        const char *text[] = {"kind", "severity", "ranks", "target", "context", "expected",
                              "counts", "ops", "size", "message", "stack", "callsite"};
        for (int k = 0; k < 12; k++)
            if ((skew_keys[k] = PyUnicode_InternFromString(text[k])) == NULL)
                return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(kept), nranks = PyList_GET_SIZE(ranks), shown = 0;
    if (PyList_GET_SIZE(site_indices) != n || PyList_GET_SIZE(rank_names) != nranks
        || PyList_GET_SIZE(visible) != PyList_GET_SIZE(callers)) {
        PyErr_SetString(PyExc_ValueError, "skew_findings: lengths differ");
        return NULL;
    }
    PyObject *out = PyList_New(0), *root = PyUnicode_FromString("<root>");
    PyObject *kind = PyUnicode_FromString("count_skew"), *warning = PyUnicode_FromString("warning");
    if (!out || !root || !kind || !warning)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(kept, i), *site_index = PyList_GET_ITEM(site_indices, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5
            || !PyBytes_Check(PyTuple_GET_ITEM(entry, 3))
            || !PyList_Check(PyTuple_GET_ITEM(entry, 4))) {
            PyErr_SetString(PyExc_TypeError, "skew_findings: a kept function is malformed");
            goto fail;
        }
        Py_ssize_t fnumber = as_index(PyTuple_GET_ITEM(entry, 0));
        Py_ssize_t slot = as_index(PyTuple_GET_ITEM(entry, 1));
        double middle = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 2));
        if (PyErr_Occurred())
            goto fail;
        PyObject *row = PyTuple_GET_ITEM(entry, 3), *stray = PyTuple_GET_ITEM(entry, 4);
        const double *values = (const double *)PyBytes_AS_STRING(row);
        Py_ssize_t nstray = PyList_GET_SIZE(stray);
        if (PyBytes_GET_SIZE(row) != nranks * (Py_ssize_t)sizeof(double) || slot < 0
            || slot >= PyList_GET_SIZE(ops) || fnumber >= PyList_GET_SIZE(function_names)) {
            PyErr_SetString(PyExc_ValueError, "skew_findings: a kept function is out of range");
            goto fail;
        }
        PyObject *deviating = PyList_New(nstray), *strayed = PyList_New(nstray);
        PyObject *counts = PyDict_New(), *expected = NULL, *stack = NULL, *context = NULL;
        PyObject *size = NULL, *text = NULL, *message = NULL, *finding = NULL;
        int failed = !deviating || !strayed || !counts;
        for (Py_ssize_t j = 0; !failed && j < nstray; j++) {
            Py_ssize_t at = as_index(PyList_GET_ITEM(stray, j));
            if (at < 0 || at >= nranks) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "skew_findings: a rank out of range");
                failed = 1;
                break;
            }
            PyList_SET_ITEM(deviating, j, Py_NewRef(PyList_GET_ITEM(ranks, at)));
            PyObject *value = PyFloat_FromDouble(values[at]);
            PyObject *shown_value = value ? number_of(values[at], number) : NULL;
            failed = shown_value == NULL
                || PyDict_SetItem(counts, PyList_GET_ITEM(rank_names, at), shown_value) < 0;
            Py_XDECREF(shown_value);
            if (value != NULL)
                PyList_SET_ITEM(strayed, j, value);
            else
                failed = 1;
        }
        PyObject *name = fnumber < 0 ? root : PyList_GET_ITEM(function_names, fnumber);
        if (!failed && site_index != Py_None) {
            if (shown >= PyList_GET_SIZE(visible)) {
                PyErr_SetString(PyExc_ValueError, "skew_findings: too few visible frames");
                failed = 1;
            } else {
                PyObject *frames = PyList_GET_ITEM(visible, shown);
                PyObject *position = PyList_GET_ITEM(callers, shown);
                shown++;
                if (!PyList_Check(frames)) {
                    PyErr_SetString(PyExc_TypeError, "skew_findings: frames not a list");
                    failed = 1;
                } else if (PyList_GET_SIZE(frames) > 0) {
                    Py_ssize_t p = position == Py_None ? 0 : as_index(position);
                    if (p == -1 && PyErr_Occurred())
                        failed = 1;
                    else {
                        Py_ssize_t stop = p + 1 < PyList_GET_SIZE(frames)
                            ? p + 1 : PyList_GET_SIZE(frames);
                        stack = names_of(frames, 0, stop, frame_names);
                        context = stack ? PyList_GetSlice(stack, p - 3 > 0 ? p - 3 : 0, p)
                                        : NULL;
                        failed = context == NULL;
                    }
                }
            }
        }
        if (!failed && stack == NULL) {
            stack = PyList_New(0);
            context = PyList_New(0);
            failed = !stack || !context;
        }
        if (!failed) {
            expected = number_of(middle, number);
            PyObject *middle_obj = expected ? PyTuple_GET_ITEM(entry, 2) : NULL;
            size = middle_obj ? PyObject_CallFunctionObjArgs(size_of, middle_obj, strayed, NULL)
                              : NULL;
            text = size ? PyObject_CallOneArg(list_ranks, deviating) : NULL;
            message = text ? PyUnicode_FromFormat(
                                 "%U: ops on rank(s) %U differ from the median %S by more "
                                 "than %U", name, text, expected, threshold)
                           : NULL;
            finding = message ? PyDict_New() : NULL;
            PyObject *values_in[12] = {kind, warning, deviating, name, context, expected,
                                       counts, PyList_GET_ITEM(ops, slot), size, message,
                                       stack, site_index};
            for (int k = 0; finding != NULL && k < 12; k++)
                if (PyDict_SetItem(finding, skew_keys[k], values_in[k]) < 0)
                    Py_CLEAR(finding);
            failed = finding == NULL || PyList_Append(out, finding) < 0;
        }
        Py_XDECREF(deviating);
        Py_XDECREF(strayed);
        Py_XDECREF(counts);
        Py_XDECREF(expected);
        Py_XDECREF(stack);
        Py_XDECREF(context);
        Py_XDECREF(size);
        Py_XDECREF(text);
        Py_XDECREF(message);
        Py_XDECREF(finding);
        if (failed)
            goto fail;
    }
    Py_DECREF(root);
    Py_DECREF(kind);
    Py_DECREF(warning);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(root);
    Py_XDECREF(kind);
    Py_XDECREF(warning);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"callsite_paths", callsite_paths, METH_VARARGS,
     "callsite_paths(stacks, apis, api_index, tables, width) -> (paths, frame_paths)."},
    {"frames_at", frames_at, METH_VARARGS,
     "frames_at(frame_paths, origins, own, start, end) -> (first, distinct) frame ids."},
    {"site_visible_frames", site_visible_frames, METH_VARARGS,
     "site_visible_frames(sites, indices, hidden, user) -> (visible, callers): of those "
     "sites' stacks, read in place."},
    {"visible_frames", visible_frames, METH_VARARGS,
     "visible_frames(stacks, hidden, user) -> (visible, callers): per stack."},
    {"site_summary", site_summary, METH_VARARGS,
     "site_summary(sites, hidden, user, all_mask, mask_of, collective_op, collective_apis) -> "
     "(callers, union, outside, full, collective): divergence's pass over every callsite."},
    {"collective_histograms", collective_histograms, METH_VARARGS,
     "collective_histograms(sites, indices, ranks, rank_names) -> per index: (expected, "
     "majority, deviating, counts, size, distribution, holders, reference), False or None."},
    {"skew_findings", skew_findings, METH_VARARGS,
     "skew_findings(kept, site_indices, visible, callers, function_names, frame_names, ranks, "
     "rank_names, ops, threshold, number, size_of, list_ranks) -> count_skew findings."},
    {"site_touching", site_touching, METH_VARARGS,
     "site_touching(sites, marked) -> positions: the sites whose stack has a marked frame id, "
     "read in place."},
    {"skew_fold", skew_fold, METH_VARARGS,
     "skew_fold(sites, callers, function, skip, functions, ranks, skew) -> (ops, full, "
     "example, found): divergence's count_skew fold."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef runs_methods[] = {
    {"weight", (PyCFunction)(void (*)(void))runs_weight, METH_FASTCALL,
     "weight(start, end) -> int: the total count of the run."},
    {"mask", (PyCFunction)(void (*)(void))runs_mask, METH_FASTCALL,
     "mask(start, end) -> int: the union of the run's rank masks."},
    {"uniform", (PyCFunction)(void (*)(void))runs_uniform, METH_FASTCALL,
     "uniform(start, end) -> bool: whether the run has one mask."},
    {"skip_ended", (PyCFunction)(void (*)(void))runs_skip_ended, METH_FASTCALL,
     "skip_ended(own, start, end) -> int: the first position with a path longer than own."},
    {"run_end", (PyCFunction)(void (*)(void))runs_run_end, METH_FASTCALL,
     "run_end(own, start, end) -> int: the end of the run of equal id at byte own."},
    {"id_at", (PyCFunction)(void (*)(void))runs_id_at, METH_FASTCALL,
     "id_at(own, position) -> bytes: the id at byte own of the position's path."},
    {"ranked_prefix", (PyCFunction)(void (*)(void))runs_ranked_prefix, METH_FASTCALL,
     "ranked_prefix(own, position, ranks) -> bytes: the prefix's ids through ranks."},
    {"tally", (PyCFunction)(void (*)(void))runs_tally, METH_FASTCALL,
     "tally(start, end, ops, streams, dtypes, op_masks): add the run's counts by op, by stream and "
     "by dtype (positions with one)."},
    {"distinct_prefixes", (PyCFunction)runs_distinct_prefixes, METH_NOARGS,
     "distinct_prefixes() -> int: the nodes of the unpruned tree below its root."},
    {"divergent", (PyCFunction)(void (*)(void))runs_divergent, METH_FASTCALL,
     "divergent(floor, rank_floor) -> (parent_of, idents, found): the search for "
     "divergent nodes below floor."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RunsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "opguard_plugins.stages._runs.Runs",
    .tp_basicsize = sizeof(Runs),
    .tp_dealloc = (destructor)runs_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sorted callsite paths and the runs below every call-tree node.",
    .tp_methods = runs_methods,
    .tp_new = runs_new,
};

static struct PyModuleDef runs_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "opguard_plugins.stages._runs",
    .m_doc = "Compress's per-callsite work: the runs of sorted callsite paths.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__runs(void)
{
    if (PyType_Ready(&RunsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&runs_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Runs", (PyObject *)&RunsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
