//! A small ZMTP 3 peer over TCP (NULL security), for the two socket roles the
//! subscriber opens: SUB (engine events) and DEALER (the engine's replay ROUTER).
//!
//! Why our own and not a ZMQ library: the frame-size limit. A ZMTP frame header
//! announces up to 2^64 bytes; the pure-Rust `zeromq` 0.7 reserves whatever it
//! announces (one 9-byte header of 1 TiB aborts the process), and libzmq's
//! `ZMQ_MAXMSGSIZE` (via the `zmq` crate) would bring a C library, a system package
//! and a blocking thread per socket, and drops the peer without telling us why.
//! Here every frame header is checked against [`Limits`] *before* anything is
//! allocated, bodies are read as their bytes arrive (a peer announcing a large
//! frame and sending nothing holds no memory), and an oversized frame is a
//! distinct error ([`ZmtpError::Oversized`]) that drops only that connection and is
//! counted by the caller.
//!
//! What is spoken (RFC 23/ZMTP 3.0, which libzmq 4.x and `zeromq` 0.7 both accept):
//! the 64-byte greeting (version 3.0, mechanism NULL), a READY command with
//! `Socket-Type`, then frames (flags: MORE, LONG, COMMAND). A SUB subscribes with
//! the 3.0 form (a message `0x01 ‖ topic`); PING commands are answered with PONG,
//! other commands ignored, ERROR ends the connection.

use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// Default largest message (all frames together): above any engine batch (an
/// event of [`crate::adapters::MAX_CHAIN_BLOCKS`] blocks of 16 tokens, a
/// million-token prompt, is ~5 MB of msgpack), and small enough that decoding one
/// (msgpack values are larger in memory than on the wire) stays well under a GiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 16 << 20;
/// Default most frames in one message (engines send 3 or 4).
pub const DEFAULT_MAX_FRAMES: usize = 16;

/// What one connection accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Bytes of one message, all frames together (so also of one frame).
    pub max_message_bytes: u64,
    pub max_frames: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_frames: DEFAULT_MAX_FRAMES,
        }
    }
}

#[derive(Debug, Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a ZMTP 3 peer: {0}")]
    Protocol(String),
    #[error("a frame of {announced} bytes (message total) is over the {limit}-byte limit")]
    Oversized { announced: u64, limit: u64 },
    #[error("a message of more than {0} frames")]
    TooManyFrames(usize),
    #[error("the handshake timed out")]
    HandshakeTimeout,
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Socket types we speak, and what each may talk to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            Self::Sub => b"SUB",
            Self::Dealer => b"DEALER",
        }
    }

    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            Self::Sub => peer == b"PUB" || peer == b"XPUB",
            Self::Dealer => peer == b"ROUTER" || peer == b"DEALER" || peer == b"REP",
        }
    }
}

/// One established ZMTP connection.
pub struct Connection<R = OwnedReadHalf, W = OwnedWriteHalf> {
    rd: BufReader<R>,
    wr: W,
    limits: Limits,
}

impl Connection {
    /// Greets `stream` as `kind` (within `timeout`) and returns the connection.
    pub async fn handshake(
        stream: TcpStream,
        kind: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        Connection::handshake_over(rd, wr, kind, limits, timeout).await
    }
}

impl<R: AsyncRead + Unpin, W: AsyncWrite + Unpin> Connection<R, W> {
    /// The handshake over any byte stream (tests use in-memory pipes).
    pub async fn handshake_over(
        rd: R,
        wr: W,
        kind: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let mut conn = Self {
            rd: BufReader::with_capacity(64 * 1024, rd),
            wr,
            limits,
        };
        tokio::time::timeout(timeout, conn.greet(kind))
            .await
            .map_err(|_| ZmtpError::HandshakeTimeout)??;
        Ok(conn)
    }

    async fn greet(&mut self, kind: SocketType) -> Result<(), ZmtpError> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3; // version 3.0
        greeting[11] = 0;
        greeting[12..16].copy_from_slice(b"NULL");
        self.wr.write_all(&greeting).await?;
        self.wr.flush().await?;

        let mut peer = [0u8; 64];
        self.rd.read_exact(&mut peer[..11]).await?;
        if peer[0] != 0xff || peer[9] & 0x01 != 0x01 {
            return Err(ZmtpError::Protocol("bad greeting signature".into()));
        }
        if peer[10] < 3 {
            return Err(ZmtpError::Protocol(format!("ZMTP version {}", peer[10])));
        }
        self.rd.read_exact(&mut peer[11..]).await?;
        let mechanism = &peer[12..32];
        if mechanism.iter().position(|&b| b == 0) != Some(4) || &mechanism[..4] != b"NULL" {
            return Err(ZmtpError::Protocol("security mechanism is not NULL".into()));
        }

        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(kind.name().len() as u32).to_be_bytes());
        ready.extend_from_slice(kind.name());
        self.write_frame(FLAG_COMMAND, &ready).await?;
        self.wr.flush().await?;

        // The peer's READY (or ERROR) is its first frame.
        let (flags, body) = self.read_frame(0).await?;
        if flags & FLAG_COMMAND == 0 {
            return Err(ZmtpError::Protocol("a message before READY".into()));
        }
        let (name, data) = command_parts(&body)?;
        match name {
            b"READY" => {
                let peer_type = property(data, b"Socket-Type")?
                    .ok_or_else(|| ZmtpError::Protocol("READY without Socket-Type".into()))?;
                if !kind.accepts(peer_type) {
                    return Err(ZmtpError::Protocol(format!(
                        "peer socket type {} cannot talk to {}",
                        String::from_utf8_lossy(peer_type),
                        String::from_utf8_lossy(kind.name())
                    )));
                }
                Ok(())
            }
            b"ERROR" => Err(ZmtpError::Protocol(format!(
                "peer refused: {}",
                String::from_utf8_lossy(data.get(1..).unwrap_or_default())
            ))),
            _ => Err(ZmtpError::Protocol("first command is not READY".into())),
        }
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            self.write_frame(more, f).await?;
        }
        self.wr.flush().await?;
        Ok(())
    }

    /// A SUB's subscription to every topic starting with `prefix`.
    pub async fn subscribe(&mut self, prefix: &[u8]) -> Result<(), ZmtpError> {
        let mut msg = Vec::with_capacity(1 + prefix.len());
        msg.push(1);
        msg.extend_from_slice(prefix);
        self.send(&[&msg]).await
    }

    /// The next message (commands in between are handled here).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::with_capacity(4);
        let mut total = 0u64;
        loop {
            let (flags, body) = self.read_frame(total).await?;
            if flags & FLAG_COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message".into()));
                }
                self.on_command(&body).await?;
                continue;
            }
            total += body.len() as u64;
            if frames.len() == self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
            }
            frames.push(body);
            if flags & FLAG_MORE == 0 {
                return Ok(frames);
            }
        }
    }

    async fn on_command(&mut self, body: &[u8]) -> Result<(), ZmtpError> {
        let (name, data) = command_parts(body)?;
        match name {
            b"PING" => {
                // PING: TTL (2 bytes) then a context echoed back in PONG.
                let context = data.get(2..).unwrap_or_default();
                let mut pong = Vec::with_capacity(5 + context.len());
                pong.push(4);
                pong.extend_from_slice(b"PONG");
                pong.extend_from_slice(context);
                self.write_frame(FLAG_COMMAND, &pong).await?;
                self.wr.flush().await?;
                Ok(())
            }
            b"ERROR" => Err(ZmtpError::Protocol("peer sent ERROR".into())),
            _ => Ok(()),
        }
    }

    /// One frame: its flags and body. `so_far` bytes of the current message were
    /// already read; the limit applies to the whole message and is checked on the
    /// header, before the body is read or anything allocated for it.
    async fn read_frame(&mut self, so_far: u64) -> Result<(u8, Bytes), ZmtpError> {
        let flags = self.rd.read_u8().await?;
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
            return Err(ZmtpError::Protocol(format!("frame flags {flags:#04x}")));
        }
        let size = if flags & FLAG_LONG != 0 {
            self.rd.read_u64().await?
        } else {
            u64::from(self.rd.read_u8().await?)
        };
        let limit = self.limits.max_message_bytes;
        let announced = so_far.saturating_add(size);
        if announced > limit {
            return Err(ZmtpError::Oversized { announced, limit });
        }
        // Bounded by the limit above; small frames in one read, large ones as
        // their bytes arrive.
        let mut body = Vec::new();
        if size <= 64 * 1024 {
            body.resize(size as usize, 0);
            self.rd.read_exact(&mut body).await?;
        } else {
            let got = (&mut self.rd).take(size).read_to_end(&mut body).await?;
            if got as u64 != size {
                return Err(ZmtpError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
        }
        Ok((flags, Bytes::from(body)))
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
        if body.len() > 255 {
            self.wr.write_u8(flags | FLAG_LONG).await?;
            self.wr.write_u64(body.len() as u64).await?;
        } else {
            self.wr.write_u8(flags).await?;
            self.wr.write_u8(body.len() as u8).await?;
        }
        self.wr.write_all(body).await?;
        Ok(())
    }
}

/// `(name, data)` of a command body.
fn command_parts(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let bad = || ZmtpError::Protocol("malformed command".into());
    let (&len, rest) = body.split_first().ok_or_else(bad)?;
    let len = usize::from(len);
    if rest.len() < len {
        return Err(bad());
    }
    Ok(rest.split_at(len))
}

/// The value of metadata property `name` in a READY command's data.
fn property<'a>(mut data: &'a [u8], name: &[u8]) -> Result<Option<&'a [u8]>, ZmtpError> {
    let bad = || ZmtpError::Protocol("malformed READY metadata".into());
    while !data.is_empty() {
        let (&nlen, rest) = data.split_first().ok_or_else(bad)?;
        let nlen = usize::from(nlen);
        if rest.len() < nlen + 4 {
            return Err(bad());
        }
        let (key, rest) = rest.split_at(nlen);
        let (vlen, rest) = rest.split_at(4);
        let vlen = u32::from_be_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
        if rest.len() < vlen {
            return Err(bad());
        }
        let (value, rest) = rest.split_at(vlen);
        if key.eq_ignore_ascii_case(name) {
            return Ok(Some(value));
        }
        data = rest;
    }
    Ok(None)
}

#[cfg(test)]
mod tests;
