//! One routing fact on the wire: a protobuf message, one per fact, versioned.
//!
//! Decoding refuses, and names why (a bounded set, used as a metric label):
//! a message over [`MAX_MESSAGE_BYTES`], one whose version is not
//! [`VERSION`], and anything that does not parse, carries no fact, or whose ids
//! are empty or longer than [`MAX_ID_BYTES`]. A refused message never reaches
//! the ledger.
//!
//! Protobuf rather than JSON: the routing benchmark's requests publish about
//! 140 bytes each instead of 320 (field tags and varints instead of names and
//! decimal text), it is the
//! encoding the gRPC API already uses (`prost` is a dependency anyway), and an
//! older sidecar skips fields a newer one adds. The schema, field by field:
//!
//! ```text
//! Envelope { 1: uint32 v; 2: string peer; 3: uint64 epoch; 4: uint64 seq;
//!            oneof fact { 5: Routed routed; 6: uint64 prefill_ended;
//!                         7: uint64 released; 8: Empty heartbeat; 9: Empty leave } }
//! Routed   { 1: uint64 route; 2: string tenant; 3: string model;
//!            4: string hash_scheme; 5: string replica; 6: uint64 uncached_tokens;
//!            7: repeated fixed64 pending; 8: uint64 prompt_tokens;
//!            9: sint64 priority; 10: bool held }
//! ```
//!
//! Fields 8 and 9 (what the receivers' flow control charges the tenant) came
//! after the first sidecars of this version, and field 10 (the publisher held
//! the request first) after those: a message without 8 reads as 0 tokens,
//! which charges nothing, and one without 10 as not held.
//!
//! A future format keeps field 1 a varint version, so a sidecar reads it before
//! anything else and reports the message as a foreign version, not as garbage.
//! Version 1 was JSON; a JSON message is reported as a foreign version too.

use prost::Message as _;

use crate::core::load::peer_ledger::{Fact, MAX_SHARED_PENDING, Message};
use crate::core::scope::ScopeRef;

/// The format version this sidecar writes and reads.
pub const VERSION: u32 = 2;
/// The largest message accepted: a routed fact with the longest pending chain
/// (8 bytes a block) and the longest ids fits.
pub const MAX_MESSAGE_BYTES: usize = 6 * 1024;
/// The longest peer, replica, tenant, model or hash scheme id accepted (a DNS
/// name's limit).
pub const MAX_ID_BYTES: usize = 253;

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    #[error("message over its size limit")]
    Oversized,
    #[error("message of another format version")]
    ForeignVersion,
    #[error("malformed message")]
    Malformed,
}

impl Refusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Oversized => "oversized",
            Refusal::ForeignVersion => "foreign_version",
            Refusal::Malformed => "malformed",
        }
    }
}

#[derive(Clone, PartialEq, prost::Message)]
struct Envelope {
    #[prost(uint32, tag = "1")]
    v: u32,
    #[prost(string, tag = "2")]
    peer: String,
    #[prost(uint64, tag = "3")]
    epoch: u64,
    #[prost(uint64, tag = "4")]
    seq: u64,
    #[prost(oneof = "WireFact", tags = "5, 6, 7, 8, 9")]
    fact: Option<WireFact>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum WireFact {
    #[prost(message, tag = "5")]
    Routed(Routed),
    #[prost(uint64, tag = "6")]
    PrefillEnded(u64),
    #[prost(uint64, tag = "7")]
    Released(u64),
    #[prost(message, tag = "8")]
    Heartbeat(Empty),
    #[prost(message, tag = "9")]
    Leave(Empty),
}

#[derive(Clone, PartialEq, prost::Message)]
struct Routed {
    #[prost(uint64, tag = "1")]
    route: u64,
    #[prost(string, tag = "2")]
    tenant: String,
    #[prost(string, tag = "3")]
    model: String,
    #[prost(string, tag = "4")]
    hash_scheme: String,
    #[prost(string, tag = "5")]
    replica: String,
    #[prost(uint64, tag = "6")]
    uncached_tokens: u64,
    #[prost(fixed64, repeated, tag = "7")]
    pending: Vec<u64>,
    #[prost(uint64, tag = "8")]
    prompt_tokens: u64,
    #[prost(sint64, tag = "9")]
    priority: i64,
    #[prost(bool, tag = "10")]
    held: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Empty {}

/// Only the version; every other field is skipped, whatever its type, so a
/// future format's other changes are reported as a foreign version.
#[derive(Clone, PartialEq, prost::Message)]
struct VersionOnly {
    #[prost(uint32, tag = "1")]
    v: u32,
}

/// The bytes of `msg`.
pub fn encode(msg: &Message) -> Vec<u8> {
    let fact = match &msg.fact {
        Fact::Routed {
            route,
            scope,
            replica,
            uncached_tokens,
            prompt_tokens,
            priority,
            held,
            pending,
        } => WireFact::Routed(Routed {
            route: *route,
            tenant: scope.tenant.to_string(),
            model: scope.model.to_string(),
            hash_scheme: scope.hash_scheme.to_string(),
            replica: replica.clone(),
            uncached_tokens: *uncached_tokens,
            pending: pending.clone(),
            prompt_tokens: *prompt_tokens,
            priority: *priority,
            held: *held,
        }),
        Fact::PrefillEnded { route } => WireFact::PrefillEnded(*route),
        Fact::Released { route } => WireFact::Released(*route),
        Fact::Heartbeat => WireFact::Heartbeat(Empty {}),
        Fact::Leave => WireFact::Leave(Empty {}),
    };
    Envelope {
        v: VERSION,
        peer: msg.peer.clone(),
        epoch: msg.epoch,
        seq: msg.seq,
        fact: Some(fact),
    }
    .encode_to_vec()
}

/// The message in `bytes`, or why it is refused.
pub fn decode(bytes: &[u8]) -> Result<Message, Refusal> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(Refusal::Oversized);
    }
    // The JSON format of earlier sidecars (version 1) starts with a brace,
    // which no protobuf message of ours does (it would be field 15, a group).
    if bytes.first() == Some(&b'{') {
        return Err(Refusal::ForeignVersion);
    }
    check_version(bytes, MAX_MESSAGE_BYTES)?;
    let e = Envelope::decode(bytes).map_err(|_| Refusal::Malformed)?;
    let fact = match e.fact.ok_or(Refusal::Malformed)? {
        WireFact::Routed(r) => {
            for id in [&r.tenant, &r.model, &r.hash_scheme, &r.replica] {
                check_id(id)?;
            }
            if r.pending.len() > MAX_SHARED_PENDING {
                return Err(Refusal::Malformed);
            }
            Fact::Routed {
                route: r.route,
                scope: ScopeRef::new(&r.tenant, &r.model, &r.hash_scheme).to_owned(),
                replica: r.replica,
                uncached_tokens: r.uncached_tokens,
                prompt_tokens: r.prompt_tokens,
                priority: r.priority,
                held: r.held,
                pending: r.pending,
            }
        }
        WireFact::PrefillEnded(route) => Fact::PrefillEnded { route },
        WireFact::Released(route) => Fact::Released { route },
        WireFact::Heartbeat(Empty {}) => Fact::Heartbeat,
        WireFact::Leave(Empty {}) => Fact::Leave,
    };
    check_id(&e.peer)?;
    Ok(Message {
        peer: e.peer,
        epoch: e.epoch,
        seq: e.seq,
        fact,
    })
}

/// Checks the size, then the version, before anything else is read (the KV
/// event stream's messages too). An absent version (0) is not a format:
/// garbage, or an empty body.
pub(super) fn check_version(bytes: &[u8], limit: usize) -> Result<(), Refusal> {
    if bytes.len() > limit {
        return Err(Refusal::Oversized);
    }
    match VersionOnly::decode(bytes) {
        Ok(VersionOnly { v: 0 }) | Err(_) => Err(Refusal::Malformed),
        Ok(VersionOnly { v }) if v != VERSION => Err(Refusal::ForeignVersion),
        Ok(_) => Ok(()),
    }
}

/// An id must be non-empty and at most [`MAX_ID_BYTES`].
pub(super) fn check_id(id: &str) -> Result<(), Refusal> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        Err(Refusal::Malformed)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
