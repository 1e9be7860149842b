//! A request whose decision waits for its body (body mode): what the stream keeps
//! between the request headers and the end of the body.
//!
//! One buffer per stream, capped at the body router's limit (plus the one chunk
//! that crosses it); it is handed back in ≤ [`CHUNK_BYTES`] pieces after the
//! decision and dropped with them. The bytes are never altered.

use super::headers::RoutingHeaders;

/// Largest body chunk sent back to Envoy in one message (Envoy recommends at most
/// 64 KiB per streamed chunk; GIE's EPP uses 62,000 bytes for the same margin).
pub const CHUNK_BYTES: usize = 62_000;

/// The request headers and the body so far, until the decision.
#[derive(Debug)]
pub struct HeldRequest {
    pub path: String,
    pub parsed: RoutingHeaders,
    pub subset: Option<Vec<String>>,
    pub body: Vec<u8>,
    pub limit: usize,
}

/// What one more chunk means for a held request.
#[derive(Debug, PartialEq, Eq)]
pub enum Collect {
    /// Keep waiting.
    More,
    /// The body is complete (within the limit): decide on it.
    Complete,
    /// The body crossed the limit: decide without it, stream everything on.
    TooLarge,
}

impl HeldRequest {
    pub fn new(
        path: String,
        parsed: RoutingHeaders,
        subset: Option<Vec<String>>,
        content_length: Option<&str>,
        limit: usize,
    ) -> Self {
        // Sized once from the declared length when it fits (no regrowth), never
        // beyond the limit whatever the client claims.
        let hint = content_length
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0)
            .min(limit);
        Self {
            path,
            parsed,
            subset,
            body: Vec::with_capacity(hint),
            limit,
        }
    }

    /// Appends a chunk (kept even past the limit: it must still reach the upstream).
    pub fn collect(&mut self, chunk: Vec<u8>, end_of_stream: bool) -> Collect {
        if self.body.is_empty() {
            self.body = if self.body.capacity() >= chunk.len() {
                let mut b = std::mem::take(&mut self.body);
                b.extend_from_slice(&chunk);
                b
            } else {
                chunk
            };
        } else {
            self.body.extend_from_slice(&chunk);
        }
        if self.body.len() > self.limit {
            Collect::TooLarge
        } else if end_of_stream {
            Collect::Complete
        } else {
            Collect::More
        }
    }
}

/// Splits a body into chunks of at most [`CHUNK_BYTES`], in order; an empty body
/// is one empty chunk (so an end of stream can still be said).
pub fn chunks(body: Vec<u8>) -> Vec<Vec<u8>> {
    if body.len() <= CHUNK_BYTES {
        return vec![body];
    }
    body.chunks(CHUNK_BYTES).map(<[u8]>::to_vec).collect()
}

#[cfg(test)]
mod tests;
