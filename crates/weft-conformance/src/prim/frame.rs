//! Message framing: length-prefixed postcard frames over a stream, and
//! postcard-in-hex lines with a prefix (for stdout, which libtest shares).

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// Writes `v` as one frame (u32 little-endian length, then postcard).
pub fn send_frame<T: Serialize>(s: &mut impl Write, v: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(v).map_err(|e| std::io::Error::other(e.to_string()))?;
    let len = u32::try_from(bytes.len()).map_err(|_| std::io::Error::other("frame too long"))?;
    s.write_all(&len.to_le_bytes())?;
    s.write_all(&bytes)?;
    s.flush()
}

/// Reads one frame written by [`send_frame`].
pub fn recv_frame<T: for<'de> Deserialize<'de>>(s: &mut impl Read) -> std::io::Result<T> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 1 << 30 {
        return Err(std::io::Error::other("frame too long"));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    postcard::from_bytes(&buf).map_err(|e| std::io::Error::other(e.to_string()))
}

/// `prefix` followed by `v` as postcard in hex (no newline).
pub fn to_line<T: Serialize>(prefix: &str, v: &T) -> Result<String, String> {
    let bytes = postcard::to_allocvec(v).map_err(|e| e.to_string())?;
    let mut s = String::with_capacity(prefix.len() + 2 * bytes.len());
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    Ok(s)
}

/// Decodes a line written by [`to_line`]; `None` when the line does not
/// contain `prefix` (other output). Text before the prefix is ignored
/// (libtest may have printed `test x ... ` without a newline just before).
pub fn from_line<T: for<'de> Deserialize<'de>>(
    prefix: &str,
    line: &str,
) -> Option<Result<T, String>> {
    let at = line.find(prefix)?;
    let hex = line[at + prefix.len()..].trim_end();
    let decode = || -> Result<T, String> {
        if !hex.len().is_multiple_of(2) {
            return Err("odd hex length".into());
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).map_err(|e| e.to_string()))
            .collect::<Result<Vec<u8>, String>>()?;
        postcard::from_bytes(&bytes).map_err(|e| e.to_string())
    };
    Some(decode())
}
