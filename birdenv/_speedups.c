/* The observation formatter's table, in C: every step of every episode formats its result here
 * and parses its tool call (below). A result's bytes are counted in the replica layer's own
 * extension (birdenv/replicas/native/sizes.c).
 *
 * birdenv.tools holds the rule (_cell and _table) and uses these functions when they are built;
 * tests/test_tools.py checks that both give the same text for any value SQLite can return and for
 * others. What a cell shows, by the value's type (exact types first, as the rule orders them):
 *   str   the text, with newlines shown as \n and bars as \|
 *   int   str(value)
 *   None  NULL
 *   bytes <blob N bytes>
 *   float format(value, ".10g")
 *   other str(value), escaped like text
 * and a text longer than MAX_CELL_CHARS is cut to MAX_CELL_CHARS - 3 characters plus "...".
 *
 * The tool-call parser, every step's first work: parse_tool_call is the rule of
 * birdenv.tools._parse_tool_call (find the one <tool_call> block, decode its JSON as json.loads
 * does, check the call), with the same ToolCall results and the same ToolCallError messages.
 * birdenv.tools hands it the types and json's scanner once (configure).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static Py_ssize_t max_cell_chars = -1; /* birdenv.tools.MAX_CELL_CHARS, given by configure */
static PyObject *s_null, *s_newline, *s_esc_newline, *s_bar, *s_esc_bar, *s_ellipsis, *s_g10,
    *s_sep, *s_open, *s_close, *s_eol, *s_empty;

/* text with newlines and bars escaped (a new reference) */
static PyObject *escape(PyObject *text)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_FindChar(text, '\n', 0, n, 1) == -1 && PyUnicode_FindChar(text, '|', 0, n, 1) == -1) {
        Py_INCREF(text);
        return text;
    }
    PyObject *step = PyUnicode_Replace(text, s_newline, s_esc_newline, -1);
    if (step == NULL)
        return NULL;
    PyObject *done = PyUnicode_Replace(step, s_bar, s_esc_bar, -1);
    Py_DECREF(step);
    return done;
}

/* text cut to max_cell_chars (steals the reference to text) */
static PyObject *cut(PyObject *text)
{
    if (text == NULL || PyUnicode_GET_LENGTH(text) <= max_cell_chars)
        return text;
    PyObject *head = PyUnicode_Substring(text, 0, max_cell_chars - 3);
    Py_DECREF(text);
    if (head == NULL)
        return NULL;
    PyObject *done = PyUnicode_Concat(head, s_ellipsis);
    Py_DECREF(head);
    return done;
}

static PyObject *cell_of(PyObject *value)
{
    if (PyUnicode_CheckExact(value))
        return cut(escape(value));
    if (PyLong_CheckExact(value))
        return cut(PyObject_Str(value));
    if (value == Py_None) {
        Py_INCREF(s_null);
        return s_null;
    }
    if (PyBytes_Check(value))
        return PyUnicode_FromFormat("<blob %zd bytes>", PyBytes_GET_SIZE(value));
    if (PyFloat_Check(value))
        return PyObject_Format(value, s_g10);
    PyObject *text = PyObject_Str(value);
    if (text == NULL)
        return NULL;
    PyObject *escaped = escape(text);
    Py_DECREF(text);
    return cut(escaped);
}

/* Append "| a | b |" for one row (any iterable of values) to pieces, to be joined by "".
 * Rows are taken as tuples, so that a value's __str__ cannot change what is being walked. */
static int add_line(PyObject *pieces, PyObject *row)
{
    PyObject *seq = PySequence_Tuple(row);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    if (PyList_Append(pieces, s_open) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = cell_of(PyTuple_GET_ITEM(seq, i));
        if (c == NULL)
            goto fail;
        int bad = (i > 0 && PyList_Append(pieces, s_sep) < 0) || PyList_Append(pieces, c) < 0;
        Py_DECREF(c);
        if (bad)
            goto fail;
    }
    Py_DECREF(seq);
    return PyList_Append(pieces, s_close);
fail:
    Py_DECREF(seq);
    return -1;
}

static PyObject *table(PyObject *module, PyObject *args)
{
    PyObject *columns, *rows;
    if (!PyArg_ParseTuple(args, "OO:table", &columns, &rows))
        return NULL;
    if (max_cell_chars < 0) {
        PyErr_SetString(PyExc_RuntimeError, "birdenv._speedups.configure was not called");
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(rows);
    if (seq == NULL)
        return NULL;
    PyObject *pieces = PyList_New(0);
    PyObject *text = NULL;
    if (pieces == NULL || add_line(pieces, columns) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); i++) {
        if (PyList_Append(pieces, s_eol) < 0 || add_line(pieces, PyTuple_GET_ITEM(seq, i)) < 0)
            goto done;
    }
    text = PyUnicode_Join(s_empty, pieces);
done:
    Py_XDECREF(pieces);
    Py_DECREF(seq);
    return text;
}

/* ------------------------------------------------------------------ the tool-call parser */

static PyObject *ToolCall, *ToolCallError, *scan_once, *scanstring, *JSONDecodeError;
static PyObject *s_open_tag, *s_close_tag, *s_name, *s_arguments, *s_execute_sql,
    *s_submit_solution, *s_sql, *s_sql_list, *s_expecting_value, *s_extra_data, *s_bom,
    *s_canonical_head, *s_canonical_tail;

static PyObject *configure(PyObject *module, PyObject *args)
{
    PyObject *a, *b, *c, *e, *d;
    Py_ssize_t cell_chars;
    if (!PyArg_ParseTuple(args, "O!OOOOn:configure", &PyType_Type, &a, &b, &c, &e, &d, &cell_chars))
        return NULL;
    if (cell_chars < 3) {
        PyErr_SetString(PyExc_ValueError, "a cell shows at least 3 characters");
        return NULL;
    }
    max_cell_chars = cell_chars;
    Py_INCREF(a);
    Py_INCREF(b);
    Py_INCREF(c);
    Py_INCREF(d);
    Py_INCREF(e);
    Py_XSETREF(ToolCall, a);
    Py_XSETREF(ToolCallError, b);
    Py_XSETREF(scan_once, c);
    Py_XSETREF(scanstring, e);
    Py_XSETREF(JSONDecodeError, d);
    Py_RETURN_NONE;
}

/* ToolCall(name, arguments), made without the dataclass's __init__, which sets the two fields
 * through object.__setattr__ (it is frozen): the object __init__ makes, a fifth of the time. */
static PyObject *make_call(PyObject *name, PyObject *arguments)
{
    PyTypeObject *type = (PyTypeObject *)ToolCall;
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL)
        return NULL;
    PyObject *call = type->tp_new(type, empty, NULL);
    Py_DECREF(empty);
    if (call != NULL && (PyObject_GenericSetAttr(call, s_name, name) < 0 ||
                         PyObject_GenericSetAttr(call, s_arguments, arguments) < 0))
        Py_CLEAR(call);
    return call;
}

/* Raise ToolCallError(message), taking the reference to message; always NULL. */
static PyObject *fail(PyObject *message)
{
    if (message != NULL) {
        PyErr_SetObject(ToolCallError, message);
        Py_DECREF(message);
    }
    return NULL;
}

static Py_ssize_t skip_ws(PyObject *text, Py_ssize_t i, Py_ssize_t n)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    while (i < n) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        i++;
    }
    return i;
}

static void json_error(PyObject *msg, PyObject *text, Py_ssize_t pos)
{
    PyObject *exc = PyObject_CallFunction(JSONDecodeError, "OOn", msg, text, pos);
    if (exc != NULL) {
        PyErr_SetObject(JSONDecodeError, exc);
        Py_DECREF(exc);
    }
}

/* func(text, at): how json's scanner and string decoder are called */
static PyObject *call_at(PyObject *func, PyObject *text, Py_ssize_t at)
{
    PyObject *start = PyLong_FromSsize_t(at);
    if (start == NULL)
        return NULL;
    PyObject *args[2] = {text, start};
    PyObject *result = PyObject_Vectorcall(func, args, 2, NULL);
    Py_DECREF(start);
    return result;
}

/* json.loads(text) for a str, with json's own errors (JSONDecodeError, RecursionError). */
static PyObject *json_value(PyObject *text)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (n > 0 && PyUnicode_READ_CHAR(text, 0) == 0xFEFF) {
        json_error(s_bom, text, 0);
        return NULL;
    }
    PyObject *result = call_at(scan_once, text, skip_ws(text, 0, n));
    if (result == NULL) {
        if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *at = value ? PyObject_GetAttrString(value, "value") : NULL;
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (at == NULL)
                return NULL;
            Py_ssize_t pos = PyLong_AsSsize_t(at);
            Py_DECREF(at);
            if (pos == -1 && PyErr_Occurred())
                return NULL;
            json_error(s_expecting_value, text, pos);
        }
        return NULL;
    }
    PyObject *value = NULL;
    Py_ssize_t end;
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2) {
        PyErr_SetString(PyExc_TypeError, "json's scanner returned something other than (value, end)");
    } else if ((end = PyLong_AsSsize_t(PyTuple_GET_ITEM(result, 1))) == -1 && PyErr_Occurred()) {
    } else if ((end = skip_ws(text, end, n)) != n) {
        json_error(s_extra_data, text, end);
    } else {
        value = PyTuple_GET_ITEM(result, 0);
        Py_INCREF(value);
    }
    Py_DECREF(result);
    return value;
}

/* The call in block when it is an execute_sql call written exactly as format_tool_call writes it
 * (what a model that learnt the format emits): its SQL decoded by json's own scanstring, as
 * json.loads decodes it, without building and searching the two objects around it. NULL without
 * an error for any other text (a decoding error too): the general path then parses it, and words
 * its errors. */
static PyObject *canonical_call(PyObject *block)
{
    const Py_ssize_t n = PyUnicode_GET_LENGTH(block), head = PyUnicode_GET_LENGTH(s_canonical_head);
    if (n < head + 3 || PyUnicode_Tailmatch(block, s_canonical_head, 0, head, -1) != 1 ||
        PyUnicode_Tailmatch(block, s_canonical_tail, n - 2, n, 1) != 1)
        return NULL;
    PyObject *scanned = call_at(scanstring, block, head);
    if (scanned == NULL) {
        if (PyErr_ExceptionMatches(PyExc_ValueError))
            PyErr_Clear(); /* JSONDecodeError: the general path says what is wrong */
        return NULL;
    }
    PyObject *call = NULL;
    if (PyTuple_Check(scanned) && PyTuple_GET_SIZE(scanned) == 2 &&
        PyUnicode_Check(PyTuple_GET_ITEM(scanned, 0)) &&
        PyLong_AsSsize_t(PyTuple_GET_ITEM(scanned, 1)) == n - 2) {
        PyObject *arguments = PyDict_New();
        if (arguments != NULL && PyDict_SetItem(arguments, s_sql, PyTuple_GET_ITEM(scanned, 0)) == 0)
            call = make_call(s_execute_sql, arguments);
        Py_XDECREF(arguments);
    }
    Py_DECREF(scanned);
    return call;
}

static PyObject *parse_tool_call(PyObject *module, PyObject *text)
{
    if (ToolCall == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "birdenv._speedups.configure was not called");
        return NULL;
    }
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "a turn is text, not %.100s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    /* the blocks: each <tool_call> closed by the first </tool_call> after it */
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), first = -1, first_end = -1, count = 0;
    const Py_ssize_t lo = PyUnicode_GET_LENGTH(s_open_tag), lc = PyUnicode_GET_LENGTH(s_close_tag);
    Py_ssize_t start = PyUnicode_Find(text, s_open_tag, 0, n, 1);
    while (start >= 0) {
        Py_ssize_t end = PyUnicode_Find(text, s_close_tag, start + lo, n, 1);
        if (end == -2)
            return NULL;
        if (end < 0)
            break;
        if (count++ == 0) {
            first = start + lo;
            first_end = end;
        }
        start = PyUnicode_Find(text, s_open_tag, end + lc, n, 1);
    }
    if (start == -2)
        return NULL;
    if (count == 0) {
        int opened = PyUnicode_Contains(text, s_open_tag);
        if (opened < 0)
            return NULL;
        return fail(PyUnicode_FromFormat(
            "no tool call found%s; call exactly one tool per turn",
            opened ? " (found <tool_call> without </tool_call>)" : ""));
    }
    if (count > 1)
        return fail(PyUnicode_FromFormat(
            "%zd tool calls in one turn; call exactly one tool per turn", count));
    PyObject *block = PyUnicode_Substring(text, first, first_end);
    if (block == NULL)
        return NULL;
    PyObject *fast = canonical_call(block);
    if (fast != NULL || PyErr_Occurred()) {
        Py_DECREF(block);
        return fast;
    }
    PyObject *call = json_value(block);
    Py_DECREF(block);
    if (call == NULL) {
        if (PyErr_ExceptionMatches(PyExc_RecursionError)) {
            PyErr_Clear();
            return fail(PyUnicode_FromString("the tool call is not valid JSON: nested too deeply"));
        }
        if (!PyErr_ExceptionMatches(JSONDecodeError))
            return NULL;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *msg = value ? PyObject_GetAttrString(value, "msg") : NULL;
        PyObject *pos = value ? PyObject_GetAttrString(value, "pos") : NULL;
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        PyObject *message = NULL;
        if (msg != NULL && pos != NULL && PyUnicode_Check(msg)) {
            /* json's message for a control character already ends in " at" */
            PyObject *trimmed = PyObject_CallMethod(msg, "removesuffix", "s", " at");
            if (trimmed != NULL) {
                message = PyUnicode_FromFormat("the tool call is not valid JSON: %U at char %S",
                                               trimmed, pos);
                Py_DECREF(trimmed);
            }
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "a JSONDecodeError without msg and pos");
        }
        Py_XDECREF(msg);
        Py_XDECREF(pos);
        return fail(message);
    }
    PyObject *result = NULL, *name = NULL, *arguments = NULL, *key = NULL;
    int is_sql = 0;
    if (PyDict_Check(call)) {
        name = PyDict_GetItemWithError(call, s_name);
        if (name == NULL && PyErr_Occurred())
            goto done;
    }
    if (name == NULL || !PyUnicode_Check(name)) {
        name = NULL; /* borrowed, not ours to release */
        fail(PyUnicode_FromString(
            "a tool call must be a JSON object {\"name\": ..., \"arguments\": {...}}"));
        goto done;
    }
    Py_INCREF(name);
    if (PyUnicode_Compare(name, s_execute_sql) == 0) {
        is_sql = 1;
        key = s_sql;
    } else if (PyUnicode_Compare(name, s_submit_solution) == 0) {
        key = s_sql_list;
    } else {
        if (!PyErr_Occurred())
            fail(PyUnicode_FromFormat(
                "unknown tool %R; the tools are execute_sql and submit_solution", name));
        goto done;
    }
    arguments = PyDict_GetItemWithError(call, s_arguments);
    if (arguments == NULL) {
        if (PyErr_Occurred())
            goto done;
        arguments = PyDict_New();
    } else {
        Py_INCREF(arguments);
    }
    if (arguments == NULL)
        goto done;
    if (PyUnicode_Check(arguments)) { /* some models emit the arguments JSON-encoded twice */
        PyObject *decoded = json_value(arguments);
        if (decoded != NULL) {
            Py_SETREF(arguments, decoded);
        } else if (PyErr_ExceptionMatches(JSONDecodeError) ||
                   PyErr_ExceptionMatches(PyExc_RecursionError)) {
            PyErr_Clear();
        } else {
            goto done;
        }
    }
    PyObject *value = NULL;
    if (PyDict_Check(arguments) && PyDict_GET_SIZE(arguments) == 1) {
        value = PyDict_GetItemWithError(arguments, key);
        if (value == NULL && PyErr_Occurred())
            goto done;
    }
    if (value == NULL) {
        fail(PyUnicode_FromFormat("%U takes exactly one argument, %R", name, key));
        goto done;
    }
    if (is_sql && !PyUnicode_Check(value)) {
        fail(PyUnicode_FromFormat("%U: %R must be a string", name, key));
        goto done;
    }
    if (!is_sql) {
        int ok = PyList_Check(value);
        for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(value); i++)
            ok = PyUnicode_Check(PyList_GET_ITEM(value, i));
        if (!ok) {
            fail(PyUnicode_FromFormat("%U: %R must be a list of SQL strings", name, key));
            goto done;
        }
    }
    PyObject *checked = PyDict_New();
    if (checked == NULL)
        goto done;
    if (PyDict_SetItem(checked, key, value) == 0)
        result = make_call(name, checked);
    Py_DECREF(checked);
done:
    Py_XDECREF(name);
    Py_XDECREF(arguments);
    Py_DECREF(call);
    return result;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(ToolCall, ToolCallError, scan_once, scanstring, JSONDecodeError, max_cell_chars): "
     "what parse_tool_call makes and raises, json's scanner and string decoder, and the longest "
     "cell table shows."},
    {"parse_tool_call", parse_tool_call, METH_O,
     "The single tool call of a turn, as birdenv.tools' rule parses it."},
    {"table", table, METH_VARARGS,
     "table(columns, rows): the header line and one line per row, joined by newlines."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "birdenv._speedups",
    "The observation table and the tool-call parser in C (the rules are birdenv.tools')", -1,
    methods,
};

PyMODINIT_FUNC PyInit__speedups(void)
{
    s_null = PyUnicode_InternFromString("NULL");
    s_newline = PyUnicode_InternFromString("\n");
    s_esc_newline = PyUnicode_InternFromString("\\n");
    s_bar = PyUnicode_InternFromString("|");
    s_esc_bar = PyUnicode_InternFromString("\\|");
    s_ellipsis = PyUnicode_InternFromString("...");
    s_g10 = PyUnicode_InternFromString(".10g");
    s_sep = PyUnicode_InternFromString(" | ");
    s_open = PyUnicode_InternFromString("| ");
    s_close = PyUnicode_InternFromString(" |");
    s_eol = PyUnicode_InternFromString("\n");
    s_empty = PyUnicode_InternFromString("");
    s_open_tag = PyUnicode_InternFromString("<tool_call>");
    s_close_tag = PyUnicode_InternFromString("</tool_call>");
    s_name = PyUnicode_InternFromString("name");
    s_arguments = PyUnicode_InternFromString("arguments");
    s_execute_sql = PyUnicode_InternFromString("execute_sql");
    s_submit_solution = PyUnicode_InternFromString("submit_solution");
    s_sql = PyUnicode_InternFromString("sql");
    s_sql_list = PyUnicode_InternFromString("sql_list");
    s_expecting_value = PyUnicode_InternFromString("Expecting value");
    s_extra_data = PyUnicode_InternFromString("Extra data");
    s_bom = PyUnicode_InternFromString("Unexpected UTF-8 BOM (decode using utf-8-sig)");
    s_canonical_head = PyUnicode_InternFromString("{\"name\": \"execute_sql\", \"arguments\": {\"sql\": \"");
    s_canonical_tail = PyUnicode_InternFromString("}}");
    if (!s_open_tag || !s_close_tag || !s_name || !s_arguments || !s_execute_sql ||
        !s_submit_solution || !s_sql || !s_sql_list || !s_expecting_value || !s_extra_data || !s_bom ||
        !s_canonical_head || !s_canonical_tail)
        return NULL;
    if (!s_null || !s_newline || !s_esc_newline || !s_bar || !s_esc_bar || !s_ellipsis || !s_g10 ||
        !s_sep || !s_open || !s_close || !s_eol || !s_empty)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    return m;
}
