/* The modes backend's per-operator hot path in C (tracing.md, "The recorder's fast
 * path").
 *
 * ``Counter.dispatch`` *is* the dispatch mode's ``__torch_dispatch__`` (bound to the
 * mode as a method, so no Python frame runs per operator), and ``Counter.function`` the
 * function mode's ``__torch_function__``. For every operator, ``dispatch`` does what ``CallsiteRecorder.record`` does in Python for the
 * common case, without running Python code and, for a callsite seen before, without
 * allocating: it walks the Python stack from the frame that issued the operator
 * outwards (skipping torch's wrapper frames at the top) into a buffer of (code, f_lasti)
 * positions, finds that stack in a table of the stacks seen so far, and adds one to the
 * count of (stack, api, op, stream, dtype) in a second table (``dtype`` the name of the
 * op's first tensor argument's dtype, or None: ``op_dtype``, whose reference is
 * record/dtypes.py). ``flush()`` adds the pending counts into the Python dict ``counts``
 * under the key ``(stack, api, op, stream, dtype)``, where ``stack`` is
 * the flat tuple ``(id(code), f_lasti, ...)`` outermost first: the value ``tracer._walk``
 * builds, so Python stays the reference implementation. Everything else (an operator
 * not yet named, a backward pass on another thread) is handed to the Python ``slow``
 * callable with the same frame. An operator not yet named, or whose name is in the
 * ``divert`` set (collectives, whose arguments the collective sequence records, and
 * operators that may issue one inside: tracer.py), is handed whole, arguments and all,
 * to the Python ``divert_call(func, frame, args, kwargs)``, which records and runs it.
 *
 * Runs under the GIL and calls no Python code on the fast path, so it needs no lock.
 * Every code object seen is kept alive in ``codes`` (id -> code), so an address stays
 * one code's. CPython >= 3.11 only; the package works without this module.
 *
 * ``TargetWalker`` is the guard's per-operator stack walk (``Guard.active_targets`` in
 * enforce/runtime.py is its reference): the same frames, named once per code object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>

typedef struct {
    PyCodeObject *code;  /* borrowed: ``codes`` keeps it alive */
    Py_ssize_t position; /* f_lasti; as wide as the pointer, so no padding to compare */
} Position;

typedef struct {
    Py_hash_t hash;
    Py_ssize_t length;
    Position *positions; /* outermost first */
    PyObject *tuple;     /* the flat (id, position, ...) tuple */
} Stack;

typedef struct {
    Py_ssize_t stack;
    PyObject *api; /* strong references */
    PyObject *op;
    long long stream;
    PyObject *dtype; /* the name from ``DtypeNaming.names`` (one str per dtype), or None */
    long count;      /* pending, not yet in ``counts`` */
} Site;

/* What ``op_dtype`` names dtypes with (record/dtypes.py, ``native_naming``); strong
 * references, NULL until set. */
typedef struct {
    PyObject *tensor_type; /* torch.Tensor */
    PyObject *names;       /* dict: torch.dtype -> its name, shared with ``op_dtype`` */
    PyObject *name_of;     /* callable(dtype) -> its name (``dtype_name``), once per dtype */
} DtypeNaming;

/* Open addressing over indices into a vector; -1 marks an empty slot. */
typedef struct {
    Py_ssize_t *slots;
    Py_ssize_t size; /* a power of two, or 0 */
} Index;

/* Code address -> id() as an int. */
typedef struct {
    void **addresses;
    PyObject **ids;
    Py_ssize_t size;
    Py_ssize_t used;
} IdTable;

#define POSITIONS_CACHED 16384 /* f_lasti offsets below this share one int each */
#define BUFFER 256

typedef struct {
    PyObject_HEAD
    PyObject *counts;     /* dict: key -> int */
    PyObject *codes;      /* dict: id(code) -> code */
    PyObject *modules;    /* dict: code -> the frame's module __name__ */
    PyObject *op_names;   /* dict: operator -> "namespace::name" */
    PyObject *local;      /* threading.local whose .api is the current api */
    PyObject *backward;   /* list of running backward contexts */
    PyObject *skip_files; /* frozenset of wrapper file names skipped at the top */
    PyObject *slow;       /* callable(func, frame): the Python path */
    PyObject *api_names;  /* dict: torch callable -> its public name */
    PyObject *backward_apis; /* frozenset of names that start a backward pass */
    PyObject *enter_api;  /* callable(func, frame) -> context: marks the api in Python */
    PyObject *exit_api;   /* callable(context): unmarks it */
    PyObject *overload_type; /* torch._ops.OpOverload: called through its ``_op`` */
    PyObject *stream_of;  /* callable() -> the current stream id, or None (no CUDA) */
    PyObject *divert;     /* set of op names Python records and runs itself, or None */
    PyObject *divert_call; /* callable(func, frame, args, kwargs) -> result, or None */
    DtypeNaming naming;
    int active;
    IdTable ids;
    PyObject **positions; /* POSITIONS_CACHED ints, made on first use */
    Stack *stacks;
    Py_ssize_t n_stacks, cap_stacks;
    Index stack_index;
    Site *sites;
    Py_ssize_t n_sites, cap_sites;
    Index site_index;
    Py_ssize_t pending; /* sites with a count to flush */
} Counter;

static PyObject *api_str;    /* "api" */
static PyObject *name_str;   /* "__name__" */
static PyObject *collective; /* "c10d::" */
static PyObject *op_attr_str; /* "_op" */
static PyObject *dtype_str;   /* "dtype" */

static inline size_t
mix(size_t h, size_t value)
{
    h ^= value + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h;
}

/* ----------------------------------------------------------------- tables */

static int
index_init(Index *index, Py_ssize_t size)
{
    Py_ssize_t *slots = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)size);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < size; i++) {
        slots[i] = -1;
    }
    PyMem_Free(index->slots);
    index->slots = slots;
    index->size = size;
    return 0;
}

static void
index_free(Index *index)
{
    PyMem_Free(index->slots);
    index->slots = NULL;
    index->size = 0;
}

static Py_ssize_t
id_slot(IdTable *table, void *address)
{
    size_t mask = (size_t)table->size - 1;
    size_t slot = mix(0, (size_t)address) & mask;
    while (table->addresses[slot] != NULL && table->addresses[slot] != address) {
        slot = (slot + 1) & mask;
    }
    return (Py_ssize_t)slot;
}

static int
id_table_grow(IdTable *table)
{
    IdTable bigger = {NULL, NULL, table->size ? table->size * 2 : 1024, table->used};
    bigger.addresses = PyMem_Calloc((size_t)bigger.size, sizeof(void *));
    bigger.ids = PyMem_Calloc((size_t)bigger.size, sizeof(PyObject *));
    if (bigger.addresses == NULL || bigger.ids == NULL) {
        PyMem_Free(bigger.addresses);
        PyMem_Free(bigger.ids);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < table->size; i++) {
        if (table->addresses[i] != NULL) {
            Py_ssize_t slot = id_slot(&bigger, table->addresses[i]);
            bigger.addresses[slot] = table->addresses[i];
            bigger.ids[slot] = table->ids[i];
        }
    }
    PyMem_Free(table->addresses);
    PyMem_Free(table->ids);
    *table = bigger;
    return 0;
}

static void
id_table_free(IdTable *table)
{
    for (Py_ssize_t i = 0; i < table->size; i++) {
        Py_XDECREF(table->ids[i]);
    }
    PyMem_Free(table->addresses);
    PyMem_Free(table->ids);
    table->addresses = NULL;
    table->ids = NULL;
    table->size = table->used = 0;
}

/* id(code) as an int, registering a code seen for the first time in ``codes`` and
 * ``modules`` (borrowed reference, or NULL with an exception). */
static PyObject *
code_id(Counter *self, PyCodeObject *code, PyFrameObject *frame)
{
    if (2 * (self->ids.used + 1) > self->ids.size && id_table_grow(&self->ids) < 0) {
        return NULL;
    }
    Py_ssize_t slot = id_slot(&self->ids, code);
    if (self->ids.ids[slot] != NULL) {
        return self->ids.ids[slot];
    }
    if (frame == NULL) {
        PyErr_SetString(PyExc_SystemError, "a code object the walk did not register");
        return NULL;
    }
    PyObject *key = PyLong_FromVoidPtr(code);
    if (key == NULL) {
        return NULL;
    }
    int known = PyDict_Contains(self->codes, key);
    if (known == 0) {
        PyObject *globals = PyFrame_GetGlobals(frame);
        PyObject *name = NULL;
        if (globals != NULL && PyDict_Check(globals)) {
            name = PyDict_GetItemWithError(globals, name_str); /* borrowed */
        }
        Py_XINCREF(name);
        Py_XDECREF(globals);
        if (PyErr_Occurred() ||
            PyDict_SetItem(self->codes, key, (PyObject *)code) < 0 ||
            PyDict_SetItem(self->modules, (PyObject *)code, name != NULL ? name : Py_None) < 0) {
            known = -1;
        }
        Py_XDECREF(name);
    }
    if (known < 0) {
        Py_DECREF(key);
        return NULL;
    }
    self->ids.addresses[slot] = code;
    self->ids.ids[slot] = key;
    self->ids.used++;
    return key;
}

static PyObject *
position_int(Counter *self, Py_ssize_t position)
{
    if (position >= 0 && position < POSITIONS_CACHED) {
        if (self->positions[position] == NULL) {
            self->positions[position] = PyLong_FromSsize_t(position);
        }
        return Py_XNewRef(self->positions[position]);
    }
    return PyLong_FromSsize_t(position);
}

/* ----------------------------------------------------------------- dtypes */

static int
naming_set(DtypeNaming *naming, PyObject *tensor_type, PyObject *names, PyObject *name_of)
{
    if (!PyType_Check(tensor_type) || !PyDict_Check(names) || !PyCallable_Check(name_of)) {
        PyErr_SetString(PyExc_TypeError,
                        "dtype naming needs a tensor type, a dict of names and a callable");
        return -1;
    }
    Py_XSETREF(naming->tensor_type, Py_NewRef(tensor_type));
    Py_XSETREF(naming->names, Py_NewRef(names));
    Py_XSETREF(naming->name_of, Py_NewRef(name_of));
    return 0;
}

/* Set ``naming`` from ``opguard_plugins.record.dtypes.native_naming()``. */
static int
naming_load(DtypeNaming *naming)
{
    PyObject *module = PyImport_ImportModule("opguard_plugins.record.dtypes");
    PyObject *found = module == NULL ? NULL : PyObject_CallMethod(module, "native_naming", NULL);
    Py_XDECREF(module);
    if (found == NULL) {
        return -1;
    }
    int result = -1;
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3) {
        PyErr_SetString(PyExc_TypeError, "native_naming() must return 3 values");
    }
    else {
        result = naming_set(naming, PyTuple_GET_ITEM(found, 0), PyTuple_GET_ITEM(found, 1),
                            PyTuple_GET_ITEM(found, 2));
    }
    Py_DECREF(found);
    return result;
}

static void
naming_clear(DtypeNaming *naming)
{
    Py_CLEAR(naming->tensor_type);
    Py_CLEAR(naming->names);
    Py_CLEAR(naming->name_of);
}

static int
naming_traverse(DtypeNaming *naming, visitproc visit, void *arg)
{
    Py_VISIT(naming->tensor_type);
    Py_VISIT(naming->names);
    Py_VISIT(naming->name_of);
    return 0;
}

/* The dtype name of the first tensor in ``args`` (a tuple; NULL: none), or None: a new
 * reference, or NULL with an exception. As ``op_dtype`` in record/dtypes.py: a tensor
 * is an instance of the tensor type, a list of tensors is not one; each ``torch.dtype``
 * is named once, by ``name_of``, into ``names``, whose str is then that dtype's. */
static PyObject *
op_dtype(DtypeNaming *naming, PyObject *args)
{
    Py_ssize_t n = args != NULL ? PyTuple_GET_SIZE(args) : 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        if (!PyObject_TypeCheck(arg, (PyTypeObject *)naming->tensor_type)) {
            continue;
        }
        PyObject *dtype = PyObject_GetAttr(arg, dtype_str);
        if (dtype == NULL) {
            return NULL;
        }
        PyObject *name = PyDict_GetItemWithError(naming->names, dtype); /* borrowed */
        if (name != NULL) {
            Py_INCREF(name);
        }
        else if (!PyErr_Occurred()) {
            name = PyObject_CallOneArg(naming->name_of, dtype);
            if (name != NULL && !PyUnicode_CheckExact(name)) {
                Py_CLEAR(name);
                PyErr_SetString(PyExc_TypeError, "a dtype's name must be a str");
            }
            if (name != NULL) {
                PyUnicode_InternInPlace(&name);
                if (PyDict_SetItem(naming->names, dtype, name) < 0) {
                    Py_CLEAR(name);
                }
            }
        }
        Py_DECREF(dtype);
        return name;
    }
    return Py_NewRef(Py_None);
}

/* ------------------------------------------------------------------- walk */

/* The positions from ``frame`` outwards into ``*buf`` (innermost first); steals the
 * reference to ``frame``. Returns the count, or -1 with an exception. */
static Py_ssize_t
collect(Counter *self, PyFrameObject *frame, Position **buf, Py_ssize_t *cap,
        Position *local_buf)
{
    Py_ssize_t n = 0;
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        int skip = PySet_Contains(self->skip_files, code->co_filename);
        Py_DECREF(code);
        if (skip < 0) {
            goto error;
        }
        if (!skip) {
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *id = code_id(self, code, frame);
        Py_DECREF(code); /* kept alive by ``codes`` */
        if (id == NULL) {
            goto error;
        }
        if (n == *cap) {
            Py_ssize_t grown = *cap * 2;
            Position *bigger = PyMem_Malloc(sizeof(Position) * (size_t)grown);
            if (bigger == NULL) {
                PyErr_NoMemory();
                goto error;
            }
            memcpy(bigger, *buf, sizeof(Position) * (size_t)n);
            if (*buf != local_buf) {
                PyMem_Free(*buf);
            }
            *buf = bigger;
            *cap = grown;
        }
        (*buf)[n].code = code;
        (*buf)[n].position = PyFrame_GetLasti(frame);
        n++;
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    return n;
error:
    Py_XDECREF(frame);
    return -1;
}

/* The flat (id, position, ...) tuple, outermost first, of innermost-first positions. */
static PyObject *
stack_tuple(Counter *self, const Position *positions, Py_ssize_t n)
{
    PyObject *tuple = PyTuple_New(2 * n);
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const Position *at = &positions[n - 1 - i];
        PyObject *id = code_id(self, at->code, NULL); /* registered by collect */
        PyObject *position = position_int(self, at->position);
        if (id == NULL || position == NULL) {
            Py_XDECREF(position);
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, 2 * i, Py_NewRef(id));
        PyTuple_SET_ITEM(tuple, 2 * i + 1, position);
    }
    return tuple;
}

static Py_hash_t
positions_hash(const Position *positions, Py_ssize_t n)
{
    size_t h = (size_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        h = mix(h, (size_t)positions[i].code);
        h = mix(h, (size_t)(unsigned int)positions[i].position);
    }
    return (Py_hash_t)h;
}

static int
reindex(Index *index, Py_ssize_t entries, Py_hash_t (*hash_of)(void *, Py_ssize_t), void *owner)
{
    Py_ssize_t size = index->size ? index->size : 1024;
    while (size < 2 * (entries + 1)) {
        size *= 2;
    }
    if (index_init(index, size) < 0) {
        return -1;
    }
    size_t mask = (size_t)size - 1;
    for (Py_ssize_t i = 0; i < entries; i++) {
        size_t slot = (size_t)hash_of(owner, i) & mask;
        while (index->slots[slot] != -1) {
            slot = (slot + 1) & mask;
        }
        index->slots[slot] = i;
    }
    return 0;
}

static Py_hash_t
stack_hash_at(void *owner, Py_ssize_t i)
{
    return ((Counter *)owner)->stacks[i].hash;
}

static Py_hash_t
site_hash(Py_ssize_t stack, PyObject *api, PyObject *op, long long stream, PyObject *dtype)
{
    return (Py_hash_t)mix(
        mix(mix(mix(mix(0, (size_t)stack), (size_t)api), (size_t)op), (size_t)stream),
        (size_t)dtype);
}

static Py_hash_t
site_hash_at(void *owner, Py_ssize_t i)
{
    Site *site = &((Counter *)owner)->sites[i];
    return site_hash(site->stack, site->api, site->op, site->stream, site->dtype);
}

/* The index of this stack in ``stacks``, adding it when new; -1 with an exception. */
static Py_ssize_t
find_stack(Counter *self, const Position *innermost_first, Py_ssize_t n)
{
    Py_hash_t hash = positions_hash(innermost_first, n);
    size_t mask = (size_t)self->stack_index.size - 1;
    size_t slot = (size_t)hash & mask;
    Py_ssize_t found;
    while ((found = self->stack_index.slots[slot]) != -1) {
        Stack *stack = &self->stacks[found];
        if (stack->hash == hash && stack->length == n &&
            memcmp(stack->positions, innermost_first, sizeof(Position) * (size_t)n) == 0) {
            return found;
        }
        slot = (slot + 1) & mask;
    }
    if (self->n_stacks == self->cap_stacks) {
        Py_ssize_t grown = self->cap_stacks ? self->cap_stacks * 2 : 256;
        Stack *bigger = PyMem_Realloc(self->stacks, sizeof(Stack) * (size_t)grown);
        if (bigger == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->stacks = bigger;
        self->cap_stacks = grown;
    }
    Position *copy = PyMem_Malloc(sizeof(Position) * (size_t)(n ? n : 1));
    if (copy == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(copy, innermost_first, sizeof(Position) * (size_t)n);
    PyObject *tuple = stack_tuple(self, innermost_first, n);
    if (tuple == NULL) {
        PyMem_Free(copy);
        return -1;
    }
    Py_ssize_t index = self->n_stacks++;
    self->stacks[index] = (Stack){hash, n, copy, tuple};
    if (2 * self->n_stacks > self->stack_index.size) {
        if (reindex(&self->stack_index, self->n_stacks, stack_hash_at, self) < 0) {
            return -1;
        }
    }
    else {
        self->stack_index.slots[slot] = index;
    }
    return index;
}

/* Adds one to (stack, api, op, stream, dtype); 0, or -1 with an exception. Strings are
 * compared by identity: an api, an op and a dtype have one str each (their caches'). */
static int
count_site(Counter *self, Py_ssize_t stack, PyObject *api, PyObject *op, long long stream,
           PyObject *dtype)
{
    size_t mask = (size_t)self->site_index.size - 1;
    size_t slot = (size_t)site_hash(stack, api, op, stream, dtype) & mask;
    Py_ssize_t found;
    while ((found = self->site_index.slots[slot]) != -1) {
        Site *site = &self->sites[found];
        if (site->stack == stack && site->api == api && site->op == op &&
            site->stream == stream && site->dtype == dtype) {
            if (site->count++ == 0) {
                self->pending++;
            }
            return 0;
        }
        slot = (slot + 1) & mask;
    }
    if (self->n_sites == self->cap_sites) {
        Py_ssize_t grown = self->cap_sites ? self->cap_sites * 2 : 256;
        Site *bigger = PyMem_Realloc(self->sites, sizeof(Site) * (size_t)grown);
        if (bigger == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->sites = bigger;
        self->cap_sites = grown;
    }
    Py_ssize_t index = self->n_sites++;
    self->sites[index] =
        (Site){stack, Py_NewRef(api), Py_NewRef(op), stream, Py_NewRef(dtype), 1};
    self->pending++;
    if (2 * self->n_sites > self->site_index.size) {
        return reindex(&self->site_index, self->n_sites, site_hash_at, self);
    }
    self->site_index.slots[slot] = index;
    return 0;
}

/* ----------------------------------------------------------------- methods */

/* slow(func, frame, args): the Python path, with the positional arguments (NULL: none),
 * which it reads the dtype from. */
static PyObject *
call_slow(Counter *self, PyObject *func, PyFrameObject *frame, PyObject *call_args)
{
    PyObject *empty = call_args == NULL ? PyTuple_New(0) : NULL;
    PyObject *result =
        (call_args == NULL && empty == NULL)
            ? NULL
            : PyObject_CallFunctionObjArgs(self->slow, func,
                                           frame != NULL ? (PyObject *)frame : Py_None,
                                           call_args != NULL ? call_args : empty, NULL);
    Py_XDECREF(empty);
    Py_XDECREF(frame);
    return result;
}

/* The running Python frame (new reference, or NULL): with no Python frame of the
 * mode's own in between, the frame that issued the call. */
static PyFrameObject *
running_frame(void)
{
    PyFrameObject *current = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(current);
    return current;
}

/* Count one operator issued from ``frame`` (stolen) with positional arguments
 * ``call_args`` (NULL: none). */
static PyObject *
record_from(Counter *self, PyObject *func, PyFrameObject *frame, PyObject *call_args)
{
    if (!self->active) {
        Py_XDECREF(frame);
        Py_RETURN_NONE;
    }
    PyObject *op = PyDict_GetItemWithError(self->op_names, func); /* borrowed */
    if (op == NULL) {
        PyErr_Clear(); /* not named yet, or unhashable: the Python path names it */
        return call_slow(self, func, frame, call_args);
    }
    if (PyUnicode_Tailmatch(op, collective, 0, PY_SSIZE_T_MAX, -1) == 1) {
        return call_slow(self, func, frame, call_args); /* remembers the rank */
    }
    PyObject *api = PyObject_GetAttr(self->local, api_str);
    if (api == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_XDECREF(frame);
            return NULL;
        }
        PyErr_Clear();
        api = Py_NewRef(Py_None);
    }
    if (api == Py_None && PyList_GET_SIZE(self->backward) > 0) {
        Py_DECREF(api);
        return call_slow(self, func, frame, call_args); /* maybe an autograd engine thread */
    }
    long long stream = 0;
    if (self->stream_of != Py_None) {
        PyObject *current = PyObject_CallNoArgs(self->stream_of);
        stream = current != NULL ? PyLong_AsLongLong(current) : -1;
        Py_XDECREF(current);
        if (stream == -1 && PyErr_Occurred()) {
            Py_DECREF(api);
            Py_XDECREF(frame);
            return NULL;
        }
    }
    Py_INCREF(op); /* op_dtype may run Python code (a tensor subclass's dtype) */
    PyObject *dtype = op_dtype(&self->naming, call_args);
    if (dtype == NULL) {
        Py_DECREF(api);
        Py_DECREF(op);
        Py_XDECREF(frame);
        return NULL;
    }
    Position local_buf[BUFFER];
    Position *buf = local_buf;
    Py_ssize_t cap = BUFFER;
    Py_ssize_t n = collect(self, frame, &buf, &cap, local_buf); /* steals frame */
    int failed = n < 0;
    if (!failed) {
        Py_ssize_t stack = find_stack(self, buf, n);
        failed = stack < 0 || count_site(self, stack, api, op, stream, dtype) < 0;
    }
    if (buf != local_buf) {
        PyMem_Free(buf);
    }
    Py_DECREF(api);
    Py_DECREF(op);
    Py_DECREF(dtype);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The (func, args, kwargs) of a mode's (mode, func, types, args=(), kwargs=None) call;
 * ``*kwargs`` is NULL for none. 0, or -1 with an exception. */
static int
mode_arguments(PyObject *const *args, Py_ssize_t nargs, const char *name, PyObject **func,
               PyObject **call_args, PyObject **kwargs)
{
    if (nargs < 3 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "%s(mode, func, types, args=(), kwargs=None)", name);
        return -1;
    }
    *func = args[1];
    *call_args = nargs > 3 ? args[3] : NULL;
    *kwargs = nargs > 4 && args[4] != Py_None ? args[4] : NULL;
    if (*call_args != NULL && !PyTuple_Check(*call_args)) {
        PyErr_Format(PyExc_TypeError, "%s() takes the arguments as a tuple", name);
        return -1;
    }
    if (*kwargs != NULL && !PyDict_Check(*kwargs)) {
        PyErr_Format(PyExc_TypeError, "%s() takes keyword arguments as a dict", name);
        return -1;
    }
    return 0;
}

static PyObject *
call_with(PyObject *func, PyObject *call_args, PyObject *kwargs)
{
    if (call_args == NULL) {
        PyObject *empty = PyTuple_New(0);
        PyObject *result = empty == NULL ? NULL : PyObject_Call(func, empty, kwargs);
        Py_XDECREF(empty);
        return result;
    }
    return PyObject_Call(func, call_args, kwargs);
}

/* Run ``func`` with ``api`` as ``local.api``, then set it back to None (keeping the
 * call's exception, if any). */
static PyObject *
call_as_api(PyObject *local, PyObject *api, PyObject *func, PyObject *call_args,
            PyObject *kwargs)
{
    if (PyObject_SetAttr(local, api_str, api) < 0) {
        return NULL;
    }
    PyObject *result = call_with(func, call_args, kwargs);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (PyObject_SetAttr(local, api_str, Py_None) < 0) {
        PyErr_Clear();
    }
    PyErr_Restore(type, value, traceback);
    return result;
}

/* Counter.dispatch(mode, func, types, args, kwargs): the dispatch mode's
 * ``__torch_dispatch__`` (bound to the mode as a method): count the operator, run it. */
static PyObject *
Counter_dispatch(Counter *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *func, *call_args, *kwargs;
    if (mode_arguments(args, nargs, "dispatch", &func, &call_args, &kwargs) < 0) {
        return NULL;
    }
    if (self->divert_call != NULL && self->divert_call != Py_None) {
        PyObject *named = PyDict_GetItemWithError(self->op_names, func); /* borrowed */
        int diverted = named == NULL;
        if (named == NULL) {
            PyErr_Clear(); /* not named yet, or unhashable: Python names it */
        }
        else if (self->divert != NULL && self->divert != Py_None) {
            diverted = PySet_Contains(self->divert, named);
            if (diverted < 0) {
                return NULL;
            }
        }
        if (diverted) {
            PyObject *frame = (PyObject *)running_frame();
            PyObject *empty = call_args == NULL ? PyTuple_New(0) : NULL;
            PyObject *result =
                (call_args == NULL && empty == NULL)
                    ? NULL
                    : PyObject_CallFunctionObjArgs(
                          self->divert_call, func, frame != NULL ? frame : Py_None,
                          call_args != NULL ? call_args : empty,
                          kwargs != NULL ? kwargs : Py_None, NULL);
            Py_XDECREF(empty);
            Py_XDECREF(frame);
            return result;
        }
    }
    PyObject *counted = record_from(self, func, running_frame(), call_args);
    if (counted == NULL) {
        return NULL;
    }
    Py_DECREF(counted);
    if (Py_TYPE(func) == (PyTypeObject *)self->overload_type) {
        /* OpOverload.__call__ is ``return self._op(*args, **kwargs)``: calling ``_op``
         * leaves no Python frame between the program and the kernel, so a warning the
         * kernel raises points at the program's line, as it does untraced */
        PyObject *op = PyObject_GetAttr(func, op_attr_str);
        if (op == NULL) {
            return NULL;
        }
        PyObject *result = call_with(op, call_args, kwargs);
        Py_DECREF(op);
        return result;
    }
    return call_with(func, call_args, kwargs);
}

/* Counter.function(mode, func, types, args, kwargs): the function mode's
 * ``__torch_function__`` (bound to the mode as a method): run a torch callable with its
 * public name as this thread's ``api`` (the outermost call's only). */
static PyObject *
Counter_function(Counter *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *func, *call_args, *kwargs;
    if (mode_arguments(args, nargs, "function", &func, &call_args, &kwargs) < 0) {
        return NULL;
    }
    PyObject *running = PyObject_GetAttr(self->local, api_str);
    if (running == NULL) {
        return NULL;
    }
    Py_DECREF(running); /* only compared with None */
    if (running != Py_None) {
        return call_with(func, call_args, kwargs);
    }
    PyObject *name = PyDict_GetItemWithError(self->api_names, func); /* borrowed */
    int backward = 0;
    if (name != NULL) {
        backward = PySet_Contains(self->backward_apis, name);
    }
    if (name == NULL || backward != 0) {
        /* not named yet, unhashable, or a backward pass: Python marks the api (and the
         * backward's stack), but the call itself runs from here, with no Python frame
         * of the tracer in between (a warning points at the program's line) */
        PyErr_Clear();
        PyObject *frame = (PyObject *)running_frame();
        PyObject *context = PyObject_CallFunctionObjArgs(self->enter_api, func,
                                                         frame != NULL ? frame : Py_None, NULL);
        Py_XDECREF(frame);
        if (context == NULL) {
            return NULL;
        }
        PyObject *result = call_with(func, call_args, kwargs);
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *done = PyObject_CallOneArg(self->exit_api, context);
        Py_DECREF(context);
        if (done == NULL) {
            Py_CLEAR(result);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return NULL;
        }
        Py_DECREF(done);
        PyErr_Restore(type, value, traceback);
        return result;
    }
    Py_INCREF(name);
    PyObject *result = call_as_api(self->local, name, func, call_args, kwargs);
    Py_DECREF(name);
    return result;
}

/* Counter.flush(): add the pending counts into ``counts``. */
static PyObject *
Counter_flush(Counter *self, PyObject *unused)
{
    for (Py_ssize_t i = 0; i < self->n_sites && self->pending > 0; i++) {
        Site *site = &self->sites[i];
        if (site->count == 0) {
            continue;
        }
        PyObject *stream = PyLong_FromLongLong(site->stream);
        PyObject *key = stream == NULL ? NULL
                                       : PyTuple_Pack(5, self->stacks[site->stack].tuple,
                                                      site->api, site->op, stream, site->dtype);
        Py_XDECREF(stream);
        if (key == NULL) {
            return NULL;
        }
        PyObject *old = PyDict_GetItemWithError(self->counts, key); /* borrowed */
        long before = old != NULL ? PyLong_AsLong(old) : 0;
        PyObject *updated = PyErr_Occurred() ? NULL : PyLong_FromLong(before + site->count);
        int failed = updated == NULL || PyDict_SetItem(self->counts, key, updated) < 0;
        Py_XDECREF(updated);
        Py_DECREF(key);
        if (failed) {
            return NULL;
        }
        site->count = 0;
        self->pending--;
    }
    Py_RETURN_NONE;
}

/* Counter.discard(): forget the pending counts (a forked child starts from zero). */
static PyObject *
Counter_discard(Counter *self, PyObject *unused)
{
    for (Py_ssize_t i = 0; i < self->n_sites; i++) {
        self->sites[i].count = 0;
    }
    self->pending = 0;
    Py_RETURN_NONE;
}

/* Counter.walk(frame): the raw stack from ``frame`` outwards, as ``tracer._walk``. */
static PyObject *
Counter_walk(Counter *self, PyObject *frame)
{
    if (frame == Py_None) {
        return PyTuple_New(0);
    }
    if (!PyFrame_Check(frame)) {
        PyErr_SetString(PyExc_TypeError, "walk() takes a frame or None");
        return NULL;
    }
    Position local_buf[BUFFER];
    Position *buf = local_buf;
    Py_ssize_t cap = BUFFER;
    Py_ssize_t n = collect(self, (PyFrameObject *)Py_NewRef(frame), &buf, &cap, local_buf);
    PyObject *result = n < 0 ? NULL : stack_tuple(self, buf, n);
    if (buf != local_buf) {
        PyMem_Free(buf);
    }
    return result;
}

/* ------------------------------------------------------------------- type */

static void
Counter_free_tables(Counter *self)
{
    for (Py_ssize_t i = 0; i < self->n_stacks; i++) {
        PyMem_Free(self->stacks[i].positions);
        Py_XDECREF(self->stacks[i].tuple);
    }
    PyMem_Free(self->stacks);
    self->stacks = NULL;
    self->n_stacks = self->cap_stacks = 0;
    for (Py_ssize_t i = 0; i < self->n_sites; i++) {
        Py_XDECREF(self->sites[i].api);
        Py_XDECREF(self->sites[i].op);
        Py_XDECREF(self->sites[i].dtype);
    }
    PyMem_Free(self->sites);
    self->sites = NULL;
    self->n_sites = self->cap_sites = self->pending = 0;
    index_free(&self->stack_index);
    index_free(&self->site_index);
    id_table_free(&self->ids);
}

static int
Counter_init(Counter *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"counts",    "codes",         "modules",   "op_names",
                            "local",     "backward",      "skip_files", "slow",
                            "api_names", "backward_apis", "enter_api", "exit_api",
                            "overload_type", "stream_of", "divert", "divert_call",
                            "tensor_type", "dtype_names", "dtype_name", NULL};
    PyObject *counts, *codes, *modules, *op_names, *local, *backward, *skip_files, *slow;
    PyObject *api_names, *backward_apis, *enter_api, *exit_api, *overload_type;
    PyObject *stream_of = Py_None, *divert = Py_None, *divert_call = Py_None;
    PyObject *tensor_type = NULL, *dtype_names = NULL, *dtype_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O!OO!OOO!OOOO!|OOOOOO", names,
                                     &PyDict_Type, &counts, &PyDict_Type, &codes, &PyDict_Type,
                                     &modules, &PyDict_Type, &op_names, &local, &PyList_Type,
                                     &backward, &skip_files, &slow, &PyDict_Type, &api_names,
                                     &backward_apis, &enter_api, &exit_api, &PyType_Type,
                                     &overload_type, &stream_of, &divert, &divert_call,
                                     &tensor_type, &dtype_names, &dtype_name)) {
        return -1;
    }
    if ((tensor_type == NULL) != (dtype_names == NULL) ||
        (tensor_type == NULL) != (dtype_name == NULL)) {
        PyErr_SetString(PyExc_TypeError, "tensor_type, dtype_names and dtype_name go together");
        return -1;
    }
    /* without them, those of record/dtypes.py (native_naming) */
    if (tensor_type == NULL ? naming_load(&self->naming) < 0
                            : naming_set(&self->naming, tensor_type, dtype_names, dtype_name) < 0) {
        return -1;
    }
    if (divert != Py_None && !PyAnySet_Check(divert)) {
        PyErr_SetString(PyExc_TypeError, "divert must be a set or None");
        return -1;
    }
    if (!PyAnySet_Check(skip_files) || !PyAnySet_Check(backward_apis)) {
        PyErr_SetString(PyExc_TypeError, "skip_files and backward_apis must be sets");
        return -1;
    }
    Py_XSETREF(self->api_names, Py_NewRef(api_names));
    Py_XSETREF(self->backward_apis, Py_NewRef(backward_apis));
    Py_XSETREF(self->enter_api, Py_NewRef(enter_api));
    Py_XSETREF(self->exit_api, Py_NewRef(exit_api));
    Py_XSETREF(self->overload_type, Py_NewRef(overload_type));
    Counter_free_tables(self);
    Py_XSETREF(self->counts, Py_NewRef(counts));
    Py_XSETREF(self->codes, Py_NewRef(codes));
    Py_XSETREF(self->modules, Py_NewRef(modules));
    Py_XSETREF(self->op_names, Py_NewRef(op_names));
    Py_XSETREF(self->local, Py_NewRef(local));
    Py_XSETREF(self->backward, Py_NewRef(backward));
    Py_XSETREF(self->skip_files, Py_NewRef(skip_files));
    Py_XSETREF(self->slow, Py_NewRef(slow));
    Py_XSETREF(self->stream_of, Py_NewRef(stream_of));
    Py_XSETREF(self->divert, Py_NewRef(divert));
    Py_XSETREF(self->divert_call, Py_NewRef(divert_call));
    self->active = 0;
    if (self->positions == NULL) {
        self->positions = PyMem_Calloc(POSITIONS_CACHED, sizeof(PyObject *));
        if (self->positions == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (index_init(&self->stack_index, 1024) < 0 || index_init(&self->site_index, 1024) < 0) {
        return -1;
    }
    return 0;
}

static int
Counter_traverse(Counter *self, visitproc visit, void *arg)
{
    Py_VISIT(self->counts);
    Py_VISIT(self->codes);
    Py_VISIT(self->modules);
    Py_VISIT(self->op_names);
    Py_VISIT(self->local);
    Py_VISIT(self->backward);
    Py_VISIT(self->skip_files);
    Py_VISIT(self->slow);
    Py_VISIT(self->api_names);
    Py_VISIT(self->backward_apis);
    Py_VISIT(self->enter_api);
    Py_VISIT(self->exit_api);
    Py_VISIT(self->overload_type);
    Py_VISIT(self->stream_of);
    Py_VISIT(self->divert);
    Py_VISIT(self->divert_call);
    return naming_traverse(&self->naming, visit, arg);
}

static int
Counter_clear(Counter *self)
{
    Py_CLEAR(self->counts);
    Py_CLEAR(self->codes);
    Py_CLEAR(self->modules);
    Py_CLEAR(self->op_names);
    Py_CLEAR(self->local);
    Py_CLEAR(self->backward);
    Py_CLEAR(self->skip_files);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->api_names);
    Py_CLEAR(self->backward_apis);
    Py_CLEAR(self->enter_api);
    Py_CLEAR(self->exit_api);
    Py_CLEAR(self->overload_type);
    Py_CLEAR(self->stream_of);
    Py_CLEAR(self->divert);
    Py_CLEAR(self->divert_call);
    naming_clear(&self->naming);
    return 0;
}

static void
Counter_dealloc(Counter *self)
{
    PyObject_GC_UnTrack(self);
    Counter_clear(self);
    Counter_free_tables(self);
    if (self->positions != NULL) {
        for (Py_ssize_t i = 0; i < POSITIONS_CACHED; i++) {
            Py_XDECREF(self->positions[i]);
        }
        PyMem_Free(self->positions);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Counter_members[] = {
    {"active", T_BOOL, offsetof(Counter, active), 0, "count only while true"},
    {NULL},
};

static PyMethodDef Counter_methods[] = {
    {"dispatch", (PyCFunction)(void (*)(void))Counter_dispatch, METH_FASTCALL,
     "dispatch(mode, func, types, args=(), kwargs=None): count the operator, run it"},
    {"function", (PyCFunction)(void (*)(void))Counter_function, METH_FASTCALL,
     "function(mode, func, types, args=(), kwargs=None): run func as this thread's api"},
    {"flush", (PyCFunction)Counter_flush, METH_NOARGS,
     "flush(): add the pending counts into counts"},
    {"discard", (PyCFunction)Counter_discard, METH_NOARGS,
     "discard(): forget the pending counts"},
    {"walk", (PyCFunction)Counter_walk, METH_O,
     "walk(frame): the raw stack from frame outwards, outermost first"},
    {NULL},
};

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "opguard_plugins.record._recorder.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Counts (stack, api, op, stream, dtype) keys for the modes backend; see tracer.py.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Counter_init,
    .tp_dealloc = (destructor)Counter_dealloc,
    .tp_traverse = (traverseproc)Counter_traverse,
    .tp_clear = (inquiry)Counter_clear,
    .tp_methods = Counter_methods,
    .tp_members = Counter_members,
};

/* ----------------------------------------------------------- TargetWalker */

/* The guard's per-operator stack walk (enforce/runtime.py, ``Guard.active_targets``, the
 * reference): from a frame outwards, each code object named once by the Python callable
 * ``name_code(code, globals)`` (a config target, None, or one marked "\0" or "\1"; one
 * marked "\2", a frame --ignore cut out, is walked as a target) and remembered by
 * address; the code is kept alive by the table. */
typedef struct {
    PyObject_HEAD
    PyObject *name_code;   /* callable(code, globals) -> str | None */
    IdTable names;         /* code address -> its name (strong references to both) */
    PyObject *local;       /* threading.local whose .api is the running torch_api target */
    PyObject *api_targets; /* dict: torch callable -> its torch_api target or None */
    PyObject *api_target;  /* callable(func) -> that target, filling api_targets */
    PyObject *guard;       /* the Guard: .checking, .collective_checks, ._by_active */
    PyObject *slow;        /* _Mode.__torch_dispatch__, the Python path (the reference) */
    PyObject *stream_of;   /* callable() -> the guard's number of the stream, or None */
    PyObject *by_active;   /* the guard's dict: active targets -> state */
    PyObject *namespaces;  /* frozenset of the collectives' op namespaces */
    PyObject *skipped;     /* set of ops neither checked nor counted (profiling marks) */
    int dtypes;            /* 1: ``state.ok`` is keyed by (func, stream, dtype) */
    DtypeNaming naming;    /* record/dtypes.py's, loaded when ``dtypes`` is first set */
} TargetWalker;

static PyObject *checking_str, *collective_checks_str, *namespace_str, *one;
static PyObject *watch_str, *extra_str, *chain_str, *known_str, *ok_str, *ops_str;

#define FOUND_CACHED 64

/* The name of ``code`` (borrowed), asking ``name_code`` for one not seen before. */
static PyObject *
walker_name(TargetWalker *self, PyCodeObject *code, PyFrameObject *frame)
{
    if (self->names.size) {
        Py_ssize_t slot = id_slot(&self->names, code);
        if (self->names.ids[slot] != NULL) {
            return self->names.ids[slot];
        }
    }
    PyObject *globals = PyFrame_GetGlobals(frame);
    if (globals == NULL) {
        return NULL;
    }
    PyObject *name = PyObject_CallFunctionObjArgs(self->name_code, (PyObject *)code, globals, NULL);
    Py_DECREF(globals);
    if (name == NULL) {
        return NULL;
    }
    if (name != Py_None && (!PyUnicode_Check(name) || PyUnicode_GET_LENGTH(name) == 0)) {
        Py_DECREF(name);
        PyErr_SetString(PyExc_TypeError, "name_code must return a non-empty str or None");
        return NULL;
    }
    /* the callable ran Python code: the table may have grown, or gained this code */
    if (2 * (self->names.used + 1) > self->names.size && id_table_grow(&self->names) < 0) {
        Py_DECREF(name);
        return NULL;
    }
    Py_ssize_t slot = id_slot(&self->names, code);
    if (self->names.ids[slot] != NULL) {
        Py_DECREF(name);
        return self->names.ids[slot];
    }
    self->names.addresses[slot] = Py_NewRef(code);
    self->names.ids[slot] = name;
    self->names.used++;
    return name;
}

/* TargetWalker.active_targets(frame, api=None): as ``Guard.active_targets``. */
static PyObject *
TargetWalker_active_targets(TargetWalker *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "active_targets(frame, api=None)");
        return NULL;
    }
    PyObject *frame_arg = args[0];
    PyObject *api = nargs == 2 ? args[1] : Py_None;
    if (frame_arg != Py_None && !PyFrame_Check(frame_arg)) {
        PyErr_SetString(PyExc_TypeError, "active_targets() takes a frame or None");
        return NULL;
    }
    PyObject *cached[FOUND_CACHED];
    PyObject **found = cached; /* borrowed from the table, except found[0] */
    Py_ssize_t n = 1, cap = FOUND_CACHED;
    PyObject *result = NULL;
    found[0] = NULL; /* the program's innermost function the config lacks: owned */
    int leaf = 1, crossed = 0;
    PyFrameObject *frame = frame_arg == Py_None ? NULL : (PyFrameObject *)Py_NewRef(frame_arg);
    while (frame != NULL) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        PyObject *name = walker_name(self, code, frame);
        Py_DECREF(code); /* kept alive by the table */
        if (name == NULL) {
            goto done;
        }
        if (name != Py_None) {
            Py_UCS4 mark = PyUnicode_READ_CHAR(name, 0);
            if (mark == 1) { /* the guard's or torch's plumbing */
                crossed = 1;
            }
            else if (mark == 0) { /* a program function the config lacks */
                if (leaf && n == 1) {
                    Py_XSETREF(found[0], PyUnicode_Substring(name, 1, PyUnicode_GET_LENGTH(name)));
                    if (found[0] == NULL) {
                        goto done;
                    }
                }
                leaf = crossed = 0;
            }
            else {
                /* a call that re-entered the function which handed it to the api mode */
                int repeat = 0;
                if (crossed && n > 1) {
                    repeat = PyObject_RichCompareBool(found[n - 1], name, Py_EQ);
                    if (repeat < 0) {
                        goto done;
                    }
                }
                if (!repeat) {
                    if (n == cap) {
                        PyObject **bigger = PyMem_Malloc(sizeof(PyObject *) * (size_t)(cap * 2));
                        if (bigger == NULL) {
                            PyErr_NoMemory();
                            goto done;
                        }
                        memcpy(bigger, found, sizeof(PyObject *) * (size_t)n);
                        if (found != cached) {
                            PyMem_Free(found);
                        }
                        found = bigger;
                        cap *= 2;
                    }
                    found[n++] = name;
                }
                leaf = crossed = 0;
            }
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    result = PyTuple_New(n + 1);
    if (result != NULL) {
        PyTuple_SET_ITEM(result, 0, Py_NewRef(api));
        PyTuple_SET_ITEM(result, 1, found[0] != NULL ? Py_NewRef(found[0]) : Py_NewRef(Py_None));
        for (Py_ssize_t i = 1; i < n; i++) {
            PyTuple_SET_ITEM(result, i + 1, Py_NewRef(found[i]));
        }
    }
done:
    Py_XDECREF(frame);
    Py_XDECREF(found[0]);
    if (found != cached) {
        PyMem_Free(found);
    }
    return result;
}

/* TargetWalker.function(mode, func, types, args, kwargs): the guard's api mode's
 * ``__torch_function__`` (bound to the mode as a method; ``_ApiMode`` in runtime.py is
 * the reference): run ``func`` with its torch_api target as this thread's ``api``. */
static PyObject *
TargetWalker_function(TargetWalker *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *func, *call_args, *kwargs;
    if (mode_arguments(args, nargs, "function", &func, &call_args, &kwargs) < 0) {
        return NULL;
    }
    if (self->local == NULL) {
        PyErr_SetString(PyExc_TypeError, "function() needs local, api_targets and api_target");
        return NULL;
    }
    PyObject *target = PyDict_GetItemWithError(self->api_targets, func); /* borrowed */
    if (target != NULL) {
        Py_INCREF(target);
    }
    else {
        PyErr_Clear(); /* not seen yet, or unhashable: the Python callable decides */
        target = PyObject_CallOneArg(self->api_target, func);
        if (target == NULL) {
            return NULL;
        }
    }
    PyObject *result = call_as_api(self->local, target, func, call_args, kwargs);
    Py_DECREF(target);
    return result;
}

/* A state attribute's truth, or -1 with an exception. */
static int
attribute_true(PyObject *object, PyObject *name)
{
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL) {
        return -1;
    }
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* The key of an op in ``state.ok``, as ``_Mode.__torch_dispatch__`` makes it: with
 * ``dtypes``, (func, stream, dtype), the stream None where there is none and the dtype
 * ``op_dtype``'s of the positional arguments ``call_args`` (NULL: none); else ``func``
 * alone (no stream) or (func, stream). A new reference, or NULL with an exception. */
static PyObject *
walker_key(TargetWalker *self, PyObject *func, PyObject *stream, PyObject *call_args)
{
    if (self->dtypes) {
        PyObject *dtype = op_dtype(&self->naming, call_args);
        if (dtype == NULL) {
            return NULL;
        }
        PyObject *key = PyTuple_Pack(3, func, stream, dtype);
        Py_DECREF(dtype);
        return key;
    }
    return stream == Py_None ? Py_NewRef(func) : PyTuple_Pack(2, func, stream);
}

/* 1 when the guard's Python path must see this op (a collective, a state not resolved
 * yet, or anything but an op already accepted there), 0 when it was counted here
 * (``state.ops``), -1 with an exception. */
static int
walker_count(TargetWalker *self, PyObject *func, PyObject *stream, PyObject *call_args)
{
    if (self->skipped != NULL) {
        int skip = PySet_Contains(self->skipped, func);
        if (skip != 0) {
            return skip < 0 ? -1 : 0; /* a profiling mark: run, not counted */
        }
    }
    int collective_checks = attribute_true(self->guard, collective_checks_str);
    if (collective_checks < 0) {
        return -1;
    }
    if (collective_checks) {
        PyObject *space = PyObject_GetAttr(func, namespace_str);
        if (space == NULL) {
            PyErr_Clear(); /* no namespace: not a collective */
        }
        else {
            int found = PySet_Contains(self->namespaces, space);
            Py_DECREF(space);
            if (found != 0) {
                return found < 0 ? -1 : 1;
            }
        }
    }
    int checking = attribute_true(self->guard, checking_str);
    if (checking <= 0) {
        return checking;
    }
    PyObject *api = PyObject_GetAttr(self->local, api_str);
    if (api == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return -1;
        }
        PyErr_Clear();
        api = Py_NewRef(Py_None);
    }
    PyFrameObject *frame = running_frame();
    PyObject *walk_args[2] = {frame != NULL ? (PyObject *)frame : Py_None, api};
    PyObject *active = TargetWalker_active_targets(self, walk_args, 2);
    Py_XDECREF(frame);
    Py_DECREF(api);
    if (active == NULL) {
        return -1;
    }
    PyObject *state = PyDict_GetItemWithError(self->by_active, active); /* borrowed */
    Py_DECREF(active);
    if (state == NULL) {
        return PyErr_Occurred() ? -1 : 1;
    }
    Py_INCREF(state);
    int result = -1;
    int watch = attribute_true(state, watch_str);
    if (watch < 0) {
        goto done;
    }
    if (watch) {
        int extra = attribute_true(state, extra_str);
        int chain = extra != 0 ? extra : attribute_true(state, chain_str);
        if (extra != 0 || chain != 0) {
            result = extra < 0 || chain < 0 ? -1 : 1;
            goto done;
        }
        int known = attribute_true(state, known_str);
        if (known < 0) {
            goto done;
        }
        if (known) {
            PyObject *ok = PyObject_GetAttr(state, ok_str);
            if (ok == NULL) {
                goto done;
            }
            PyObject *key = walker_key(self, func, stream, call_args);
            PyObject *seen = key == NULL ? NULL : PyDict_GetItemWithError(ok, key);
            Py_XDECREF(key);
            Py_DECREF(ok);
            if (seen != Py_True) {
                result = PyErr_Occurred() ? -1 : 1; /* first sight, or a violation */
                goto done;
            }
        }
    }
    PyObject *ops = PyObject_GetAttr(state, ops_str);
    if (ops == NULL) {
        goto done;
    }
    PyObject *more = PyNumber_Add(ops, one);
    Py_DECREF(ops);
    if (more == NULL) {
        goto done;
    }
    result = PyObject_SetAttr(state, ops_str, more);
    Py_DECREF(more);
done:
    Py_DECREF(state);
    return result;
}

/* TargetWalker.dispatch(mode, func, types, args, kwargs): the guard's dispatch mode's
 * ``__torch_dispatch__`` (bound to the mode as a method; ``_Mode.__torch_dispatch__`` is
 * the reference and the path of everything but an op already accepted in its state). */
static PyObject *
TargetWalker_dispatch(TargetWalker *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *func, *call_args, *kwargs;
    if (mode_arguments(args, nargs, "dispatch", &func, &call_args, &kwargs) < 0) {
        return NULL;
    }
    if (self->guard == NULL) {
        PyErr_SetString(PyExc_TypeError, "dispatch() needs guard, slow and stream_of");
        return NULL;
    }
    PyObject *stream = Py_None;
    if (self->stream_of != Py_None) {
        stream = PyObject_CallNoArgs(self->stream_of);
        if (stream == NULL) {
            return NULL;
        }
    }
    else {
        Py_INCREF(stream);
    }
    int slow = walker_count(self, func, stream, call_args);
    Py_DECREF(stream);
    if (slow < 0) {
        return NULL;
    }
    if (slow) {
        return PyObject_Vectorcall(self->slow, args, (size_t)nargs, NULL);
    }
    return call_with(func, call_args, kwargs);
}

static void
walker_free_names(TargetWalker *self)
{
    for (Py_ssize_t i = 0; i < self->names.size; i++) {
        Py_XDECREF((PyObject *)self->names.addresses[i]);
    }
    id_table_free(&self->names);
}

static int
TargetWalker_init(TargetWalker *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"name_code", "local",     "api_targets", "api_target", "guard",
                            "slow",      "stream_of", "namespaces",  "skipped",  NULL};
    PyObject *name_code, *local = NULL, *api_targets = NULL, *api_target = NULL;
    PyObject *guard = NULL, *slow = NULL, *stream_of = NULL, *namespaces = NULL;
    PyObject *skipped = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO!OOOOOO", names, &name_code, &local,
                                     &PyDict_Type, &api_targets, &api_target, &guard, &slow,
                                     &stream_of, &namespaces, &skipped)) {
        return -1;
    }
    PyObject *by_active = NULL;
    if (guard != NULL) {
        if (local == NULL || slow == NULL || stream_of == NULL || namespaces == NULL ||
            !PyCallable_Check(slow) || (stream_of != Py_None && !PyCallable_Check(stream_of)) ||
            !PyAnySet_Check(namespaces) || (skipped != NULL && !PyAnySet_Check(skipped))) {
            PyErr_SetString(PyExc_TypeError, "guard needs local, a callable slow, stream_of "
                                             "(or None), a set of namespaces (and a set "
                                             "of skipped ops)");
            return -1;
        }
        by_active = PyObject_GetAttrString(guard, "_by_active");
        if (by_active == NULL) {
            return -1;
        }
        if (!PyDict_Check(by_active)) {
            Py_DECREF(by_active);
            PyErr_SetString(PyExc_TypeError, "guard._by_active must be a dict");
            return -1;
        }
    }
    Py_XSETREF(self->guard, Py_XNewRef(guard));
    Py_XSETREF(self->slow, Py_XNewRef(slow));
    Py_XSETREF(self->stream_of, Py_XNewRef(stream_of));
    Py_XSETREF(self->by_active, by_active);
    Py_XSETREF(self->namespaces, Py_XNewRef(namespaces));
    Py_XSETREF(self->skipped, Py_XNewRef(skipped));
    if (!PyCallable_Check(name_code) ||
        (api_target != NULL && !PyCallable_Check(api_target))) {
        PyErr_SetString(PyExc_TypeError, "name_code and api_target must be callable");
        return -1;
    }
    if ((local == NULL) != (api_target == NULL) || (local == NULL) != (api_targets == NULL)) {
        PyErr_SetString(PyExc_TypeError, "local, api_targets and api_target go together");
        return -1;
    }
    Py_XSETREF(self->name_code, Py_NewRef(name_code));
    Py_XSETREF(self->local, Py_XNewRef(local));
    Py_XSETREF(self->api_targets, Py_XNewRef(api_targets));
    Py_XSETREF(self->api_target, Py_XNewRef(api_target));
    walker_free_names(self);
    return 0;
}

static int
TargetWalker_traverse(TargetWalker *self, visitproc visit, void *arg)
{
    Py_VISIT(self->name_code);
    Py_VISIT(self->local);
    Py_VISIT(self->api_targets);
    Py_VISIT(self->api_target);
    Py_VISIT(self->guard);
    Py_VISIT(self->slow);
    Py_VISIT(self->stream_of);
    Py_VISIT(self->by_active);
    Py_VISIT(self->namespaces);
    Py_VISIT(self->skipped);
    return naming_traverse(&self->naming, visit, arg);
}

static int
TargetWalker_clear(TargetWalker *self)
{
    Py_CLEAR(self->name_code);
    Py_CLEAR(self->local);
    Py_CLEAR(self->api_targets);
    Py_CLEAR(self->api_target);
    Py_CLEAR(self->guard);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->stream_of);
    Py_CLEAR(self->by_active);
    Py_CLEAR(self->namespaces);
    Py_CLEAR(self->skipped);
    naming_clear(&self->naming);
    return 0;
}

static void
TargetWalker_dealloc(TargetWalker *self)
{
    PyObject_GC_UnTrack(self);
    TargetWalker_clear(self);
    walker_free_names(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef TargetWalker_methods[] = {
    {"active_targets", (PyCFunction)(void (*)(void))TargetWalker_active_targets, METH_FASTCALL,
     "active_targets(frame, api=None, /): api, the program's innermost function the config "
     "lacks (or None), then the config targets on the stack from frame outwards, innermost "
     "first"},
    {"function", (PyCFunction)(void (*)(void))TargetWalker_function, METH_FASTCALL,
     "function(mode, func, types, args=(), kwargs=None): run func as this thread's api"},
    {"dispatch", (PyCFunction)(void (*)(void))TargetWalker_dispatch, METH_FASTCALL,
     "dispatch(mode, func, types, args=(), kwargs=None): count an op already accepted in "
     "its state and run it; anything else goes to slow"},
    {NULL},
};

static PyObject *
TargetWalker_get_dtypes(TargetWalker *self, void *closure)
{
    return PyLong_FromLong(self->dtypes);
}

/* ``dtypes = 1`` keys ``state.ok`` by (func, stream, dtype); the first time, it loads
 * the naming of record/dtypes.py (so no op pays for an import). */
static int
TargetWalker_set_dtypes(TargetWalker *self, PyObject *value, void *closure)
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "dtypes cannot be deleted");
        return -1;
    }
    long flag = PyLong_AsLong(value);
    if (flag == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (flag != 0 && flag != 1) {
        PyErr_SetString(PyExc_ValueError, "dtypes must be 0 or 1");
        return -1;
    }
    if (flag && self->naming.tensor_type == NULL && naming_load(&self->naming) < 0) {
        return -1;
    }
    self->dtypes = (int)flag;
    return 0;
}

static PyGetSetDef TargetWalker_getset[] = {
    {"dtypes", (getter)TargetWalker_get_dtypes, (setter)TargetWalker_set_dtypes,
     "1: an op's key in state.ok is (func, stream, dtype); 0 (the default): func or "
     "(func, stream)",
     NULL},
    {NULL},
};

static PyTypeObject TargetWalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "opguard_plugins.record._recorder.TargetWalker",
    .tp_basicsize = sizeof(TargetWalker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The guard's stack walk; see enforce/runtime.py (Guard.active_targets).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)TargetWalker_init,
    .tp_dealloc = (destructor)TargetWalker_dealloc,
    .tp_traverse = (traverseproc)TargetWalker_traverse,
    .tp_clear = (inquiry)TargetWalker_clear,
    .tp_methods = TargetWalker_methods,
    .tp_getset = TargetWalker_getset,
};

static struct PyModuleDef recorder_module = {
    PyModuleDef_HEAD_INIT, "opguard_plugins.record._recorder",
    "The modes backend's per-operator hot path in C (optional; see tracer.py).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__recorder(void)
{
    api_str = PyUnicode_InternFromString("api");
    name_str = PyUnicode_InternFromString("__name__");
    collective = PyUnicode_FromString("c10d::");
    op_attr_str = PyUnicode_InternFromString("_op");
    dtype_str = PyUnicode_InternFromString("dtype");
    if (api_str == NULL || name_str == NULL || collective == NULL || op_attr_str == NULL ||
        dtype_str == NULL) {
        return NULL;
    }
    checking_str = PyUnicode_InternFromString("checking");
    collective_checks_str = PyUnicode_InternFromString("collective_checks");
    namespace_str = PyUnicode_InternFromString("namespace");
    watch_str = PyUnicode_InternFromString("watch");
    extra_str = PyUnicode_InternFromString("extra");
    chain_str = PyUnicode_InternFromString("chain");
    known_str = PyUnicode_InternFromString("known");
    ok_str = PyUnicode_InternFromString("ok");
    ops_str = PyUnicode_InternFromString("ops");
    one = PyLong_FromLong(1);
    if (checking_str == NULL || collective_checks_str == NULL || namespace_str == NULL ||
        watch_str == NULL || extra_str == NULL || chain_str == NULL || known_str == NULL ||
        ok_str == NULL || ops_str == NULL || one == NULL) {
        return NULL;
    }
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&TargetWalkerType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&recorder_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "Counter", (PyObject *)&CounterType) < 0 ||
        PyModule_AddObjectRef(module, "TargetWalker", (PyObject *)&TargetWalkerType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
