/* The observation formatter's table, in C: every step of every episode formats its result here.
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static Py_ssize_t max_cell_chars = 100;
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

static PyMethodDef methods[] = {
    {"table", table, METH_VARARGS,
     "table(columns, rows): the header line and one line per row, joined by newlines."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "birdenv._speedups",
    "The observation formatter's table in C (the rule is birdenv.tools')", -1, methods,
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
    if (!s_null || !s_newline || !s_esc_newline || !s_bar || !s_esc_bar || !s_ellipsis || !s_g10 ||
        !s_sep || !s_open || !s_close || !s_eol || !s_empty)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_CELL_CHARS", max_cell_chars) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
