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

/// Longest status, header or chunk-size line accepted (etcd's are far
/// shorter): a server that never ends a line cannot grow memory.
const MAX_LINE: usize = 8 * 1024;
/// Most header lines accepted in one response.
const MAX_HEADER_LINES: usize = 128;

/// Appends one line of at most [`MAX_LINE`] bytes to `line`; the bytes
/// read, 0 at the end of the stream.
fn read_line_bounded<R: BufRead>(r: &mut R, line: &mut String) -> io::Result<usize> {
    let n = r.by_ref().take(MAX_LINE as u64).read_line(line)?;
    if n == MAX_LINE && !line.ends_with('\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("an HTTP line longer than {MAX_LINE} bytes"),
        ));
    }
    Ok(n)
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
            let mut blank = 0;
            while line.trim().is_empty() {
                blank += 1;
                if blank > 2 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "blank lines instead of a chunk size",
                    ));
                }
                line.clear();
                if read_line_bounded(&mut self.inner, &mut line)? == 0 {
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
    read_line_bounded(&mut r, &mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::Bad(format!("status line {:?}", line.trim())))?;
    let mut length = None;
    let mut chunked = false;
    let mut headers = 0;
    loop {
        line.clear();
        headers += 1;
        if headers > MAX_HEADER_LINES {
            return Err(HttpError::Bad(format!(
                "more than {MAX_HEADER_LINES} header lines"
            )));
        }
        if read_line_bounded(&mut r, &mut line)? == 0 {
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

    /// Serves one connection: reads the request, answers `response`.
    fn serve_once(response: Vec<u8>) -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let host = l.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf);
                let _ = s.write_all(&response);
            }
        });
        host
    }

    fn ask(host: &str) -> Result<Vec<u8>, HttpError> {
        let t = Duration::from_secs(10);
        let (mut body, _) = post(host, "/v3/kv/range", b"{}", t, Some(t))?;
        let mut out = Vec::new();
        body.read_to_end(&mut out)?;
        Ok(out)
    }

    /// A response whose lines never end, or that never ends its headers,
    /// or whose chunked body sends blank lines for ever, is refused after
    /// a bounded read; a well-formed one (length and chunked) is read.
    #[test]
    fn responses_are_read_within_bounds() {
        let mut endless = b"HTTP/1.1 200 OK\r\nX-A: ".to_vec();
        endless.extend(std::iter::repeat_n(b'a', 1 << 20));
        let e = ask(&serve_once(endless)).unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..1000 {
            many.extend(format!("X-{i}: x\r\n").bytes());
        }
        many.extend(b"\r\n");
        let e = ask(&serve_once(many)).unwrap_err();
        assert!(e.to_string().contains("header lines"), "{e}");
        let mut blanks =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n".to_vec();
        blanks.extend(std::iter::repeat_n(b"\r\n".as_slice(), 1000).flatten());
        let e = ask(&serve_once(blanks)).unwrap_err();
        assert!(e.to_string().contains("blank lines"), "{e}");
        let good = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec();
        assert_eq!(ask(&serve_once(good)).unwrap(), b"ok");
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n1\r\n!\r\n0\r\n\r\n"
                .to_vec();
        assert_eq!(ask(&serve_once(chunked)).unwrap(), b"ok!");
    }
}
