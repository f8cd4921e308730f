//! What registered memory may hold, and how a refusal names the user's
//! object.
//!
//! A peer's write lands as raw bytes, and a source is read as raw bytes: that
//! is only sound for memory whose items *are* plain bytes. An array of
//! Python objects (numpy `dtype=object`, a structured dtype with an object
//! field, a buffer whose format has `O`) holds `PyObject*` pointers: a
//! remote write would corrupt them (the receiver crashes on its next use of
//! the array) and a read would send addresses. C pointers (`P`, `&`, ctypes
//! `z`/`Z` strings, DLPack opaque handles) are refused for the same reason.
//! Item codes this module does not know are refused too, rather than
//! guessed about.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use crate::errors;

/// The kind of the refusal of pointer-bearing (or unknown) items.
pub(crate) const UNSUPPORTED_DTYPE: &str = "unsupported_dtype";
/// The kind of the refusal of non-contiguous memory.
pub(crate) const NOT_CONTIGUOUS: &str = "not_contiguous";

/// Plain item codes of the struct module / PEP 3118 (numbers, booleans,
/// characters, byte and UCS strings, padding).
const PLAIN: &[u8] = b"xcbB?hHiIlLqQnNefdgspuw";

/// Why a buffer format (`Py_buffer.format`) is refused, or `None` when every
/// item is plain bytes. Field names (`:name:`), shapes (`(2,3)`), counts,
/// byte-order marks and nested structs (`T{...}`) are understood.
pub(crate) fn format_refusal(fmt: &str) -> Option<String> {
    let b = fmt.as_bytes();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b'@' | b'=' | b'<' | b'>' | b'!' | b'^' | b'}' | b'0'..=b'9' => i += 1,
            c if c.is_ascii_whitespace() => i += 1,
            b'(' | b':' => {
                let close = if c == b'(' { b')' } else { b':' };
                match b[i + 1..].iter().position(|&x| x == close) {
                    Some(n) => i += n + 2,
                    None => return Some(format!("its buffer format {fmt:?} is malformed")),
                }
            }
            b'T' if b.get(i + 1) == Some(&b'{') => i += 2,
            // `Zf`/`Zd`/...: complex numbers; a lone `Z` is ctypes' wchar_t*.
            b'Z' if matches!(b.get(i + 1), Some(b'e' | b'f' | b'd' | b'g')) => i += 2,
            b'O' => {
                return Some(format!(
                    "its items are Python object pointers (buffer format {fmt:?})"
                ))
            }
            b'P' | b'&' | b'z' | b'Z' | b'X' => {
                return Some(format!("its items hold C pointers (buffer format {fmt:?})"))
            }
            c if PLAIN.contains(&c) => i += 1,
            c => {
                return Some(format!(
                    "its buffer format {fmt:?} has item code {:?}, which may hold pointers",
                    char::from(c)
                ))
            }
        }
    }
    None
}

/// Refuses items that are not plain bytes (see the module docs).
pub(crate) fn refuse_format(py: Python<'_>, what: &str, why: &str) -> PyErr {
    errors::refused(
        py,
        UNSUPPORTED_DTYPE,
        format!(
            "cannot register the {what}: {why}; only memory of plain items (numbers, bytes, \
             structs of them) can be registered, as peers write and read it as raw bytes \
             (pointers would be overwritten or sent)"
        ),
    )
}

/// Refuses `obj` before any memory is looked at when what it says of its
/// items (a numpy-like `dtype.hasobject`, or the typestr/descr of
/// `__array_interface__` / `__cuda_array_interface__`) shows Python
/// objects. Attributes that are missing or fail to compute say nothing.
pub(crate) fn check_declared(obj: &Bound<'_, PyAny>) -> PyResult<()> {
    let py = obj.py();
    let what = describe(obj);
    if let Ok(dtype) = obj.getattr("dtype") {
        let has = dtype
            .getattr("hasobject")
            .and_then(|h| h.is_truthy())
            .unwrap_or(false);
        if has {
            let name = dtype.str().map(|s| s.to_string()).unwrap_or_default();
            let why = format!("its items are Python object pointers (dtype {name})");
            return Err(refuse_format(py, &what, &why));
        }
    }
    for attr in ["__array_interface__", "__cuda_array_interface__"] {
        let Ok(iface) = obj.getattr(attr) else {
            continue;
        };
        let declares_objects = ["typestr", "descr"]
            .iter()
            .any(|k| iface.get_item(k).is_ok_and(|v| has_object_typestr(&v, 0)));
        if declares_objects {
            let why = format!("its {attr} declares Python object items (typestr 'O')");
            return Err(refuse_format(py, &what, &why));
        }
    }
    Ok(())
}

/// Whether a typestr (`"|O"`), or a descr list of `(name, typestr or
/// descr[, shape])` entries, has an object item. Nesting is bounded.
fn has_object_typestr(v: &Bound<'_, PyAny>, depth: usize) -> bool {
    if depth > 32 {
        return false;
    }
    if v.is_instance_of::<PyString>() {
        return v
            .extract::<String>()
            .is_ok_and(|s| s.as_bytes().get(1) == Some(&b'O'));
    }
    let entries: Vec<Bound<'_, PyAny>> = if let Ok(l) = v.cast::<PyList>() {
        l.iter().collect()
    } else if let Ok(t) = v.cast::<PyTuple>() {
        t.iter().collect()
    } else {
        return false;
    };
    entries.iter().any(|e| {
        e.cast::<PyTuple>()
            .ok()
            .and_then(|t| t.get_item(1).ok())
            .is_some_and(|x| has_object_typestr(&x, depth + 1))
    })
}

/// How errors name `obj`: `"numpy array"` for a numpy ndarray, `"raw
/// region"` for a `(ptr, nbytes, device)` tuple, else its type's name
/// (`"memoryview"`, `"Tensor"`, ...).
pub(crate) fn describe(obj: &Bound<'_, PyAny>) -> String {
    if obj.is_instance_of::<PyTuple>() {
        return "raw region".into();
    }
    let ty = obj.get_type();
    let name = ty
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into());
    let module = ty.module().map(|m| m.to_string()).unwrap_or_default();
    if name == "ndarray" && module == "numpy" {
        "numpy array".into()
    } else {
        name
    }
}

/// How a non-contiguous object is made contiguous.
pub(crate) enum Remedy {
    /// A torch-like tensor: `.contiguous()`.
    Tensor,
    /// Anything else: a copy (`np.ascontiguousarray` for numpy).
    Copy,
}

/// `InvalidArgumentError` (kind `not_contiguous`) for the user's object
/// (`what`, see [`describe`]), with its shape and byte strides when known,
/// and the way out.
pub(crate) fn not_contiguous(
    py: Python<'_>,
    what: &str,
    layout: Option<(&[i64], &[i64])>,
    remedy: Remedy,
) -> PyErr {
    let layout = layout
        .map(|(shape, strides)| {
            format!(
                " (shape {}, byte strides {})",
                py_tuple(shape),
                py_tuple(strides)
            )
        })
        .unwrap_or_default();
    let hint = match remedy {
        Remedy::Tensor => "call .contiguous() first",
        Remedy::Copy if what == "numpy array" => "pass np.ascontiguousarray(x)",
        Remedy::Copy => "pass a C-contiguous copy",
    };
    errors::refused(
        py,
        NOT_CONTIGUOUS,
        format!("the {what} is not C-contiguous{layout}: {hint}"),
    )
}

/// `(16, 8)`, `(8,)`, `()`: as Python prints a tuple.
fn py_tuple(v: &[i64]) -> String {
    match v {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            v.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}
