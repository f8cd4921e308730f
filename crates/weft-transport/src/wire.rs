//! postcard encoding for everything exchanged out of band.

use crate::error::WireError;
use serde::{de::DeserializeOwned, Serialize};

/// Encodes a value with postcard.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, WireError> {
    postcard::to_allocvec(value).map_err(|e| WireError::Encode {
        what: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
}

/// Decodes untrusted bytes. Trailing bytes are rejected. Never panics.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, WireError> {
    let what = std::any::type_name::<T>();
    let (value, rest) = postcard::take_from_bytes(bytes).map_err(|e| WireError::Malformed {
        what,
        reason: e.to_string(),
    })?;
    if !rest.is_empty() {
        return Err(WireError::Malformed {
            what,
            reason: format!("{} trailing bytes", rest.len()),
        });
    }
    Ok(value)
}
