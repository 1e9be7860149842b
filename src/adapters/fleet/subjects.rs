//! The NATS subjects of one fleet: every sidecar publishes its routing facts on
//! `<fleet-name>.routes.<fleet-id>` and reads `<fleet-name>.routes.*`; engine
//! KV events travel on `<fleet-name>.kv.<engine token>`, kept by the stream
//! `<fleet-name>-kv`; relay leases live in the KV bucket `<fleet-name>-leases`
//! and index snapshots in the object store `<fleet-name>-index`.
//!
//! The fleet name namespaces everything, so two fleets can share one NATS. A
//! fleet id is one subject token, so the subject names the publisher: a message
//! whose body claims another peer than its subject is refused (a sidecar allowed
//! to publish on its own subject only cannot speak for another).

/// The longest fleet name or id accepted.
pub const MAX_TOKEN_BYTES: usize = 128;

/// Why a fleet name or id is refused.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("empty")]
    Empty,
    #[error("longer than {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    #[error("{0:?} is not allowed (letters, digits, '-' and '_' only)")]
    Char(char),
}

/// Checks that `s` is one subject token of the allowed alphabet.
pub fn check_token(s: &str) -> Result<(), TokenError> {
    if s.is_empty() {
        return Err(TokenError::Empty);
    }
    if s.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::TooLong);
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        Some(c) => Err(TokenError::Char(c)),
        None => Ok(()),
    }
}

/// A host or pod name made into a fleet id: characters outside the alphabet
/// (a domain's dots) become '_', and it is cut to [`MAX_TOKEN_BYTES`].
pub fn token_from(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(MAX_TOKEN_BYTES)
        .collect()
}

/// The subjects of the fleet `name`.
#[derive(Clone, Debug)]
pub struct Subjects {
    name: String,
}

impl Subjects {
    /// `name` must pass [`check_token`].
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
        }
    }

    /// Where the sidecar `id` publishes its routing facts.
    pub fn routes_of(&self, id: &str) -> String {
        format!("{}.routes.{id}", self.name)
    }

    /// Every sidecar's routing facts.
    pub fn all_routes(&self) -> String {
        format!("{}.routes.*", self.name)
    }

    /// Where an engine's KV events are published.
    pub fn kv_of(&self, engine_token: &str) -> String {
        format!("{}.kv.{engine_token}", self.name)
    }

    /// Every engine's KV events.
    pub fn all_kv(&self) -> String {
        format!("{}.kv.*", self.name)
    }

    /// The engine token a KV subject names, if it is one of this fleet's.
    pub fn engine_of<'s>(&self, subject: &'s str) -> Option<&'s str> {
        let token = subject
            .strip_prefix(self.name.as_str())?
            .strip_prefix(".kv.")?;
        check_token(token).ok().map(|()| token)
    }

    /// The JetStream stream keeping the engines' KV events.
    pub fn kv_stream(&self) -> String {
        format!("{}-kv", self.name)
    }

    /// The KV bucket of the relay leases.
    pub fn lease_bucket(&self) -> String {
        format!("{}-leases", self.name)
    }

    /// The object store of the index snapshots.
    pub fn snapshot_bucket(&self) -> String {
        format!("{}-index", self.name)
    }

    /// The publisher a routing-fact subject names, if it is one of this fleet's.
    pub fn peer_of<'s>(&self, subject: &'s str) -> Option<&'s str> {
        let peer = subject
            .strip_prefix(self.name.as_str())?
            .strip_prefix(".routes.")?;
        check_token(peer).ok().map(|()| peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_name_the_fleet_and_the_publisher() {
        let s = Subjects::new("inferencecache");
        assert_eq!(s.routes_of("pod-1"), "inferencecache.routes.pod-1");
        assert_eq!(s.all_routes(), "inferencecache.routes.*");
        assert_eq!(s.peer_of("inferencecache.routes.pod-1"), Some("pod-1"));
        assert_eq!(s.peer_of("other.routes.pod-1"), None);
        assert_eq!(s.peer_of("inferencecache.routes."), None);
        assert_eq!(s.peer_of("inferencecache.routes.a.b"), None);
        assert_eq!(s.peer_of("inferencecache.events.pod-1"), None);
        assert_eq!(s.kv_of("00ff"), "inferencecache.kv.00ff");
        assert_eq!(s.all_kv(), "inferencecache.kv.*");
        assert_eq!(s.engine_of("inferencecache.kv.00ff"), Some("00ff"));
        assert_eq!(s.engine_of("inferencecache.routes.00ff"), None);
        assert_eq!(s.engine_of("inferencecache.kv.a.b"), None);
        assert_eq!(s.kv_stream(), "inferencecache-kv");
        assert_eq!(s.lease_bucket(), "inferencecache-leases");
        assert_eq!(s.snapshot_bucket(), "inferencecache-index");
        // A fleet whose name is a prefix of another's does not read it.
        assert_eq!(Subjects::new("ic").peer_of("ic2.routes.pod-1"), None);
    }

    #[test]
    fn tokens_are_checked_and_host_names_made_into_tokens() {
        assert_eq!(check_token("pod-7_a"), Ok(()));
        assert_eq!(check_token(""), Err(TokenError::Empty));
        assert_eq!(check_token("a.b"), Err(TokenError::Char('.')));
        assert_eq!(check_token("a*"), Err(TokenError::Char('*')));
        assert_eq!(check_token("a>"), Err(TokenError::Char('>')));
        assert_eq!(check_token("a b"), Err(TokenError::Char(' ')));
        assert_eq!(
            check_token(&"x".repeat(MAX_TOKEN_BYTES + 1)),
            Err(TokenError::TooLong)
        );
        assert_eq!(token_from("node-1.example.com"), "node-1_example_com");
        assert_eq!(check_token(&token_from("héllo.world")), Ok(()));
        assert_eq!(token_from(&"y".repeat(300)).len(), MAX_TOKEN_BYTES);
    }
}
