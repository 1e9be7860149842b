//! One routing fact on the wire: JSON, one message per fact, versioned.
//!
//! Decoding refuses, and names why (a bounded set, used as a metric label):
//! a message over [`MAX_MESSAGE_BYTES`], one whose version is not
//! [`VERSION`], and anything that does not parse or whose ids are empty or
//! longer than [`MAX_ID_BYTES`]. A refused message never reaches the ledger.
//!
//! JSON rather than a binary format: a routed fact is well under 200 bytes, the
//! sidecars already carry `serde_json`, and an operator can read the subjects
//! with `nats sub`.

use serde::{Deserialize, Serialize};

use crate::core::load::peer_ledger::{Fact, Message};
use crate::core::scope::ScopeRef;

/// The format version this sidecar writes and reads.
pub const VERSION: u32 = 1;
/// The largest message accepted.
pub const MAX_MESSAGE_BYTES: usize = 1024;
/// The longest peer, replica, tenant, model or hash scheme id accepted (a DNS
/// name's limit).
pub const MAX_ID_BYTES: usize = 253;

/// Why a message was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Refusal {
    #[error("message over {MAX_MESSAGE_BYTES} bytes")]
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

#[derive(Serialize, Deserialize)]
struct Envelope {
    v: u32,
    peer: String,
    epoch: u64,
    seq: u64,
    fact: WireFact,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case", deny_unknown_fields)]
enum WireFact {
    Routed {
        route: u64,
        /// tenant, model, hash scheme.
        scope: [String; 3],
        replica: String,
        uncached_tokens: u64,
    },
    PrefillEnded {
        route: u64,
    },
    Released {
        route: u64,
    },
    Heartbeat,
    Leave,
}

/// Only the version, read first so a future format's other changes are
/// reported as a foreign version, not as garbage.
#[derive(Deserialize)]
struct VersionOnly {
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
        } => WireFact::Routed {
            route: *route,
            scope: [
                scope.tenant.to_string(),
                scope.model.to_string(),
                scope.hash_scheme.to_string(),
            ],
            replica: replica.clone(),
            uncached_tokens: *uncached_tokens,
        },
        Fact::PrefillEnded { route } => WireFact::PrefillEnded { route: *route },
        Fact::Released { route } => WireFact::Released { route: *route },
        Fact::Heartbeat => WireFact::Heartbeat,
        Fact::Leave => WireFact::Leave,
    };
    let envelope = Envelope {
        v: VERSION,
        peer: msg.peer.clone(),
        epoch: msg.epoch,
        seq: msg.seq,
        fact,
    };
    // Serializing plain structs of strings and integers cannot fail.
    serde_json::to_vec(&envelope).unwrap_or_default()
}

/// The message in `bytes`, or why it is refused.
pub fn decode(bytes: &[u8]) -> Result<Message, Refusal> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(Refusal::Oversized);
    }
    let version: VersionOnly = serde_json::from_slice(bytes).map_err(|_| Refusal::Malformed)?;
    if version.v != VERSION {
        return Err(Refusal::ForeignVersion);
    }
    let e: Envelope = serde_json::from_slice(bytes).map_err(|_| Refusal::Malformed)?;
    let fact = match e.fact {
        WireFact::Routed {
            route,
            scope: [tenant, model, hash_scheme],
            replica,
            uncached_tokens,
        } => {
            for id in [&tenant, &model, &hash_scheme, &replica] {
                check_id(id)?;
            }
            Fact::Routed {
                route,
                scope: ScopeRef::new(&tenant, &model, &hash_scheme).to_owned(),
                replica,
                uncached_tokens,
            }
        }
        WireFact::PrefillEnded { route } => Fact::PrefillEnded { route },
        WireFact::Released { route } => Fact::Released { route },
        WireFact::Heartbeat => Fact::Heartbeat,
        WireFact::Leave => Fact::Leave,
    };
    check_id(&e.peer)?;
    Ok(Message {
        peer: e.peer,
        epoch: e.epoch,
        seq: e.seq,
        fact,
    })
}

fn check_id(id: &str) -> Result<(), Refusal> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        Err(Refusal::Malformed)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests;
