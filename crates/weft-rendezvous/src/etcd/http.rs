//! A minimal blocking HTTP/1.1 client (POST with a JSON body, responses with
//! a length, chunked or until close) and base64, for etcd's JSON gateway.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// What went wrong talking HTTP.
#[derive(Debug)]
pub(crate) enum HttpError {
    /// Connecting or moving bytes failed (the server is down or went away).
    Io(io::Error),
    /// The server answered with an error status; its body.
    Status(u16, String),
    /// The response is not HTTP we understand.
    Bad(String),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Io(e) => write!(f, "{e}"),
            HttpError::Status(s, body) => write!(f, "HTTP {s}: {}", body.trim()),
            HttpError::Bad(why) => write!(f, "malformed HTTP response: {why}"),
        }
    }
}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> Self {
        HttpError::Io(e)
    }
}

/// The body of a response, read as it arrives.
pub(crate) enum Body {
    Length(io::Take<BufReader<TcpStream>>),
    Chunked(Chunked),
    UntilClose(BufReader<TcpStream>),
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Body::Length(r) => r.read(buf),
            Body::Chunked(r) => r.read(buf),
            Body::UntilClose(r) => r.read(buf),
        }
    }
}

/// A `Transfer-Encoding: chunked` body.
pub(crate) struct Chunked {
    inner: BufReader<TcpStream>,
    left: u64,
    done: bool,
}

impl Read for Chunked {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            // The CRLF that ends the previous chunk, if any, then the size.
            while line.trim().is_empty() {
                line.clear();
                if self.inner.read_line(&mut line)? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            let size = line.trim().split(';').next().unwrap_or("");
            self.left = u64::from_str_radix(size.trim(), 16)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad chunk size"))?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = usize::try_from(self.left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Sends `POST path` with a JSON `body` to `host` (`host:port`) and returns
/// the response body (after checking for a 2xx status) and a handle on the
/// socket (to shut a streaming response down from another thread).
/// `read_timeout` bounds each read (`None`: block).
pub(crate) fn post(
    host: &str,
    path: &str,
    body: &[u8],
    connect_timeout: Duration,
    read_timeout: Option<Duration>,
) -> Result<(Body, TcpStream), HttpError> {
    let addr = host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| HttpError::Bad(format!("{host} resolves to no address")))?;
    let mut stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
    stream.set_read_timeout(read_timeout)?;
    stream.set_write_timeout(Some(connect_timeout))?;
    stream.set_nodelay(true)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()?;
    let handle = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::Bad(format!("status line {:?}", line.trim())))?;
    let mut length = None;
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            return Err(HttpError::Bad("headers cut short".into()));
        }
        let l = line.trim();
        if l.is_empty() {
            break;
        }
        if let Some((name, value)) = l.split_once(':') {
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
            if name == "content-length" {
                length = value.parse::<u64>().ok();
            } else if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
        }
    }
    let mut body = if chunked {
        Body::Chunked(Chunked {
            inner: r,
            left: 0,
            done: false,
        })
    } else if let Some(n) = length {
        Body::Length(r.take(n))
    } else {
        Body::UntilClose(r)
    };
    if !(200..300).contains(&status) {
        let mut text = String::new();
        // The error body is only for the message; a failure reading it
        // leaves the message empty.
        let _ = body.by_ref().take(64 * 1024).read_to_string(&mut text);
        return Err(HttpError::Status(status, text));
    }
    Ok((body, handle))
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding.
pub(crate) fn b64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= c.len() {
                out.push(char::from(B64[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` on a bad character.
pub(crate) fn b64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for ch in text.bytes().filter(|&b| b != b'=') {
        let v = match ch {
            b'A'..=b'Z' => ch - b'A',
            b'a'..=b'z' => ch - b'a' + 26,
            b'0'..=b'9' => ch - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_known_vectors() {
        for (plain, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(b64_encode(plain.as_bytes()), enc);
            assert_eq!(b64_decode(enc).unwrap(), plain.as_bytes());
        }
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(b64_decode(&b64_encode(&all)).unwrap(), all);
        assert!(b64_decode("a*b").is_none());
    }
}
