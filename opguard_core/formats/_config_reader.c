/* The fast config reader in C: opguard_core.formats.config_reader's _Reader, line for
 * line (docs/performance.md, "Scale of the small things"). That module stays the
 * reference: the same texts are accepted, the same ruamel containers (same flow and
 * block styles, same key order) hold the same values, and every text the reference
 * leaves to ruamel (it raises Unusual) gives None here. The caller still writes the
 * result back with the fast writer and compares it with the text read.
 *
 * The text is read as UTF-8 bytes: every character the grammar looks at is ASCII,
 * and no byte of a multi-byte character is ASCII, so byte offsets cut the text where
 * the reference's character offsets do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    const char *text;        /* the whole text, UTF-8 */
    Py_ssize_t *starts;      /* start of each line */
    Py_ssize_t *ends;        /* end of each line (its '\n' excluded) */
    Py_ssize_t lines;        /* how many */
    Py_ssize_t at;           /* the line read next */
    PyObject *map_type, *seq_type, *format_type, *format_attrib, *ok_name, *flow_name;
    long max_level;
    Py_ssize_t max_int_chars;
    int unusual;             /* set: the reference raises Unusual here */
    int strict;              /* refuse what the fast writer cannot write back (below) */
    PyObject *strings[2];    /* strict: each string read -> its token, in block, flow */
    PyObject *floats;        /* strict: (value, token, flow) of each float read */
    PyObject *shared;        /* each distinct string read, once: equal strings are one
                                object, so their hash is computed once and compared by
                                identity (the merge and the writer look them up) */
} Reader;

typedef struct {
    const char *p;
    Py_ssize_t n;
} Span;

static PyObject *
unusual(Reader *r)
{
    r->unusual = 1;
    return NULL;
}

static int
starts_with(Span s, Py_ssize_t at, const char *prefix)
{
    Py_ssize_t k = (Py_ssize_t)strlen(prefix);
    return at >= 0 && at + k <= s.n && memcmp(s.p + at, prefix, (size_t)k) == 0;
}

static Py_ssize_t
find2(Span s, Py_ssize_t from, char a, char b)
{
    /* s.find(a + b, from) */
    for (Py_ssize_t i = from; i + 1 < s.n; i++) {
        if (s.p[i] == a && s.p[i + 1] == b) {
            return i;
        }
    }
    return -1;
}

static PyObject *
decode(const char *p, Py_ssize_t n)
{
    return PyUnicode_DecodeUTF8(p, n, "strict");
}

/* a string read: the one object already read equal to p[:n], or a new one */
static PyObject *
decode_shared(Reader *r, const char *p, Py_ssize_t n)
{
    PyObject *text = decode(p, n);
    if (text == NULL) {
        return NULL;
    }
    PyObject *known = PyDict_SetDefault(r->shared, text, text);
    Py_XINCREF(known);
    Py_DECREF(text);
    return known;
}

/* ------------------------------------------------------------------ containers */

/* a new container marked flow (1) or block (0), or unmarked (-1) */
static PyObject *
new_container(Reader *r, PyObject *type, int flow, long level)
{
    if (level > r->max_level) {
        return unusual(r);
    }
    PyObject *obj = PyObject_CallNoArgs(type);
    if (obj == NULL) {
        return NULL;
    }
    if (flow < 0) {
        return obj;
    }
    PyObject *fmt = PyObject_CallNoArgs(r->format_type);
    if (fmt == NULL || PyObject_SetAttr(fmt, r->flow_name, flow ? Py_True : Py_False) < 0 ||
        PyObject_SetAttr(obj, r->format_attrib, fmt) < 0) {
        Py_XDECREF(fmt);
        Py_DECREF(obj);
        return NULL;
    }
    Py_DECREF(fmt);
    return obj;
}

/* styles.put_new: OrderedDict.__setitem__ and mapping._ok.add(key) */
static int
put_new(Reader *r, PyObject *mapping, PyObject *key, PyObject *value)
{
    if (PyODict_SetItem(mapping, key, value) < 0) {
        return -1;
    }
    PyObject *ok = PyObject_GetAttr(mapping, r->ok_name);
    if (ok == NULL) {
        return -1;
    }
    int done = PySet_Check(ok) ? PySet_Add(ok, key) : -1;
    if (done < 0 && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_TypeError, "CommentedMap._ok is not a set");
    }
    Py_DECREF(ok);
    return done;
}

/* strict: note that string value was written as token in block (0) or flow (1)
 * context; one string written two ways is refused (one of them is not the writer's) */
static int
record(Reader *r, PyObject *value, PyObject *token, int flow)
{
    PyObject *known = PyDict_SetDefault(r->strings[flow], value, token);
    if (known == NULL) {
        return -1;
    }
    if (known != token) {
        int same = PyUnicode_Compare(known, token);
        if (same == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (same != 0) {
            r->unusual = 1;
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ scalars */

static int
is_digit(char c)
{
    return c >= '0' && c <= '9';
}

/* _INT.fullmatch: -?(?:0|[1-9][0-9]*) */
static int
match_int(Span s)
{
    Py_ssize_t i = 0;
    if (i < s.n && s.p[i] == '-') {
        i++;
    }
    if (i >= s.n) {
        return 0;
    }
    if (s.p[i] == '0') {
        return i + 1 == s.n;
    }
    if (!is_digit(s.p[i])) {
        return 0;
    }
    for (; i < s.n; i++) {
        if (!is_digit(s.p[i])) {
            return 0;
        }
    }
    return 1;
}

static Py_ssize_t
digits(Span s, Py_ssize_t i)
{
    while (i < s.n && is_digit(s.p[i])) {
        i++;
    }
    return i;
}

/* an exponent [eE][-+]?[0-9]+ at i: the index after it, or -1 */
static Py_ssize_t
exponent(Span s, Py_ssize_t i)
{
    if (i >= s.n || (s.p[i] != 'e' && s.p[i] != 'E')) {
        return -1;
    }
    i++;
    if (i < s.n && (s.p[i] == '-' || s.p[i] == '+')) {
        i++;
    }
    Py_ssize_t end = digits(s, i);
    return end > i ? end : -1;
}

/* _FLOAT.fullmatch:
 * -?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|-?[0-9]+[eE][-+]?[0-9]+ */
static int
match_float(Span s)
{
    Py_ssize_t i = 0;
    if (i < s.n && s.p[i] == '-') {
        i++;
    }
    Py_ssize_t whole = digits(s, i);
    Py_ssize_t after;
    if (whole > i && whole < s.n && s.p[whole] == '.') {
        after = digits(s, whole + 1);
    }
    else if (whole == i && i < s.n && s.p[i] == '.') {
        after = digits(s, i + 1);
        if (after == i + 1) {
            return 0;
        }
    }
    else if (whole > i) {
        return exponent(s, whole) == s.n;  /* the second alternative */
    }
    else {
        return 0;
    }
    if (after == s.n) {
        return 1;
    }
    return exponent(s, after) == s.n;
}

/* _plain; flow: in a flow collection; key: a mapping's key */
static PyObject *
plain(Reader *r, Span s, int flow, int key)
{
    if (s.n == 0) {
        return unusual(r);
    }
    if ((s.n == 4 && memcmp(s.p, "true", 4) == 0) || (s.n == 5 && memcmp(s.p, "false", 5) == 0)) {
        if (r->strict && key) {
            return unusual(r); /* the writer writes str and int keys only */
        }
        return PyBool_FromLong(s.n == 4);
    }
    if (match_int(s)) {
        if (s.n > r->max_int_chars) {
            return unusual(r);
        }
        if (r->strict && ((s.n == 2 && s.p[0] == '-' && s.p[1] == '0') || (key && s.n >= 100))) {
            return unusual(r); /* repr(0) is "0"; the writer's keys are below 100 */
        }
        char buffer[128];
        memcpy(buffer, s.p, (size_t)s.n);
        buffer[s.n] = '\0';
        return PyLong_FromString(buffer, NULL, 10);
    }
    int number = match_float(s);
    PyObject *text = number ? decode(s.p, s.n) : decode_shared(r, s.p, s.n);
    if (text == NULL) {
        return NULL;
    }
    if (!number) {
        if (r->strict && ((key && PyUnicode_GET_LENGTH(text) >= 100) ||
                          record(r, text, text, flow) < 0)) {
            Py_DECREF(text);
            return r->unusual ? unusual(r) : NULL;
        }
        return text;
    }
    if (r->strict && key) {
        Py_DECREF(text);
        return unusual(r);
    }
    PyObject *value = PyFloat_FromString(text);
    if (value != NULL && r->strict) {
        PyObject *noted = Py_BuildValue("(OOO)", value, text, flow ? Py_True : Py_False);
        if (noted == NULL || PyList_Append(r->floats, noted) < 0) {
            Py_CLEAR(value);
        }
        Py_XDECREF(noted);
    }
    Py_DECREF(text);
    return value;
}

/* _single_quoted / _double_quoted: the scalar quoted at s.p[at]; *end: the index
 * after it */
static PyObject *
quoted(Reader *r, Span s, Py_ssize_t at, Py_ssize_t *end)
{
    if (s.p[at] == '"') {
        for (Py_ssize_t i = at + 1; i < s.n; i++) {
            if (s.p[i] == '\\') {
                return unusual(r);
            }
            if (s.p[i] == '"') {
                *end = i + 1;
                return decode_shared(r, s.p + at + 1, i - at - 1);
            }
        }
        return unusual(r);
    }
    /* single-quoted: '' stands for ' */
    Py_ssize_t i = at + 1, doubled = 0, close = -1;
    for (; i < s.n; i++) {
        if (s.p[i] == '\'') {
            if (i + 1 < s.n && s.p[i + 1] == '\'') {
                doubled++;
                i++;
                continue;
            }
            close = i;
            break;
        }
    }
    if (close < 0) {
        return unusual(r);
    }
    *end = close + 1;
    if (doubled == 0) {
        return decode_shared(r, s.p + at + 1, close - at - 1);
    }
    char *buffer = PyMem_Malloc((size_t)(close - at));
    if (buffer == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t n = 0;
    for (i = at + 1; i < close; i++) {
        buffer[n++] = s.p[i];
        if (s.p[i] == '\'') {
            i++;
        }
    }
    PyObject *value = decode_shared(r, buffer, n);
    PyMem_Free(buffer);
    return value;
}

/* c in set, as Python's "c in set" for one character (never the terminator) */
static int
in_set(char c, const char *set)
{
    return c != '\0' && strchr(set, c) != NULL;
}

static int
is_quote(char c)
{
    return c == '\'' || c == '"';
}

/* quoted, and in strict mode its token noted (and a key of 100 characters refused) */
static PyObject *
quoted_scalar(Reader *r, Span s, Py_ssize_t at, Py_ssize_t *end, int flow, int key)
{
    PyObject *value = quoted(r, s, at, end);
    if (value == NULL || !r->strict) {
        return value;
    }
    if (key && PyUnicode_GET_LENGTH(value) >= 100) {
        Py_DECREF(value);
        return unusual(r);
    }
    PyObject *token = decode(s.p + at, *end - at);
    if (token == NULL || record(r, value, token, flow) < 0) {
        Py_XDECREF(token);
        Py_DECREF(value);
        return r->unusual ? unusual(r) : NULL;
    }
    Py_DECREF(token);
    return value;
}

/* _block_scalar: a scalar filling s */
static PyObject *
block_scalar(Reader *r, Span s)
{
    if (is_quote(s.p[0])) {
        Py_ssize_t end;
        PyObject *value = quoted_scalar(r, s, 0, &end, 0, 0);
        if (value != NULL && end != s.n) {
            Py_DECREF(value);
            return unusual(r);
        }
        return value;
    }
    if (in_set(s.p[0], "[{&*!|>%@`#")) {
        return unusual(r);
    }
    return plain(r, s, 0, 0);
}

/* ------------------------------------------------------------------ flow */

typedef struct {
    Span s;
    Py_ssize_t at;
    long level;
    int seqs; /* flow sequences open around the position */
} Flow;

static PyObject *flow_seq(Reader *r, Flow *f);

/* _Flow.item */
static PyObject *
flow_item(Reader *r, Flow *f, char closer)
{
    Span s = f->s;
    Py_ssize_t at = f->at;
    if (at >= s.n) {
        return unusual(r);
    }
    char c = s.p[at];
    if (is_quote(c)) {
        return quoted_scalar(r, s, at, &f->at, 1, 0);
    }
    if (c == '[') {
        if (r->strict && f->seqs >= 2) {
            /* the writer's flow sequences hold scalars, or sequences of scalars */
            return unusual(r);
        }
        f->level++;
        f->seqs++;
        PyObject *seq = flow_seq(r, f);
        f->seqs--;
        f->level--;
        return seq;
    }
    if (in_set(c, "{&*!|>%@`#")) {
        return unusual(r);
    }
    Py_ssize_t end = at;
    while (end < s.n && s.p[end] != ',' && s.p[end] != closer) {
        end++;
    }
    f->at = end;
    return plain(r, (Span){s.p + at, end - at}, 1, 0);
}

/* _Flow._next: 1 at closer (consumed), 0 after ", ", -1 unusual */
static int
flow_next(Reader *r, Flow *f, char closer)
{
    if (f->at < f->s.n && f->s.p[f->at] == closer) {
        f->at++;
        return 1;
    }
    if (starts_with(f->s, f->at, ", ")) {
        f->at += 2;
        return 0;
    }
    r->unusual = 1;
    return -1;
}

static PyObject *
flow_seq(Reader *r, Flow *f)
{
    PyObject *seq = new_container(r, r->seq_type, 1, f->level);
    if (seq == NULL) {
        return NULL;
    }
    f->at++; /* [ */
    if (f->at < f->s.n && f->s.p[f->at] == ']') {
        f->at++;
        return seq;
    }
    for (;;) {
        PyObject *item = flow_item(r, f, ']');
        if (item == NULL || PyList_Append(seq, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(seq);
            return NULL;
        }
        Py_DECREF(item);
        int next = flow_next(r, f, ']');
        if (next < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (next) {
            return seq;
        }
    }
}

static PyObject *
flow_map(Reader *r, Flow *f)
{
    PyObject *mapping = new_container(r, r->map_type, 1, f->level);
    if (mapping == NULL) {
        return NULL;
    }
    Span s = f->s;
    f->at++; /* { */
    if (f->at < s.n && s.p[f->at] == '}') {
        f->at++;
        return mapping;
    }
    for (;;) {
        Py_ssize_t at = f->at;
        PyObject *key;
        if (at < s.n && is_quote(s.p[at])) {
            key = quoted_scalar(r, s, at, &at, 1, 1);
        }
        else {
            Py_ssize_t end = find2(s, at, ':', ' ');
            if (end < 0) {
                Py_DECREF(mapping);
                return unusual(r);
            }
            key = plain(r, (Span){s.p + at, end - at}, 1, 1);
            at = end;
        }
        if (key == NULL) {
            Py_DECREF(mapping);
            return NULL;
        }
        if (!starts_with(s, at, ": ")) {
            Py_DECREF(key);
            Py_DECREF(mapping);
            return unusual(r);
        }
        if (r->strict) { /* the writer writes each key once */
            int present = PyDict_Contains(mapping, key);
            if (present != 0) {
                Py_DECREF(key);
                Py_DECREF(mapping);
                return present < 0 ? NULL : unusual(r);
            }
        }
        f->at = at + 2;
        PyObject *value = flow_item(r, f, '}');
        if (value == NULL || put_new(r, mapping, key, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(key);
            Py_DECREF(mapping);
            return NULL;
        }
        Py_DECREF(value);
        Py_DECREF(key);
        int next = flow_next(r, f, '}');
        if (next < 0) {
            Py_DECREF(mapping);
            return NULL;
        }
        if (next) {
            return mapping;
        }
    }
}

/* _value: a value written on its key's line */
static PyObject *
value_on_line(Reader *r, Span rest, long level)
{
    if (rest.p[0] == '[' || rest.p[0] == '{') {
        Flow f = {rest, 0, level, rest.p[0] == '[' ? 1 : 0};
        PyObject *value = rest.p[0] == '[' ? flow_seq(r, &f) : flow_map(r, &f);
        if (value != NULL && f.at != rest.n) {
            Py_DECREF(value);
            return unusual(r);
        }
        return value;
    }
    return block_scalar(r, rest);
}

/* ------------------------------------------------------------------ block */

static Span
line_at(Reader *r, Py_ssize_t index)
{
    return (Span){r->text + r->starts[index], r->ends[index] - r->starts[index]};
}

static Py_ssize_t
indent_of(Span line)
{
    Py_ssize_t i = 0;
    while (i < line.n && line.p[i] == ' ') {
        i++;
    }
    return i;
}

/* _Reader._key: the key of a "key: value" line at indent; *rest: the text after ": " */
static PyObject *
line_key(Reader *r, Span line, Py_ssize_t indent, Span *rest)
{
    PyObject *key;
    Py_ssize_t end;
    if (is_quote(line.p[indent])) {
        key = quoted_scalar(r, line, indent, &end, 0, 1);
    }
    else {
        end = find2(line, indent, ':', ' ');
        if (end < 0) {
            if (line.n == 0 || line.p[line.n - 1] != ':') {
                return unusual(r);
            }
            end = line.n - 1;
        }
        key = plain(r, (Span){line.p + indent, end - indent}, 0, 1);
    }
    if (key == NULL) {
        return NULL;
    }
    if (starts_with(line, end, ": ")) {
        if (r->strict && end + 2 == line.n) { /* "key: " and no value: the writer writes "key:" */
            Py_DECREF(key);
            return unusual(r);
        }
        *rest = (Span){line.p + end + 2, line.n - end - 2};
        return key;
    }
    if (end == line.n - 1 && line.p[end] == ':') {
        *rest = (Span){line.p + line.n, 0};
        return key;
    }
    Py_DECREF(key);
    return unusual(r);
}

static PyObject *block_map(Reader *r, Py_ssize_t indent, long level, int first);

/* the top-level sequence of block mappings, items at "  - " */
static PyObject *
block_seq(Reader *r, long level)
{
    PyObject *seq = new_container(r, r->seq_type, 0, level);
    if (seq == NULL) {
        return NULL;
    }
    while (r->at < r->lines && starts_with(line_at(r, r->at), 0, "  - ")) {
        PyObject *item = block_map(r, 4, level + 1, 1);
        if (item == NULL || PyList_Append(seq, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(seq);
            return NULL;
        }
        Py_DECREF(item);
    }
    return seq;
}

/* _Reader._after_key: the value after a key at indent, at level */
static PyObject *
after_key(Reader *r, Span rest, Py_ssize_t indent, long level)
{
    if (rest.n) {
        return value_on_line(r, rest, level);
    }
    if (r->at >= r->lines) {
        Py_RETURN_NONE;
    }
    Span line = line_at(r, r->at);
    Py_ssize_t below = indent_of(line);
    if (indent == 0 && starts_with(line, 0, "  - ")) {
        return block_seq(r, level);
    }
    if (below > indent) {
        if (below != indent + 2) {
            return unusual(r);
        }
        return block_map(r, indent + 2, level, 0);
    }
    Py_RETURN_NONE;
}

/* _Reader.block_map; first: the first line is an item's "  - " line, read as if its
 * "-" were a space (the reference's "    " + line[4:]) */
static PyObject *
block_map(Reader *r, Py_ssize_t indent, long level, int first)
{
    /* an item of entries stays unmarked (the reference's comment says why) */
    PyObject *mapping = new_container(r, r->map_type, first ? -1 : 0, level);
    if (mapping == NULL) {
        return NULL;
    }
    while (r->at < r->lines) {
        Span line = line_at(r, r->at);
        if (line.n <= indent) {
            break;
        }
        if (!first) {
            for (Py_ssize_t i = 0; i < indent; i++) {
                if (line.p[i] != ' ') {
                    goto done;
                }
            }
        }
        first = 0;
        char c = line.p[indent];
        if (c == ' ' || c == '-' || c == '#') {
            break;
        }
        Span rest;
        PyObject *key = line_key(r, line, indent, &rest);
        if (key == NULL) {
            Py_DECREF(mapping);
            return NULL;
        }
        int present = PyDict_Contains(mapping, key);
        if (present != 0) {
            Py_DECREF(key);
            Py_DECREF(mapping);
            return present < 0 ? NULL : unusual(r); /* a duplicate key: ruamel decides */
        }
        r->at++;
        PyObject *value = after_key(r, rest, indent, level + 1);
        if (value == NULL || put_new(r, mapping, key, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(key);
            Py_DECREF(mapping);
            return NULL;
        }
        Py_DECREF(value);
        Py_DECREF(key);
    }
done:
    if (PyDict_GET_SIZE(mapping) == 0) {
        Py_DECREF(mapping);
        return unusual(r);
    }
    return mapping;
}

/* ------------------------------------------------------------------ module */

static PyObject *
read_config(PyObject *const *args, Py_ssize_t nargs, int strict)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "read_fast/read_strict(text, map_type, seq_type, format_type, "
                        "max_level, max_int_chars) takes 6 arguments");
        return NULL;
    }
    if (!PyUnicode_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "read_fast: text must be a str");
        return NULL;
    }
    Reader r = {0};
    r.map_type = args[1];
    r.seq_type = args[2];
    r.format_type = args[3];
    r.max_level = PyLong_AsLong(args[4]);
    if (r.max_level == -1 && PyErr_Occurred()) {
        return NULL;
    }
    r.max_int_chars = PyLong_AsSsize_t(args[5]);
    if (r.max_int_chars == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (r.max_int_chars > 120) { /* plain()'s buffer */
        PyErr_SetString(PyExc_ValueError, "read_fast: max_int_chars above 120");
        return NULL;
    }
    r.strict = strict;
    Py_ssize_t size;
    const char *text = PyUnicode_AsUTF8AndSize(args[0], &size);
    if (text == NULL) {
        return NULL; /* lone surrogates: UnicodeEncodeError, the caller reads in Python */
    }
    if (size == 0 || text[size - 1] != '\n') {
        Py_RETURN_NONE;
    }
    r.text = text;
    Py_ssize_t lines = 0;
    for (const char *p = text; (p = memchr(p, '\n', (size_t)(text + size - p))) != NULL; p++) {
        lines++;
    }
    r.starts = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)lines);
    r.ends = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)lines);
    PyObject *config = NULL;
    if (r.starts == NULL || r.ends == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    Py_ssize_t start = 0;
    for (Py_ssize_t i = 0; i < lines; i++) {
        const char *newline = memchr(text + start, '\n', (size_t)(size - start));
        r.starts[i] = start;
        r.ends[i] = newline - text;
        start = r.ends[i] + 1;
    }
    r.lines = lines;
    r.format_attrib = PyObject_GetAttrString(r.format_type, "attrib");
    r.ok_name = PyUnicode_InternFromString("_ok");
    r.flow_name = PyUnicode_InternFromString("_flow_style");
    if (r.format_attrib == NULL || r.ok_name == NULL || r.flow_name == NULL) {
        goto out;
    }
    r.shared = PyDict_New();
    if (r.shared == NULL) {
        goto out;
    }
    if (r.strict) {
        r.strings[0] = PyDict_New();
        r.strings[1] = PyDict_New();
        r.floats = PyList_New(0);
        if (r.strings[0] == NULL || r.strings[1] == NULL || r.floats == NULL) {
            goto out;
        }
    }
    config = block_map(&r, 0, 1, 0);
    if (config != NULL && r.at != r.lines) {
        Py_CLEAR(config);
        r.unusual = 1;
    }
    if (config == NULL && PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear(); /* as the reference: a value int() or float() refuses */
    }
    if (config != NULL && r.strict) {
        Py_SETREF(config, PyTuple_Pack(4, config, r.strings[0], r.strings[1], r.floats));
    }
out:
    Py_XDECREF(r.shared);
    Py_XDECREF(r.strings[0]);
    Py_XDECREF(r.strings[1]);
    Py_XDECREF(r.floats);
    PyMem_Free(r.starts);
    PyMem_Free(r.ends);
    Py_XDECREF(r.format_attrib);
    Py_XDECREF(r.ok_name);
    Py_XDECREF(r.flow_name);
    if (config == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return config;
}

static PyObject *
read_fast(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return read_config(args, nargs, 0);
}

static PyObject *
read_strict(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return read_config(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"read_fast", (PyCFunction)(void (*)(void))read_fast, METH_FASTCALL,
     "read_fast(text, map_type, seq_type, format_type, max_level, max_int_chars, /)\n--\n\n"
     "The config text read as config_reader.py_read_fast reads it, or None."},
    {"read_strict", (PyCFunction)(void (*)(void))read_strict, METH_FASTCALL,
     "read_strict(text, map_type, seq_type, format_type, max_level, max_int_chars, /)\n--\n\n"
     "read_fast, also None where the fast writer would not write the result back (see\n"
     "config_reader.read_strict), else (config, block strings, flow strings, floats):\n"
     "each string read mapped to its token, each float with its token and context."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_config_reader",
    "The fast config reader in C (opguard_core.formats.config_reader is its reference).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__config_reader(void)
{
    return PyModule_Create(&module);
}
