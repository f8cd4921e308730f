//! Message framing: length-prefixed postcard frames over a stream (the
//! domain proxy's Unix socket), and postcard in hex as one line of text (the
//! engine peers' lines, carried by `weft_testkit::child`).

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// Writes `v` as one frame (u32 little-endian length, then postcard).
pub(crate) fn send_frame<T: Serialize>(s: &mut impl Write, v: &T) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(v).map_err(|e| std::io::Error::other(e.to_string()))?;
    let len = u32::try_from(bytes.len()).map_err(|_| std::io::Error::other("frame too long"))?;
    s.write_all(&len.to_le_bytes())?;
    s.write_all(&bytes)?;
    s.flush()
}

/// Reads one frame written by [`send_frame`].
pub(crate) fn recv_frame<T: for<'de> Deserialize<'de>>(s: &mut impl Read) -> std::io::Result<T> {
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

/// `v` as postcard in hex: one line of text, no newline.
pub(crate) fn to_line<T: Serialize>(v: &T) -> Result<String, String> {
    let bytes = postcard::to_allocvec(v).map_err(|e| e.to_string())?;
    let mut s = String::with_capacity(2 * bytes.len());
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    Ok(s)
}

/// Decodes a line written by [`to_line`].
pub(crate) fn from_line<T: for<'de> Deserialize<'de>>(line: &str) -> Result<T, String> {
    let hex = line.trim_end();
    if !hex.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .ok_or_else(|| "not hex".to_string())
                .and_then(|d| u8::from_str_radix(d, 16).map_err(|e| e.to_string()))
        })
        .collect::<Result<Vec<u8>, String>>()?;
    postcard::from_bytes(&bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_lines_round_trip() {
        let v: (u32, String, Vec<u8>) = (7, "x".into(), vec![1, 2, 3]);
        let mut buf = Vec::new();
        send_frame(&mut buf, &v).expect("encode");
        let back: (u32, String, Vec<u8>) = recv_frame(&mut buf.as_slice()).expect("decode");
        assert_eq!(back, v);
        let line = to_line(&v).expect("encode line");
        let back: (u32, String, Vec<u8>) = from_line(&format!("{line}\n")).expect("decode line");
        assert_eq!(back, v);
        assert!(from_line::<u32>("other output").is_err());
        assert!(from_line::<u32>("é1").is_err());
    }
}
