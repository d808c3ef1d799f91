//! Python's lists as templates made for transformers' Jinja2 use them: a list kept in a `namespace` can be changed in
//! place (`ns.ids.append(x)`, `ns.ids.pop(0)`), as Kimi K2's templates queue their tool calls' ids. minijinja's lists
//! cannot be changed, so `namespace` keeps each list it is given as one of these.

use std::sync::{Arc, Mutex};

use minijinja::value::{Enumerator, Object, ObjectRepr, Value, ValueKind, from_args};
use minijinja::{Error, ErrorKind, State};

/// A list that Python's methods change in place.
#[derive(Debug, Default)]
struct PyList(Mutex<Vec<Value>>);

impl PyList {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        // A template that panicked mid-change cannot have left the list half-changed: each change is one call.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Object for PyList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.items();
        let at = index(key.as_i64()?, items.len())?;
        items.get(at).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.items().clone())
    }

    fn call_method(self: &Arc<Self>, _: &State<'_, '_>, method: &str, args: &[Value]) -> Result<Value, Error> {
        let mut items = self.items();
        match method {
            "append" => {
                let (item,): (Value,) = from_args(args)?;
                items.push(item);
                Ok(Value::from(()))
            }
            "extend" => {
                let (more,): (Value,) = from_args(args)?;
                items.extend(more.try_iter()?);
                Ok(Value::from(()))
            }
            "insert" => {
                let (at, item): (i64, Value) = from_args(args)?;
                // Python clamps an insertion point outside the list to its ends.
                let len = items.len() as i64;
                let at = if at < 0 { (len + at).max(0) } else { at.min(len) };
                items.insert(at as usize, item);
                Ok(Value::from(()))
            }
            "pop" => {
                let (at,): (Option<i64>,) = from_args(args)?;
                let len = items.len();
                match index(at.unwrap_or(-1), len) {
                    Some(at) => Ok(items.remove(at)),
                    None => {
                        Err(Error::new(ErrorKind::InvalidOperation, "pop from an empty list, or index out of range"))
                    }
                }
            }
            "clear" => {
                from_args::<()>(args)?;
                items.clear();
                Ok(Value::from(()))
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        }
    }
}

/// Python's index `at` (negative from the end) into a list of `len`, when it is inside it.
fn index(at: i64, len: usize) -> Option<usize> {
    let at = if at < 0 { at.checked_add(len as i64)? } else { at };
    usize::try_from(at).ok().filter(|&at| at < len)
}

/// Jinja's `namespace`, whose lists Python's methods change in place: minijinja's own, given each list among
/// `defaults` (its keyword arguments, or a map) as a [`PyList`].
pub fn namespace(defaults: Option<Value>) -> Result<Value, Error> {
    let defaults = match defaults {
        Some(map) if map.kind() == ValueKind::Map => {
            let pairs = map.try_iter()?.map(|key| {
                let value = map.get_item(&key).unwrap_or_default();
                let value = match value.kind() {
                    ValueKind::Seq => Value::from_object(PyList(Mutex::new(value.try_iter()?.collect()))),
                    _ => value,
                };
                Ok::<_, Error>((key, value))
            });
            Some(Value::from_iter(pairs.collect::<Result<Vec<_>, _>>()?))
        }
        other => other,
    };
    minijinja::functions::namespace(defaults)
}
