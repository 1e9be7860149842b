//! Engine KV events (vLLM, SGLang) → index events: the ZMQ subscriber adapter.
//!
//! ```text
//!  engine PUB ──[topic, seq, payload]──▶ zmtp (ZMTP 3, size-limited) ──▶
//!        subscriber (seq, warm start, replay, staleness)
//!        ──payload──▶ decode (msgpack → EngineBatch)
//!        ──EngineEvent──▶ translate (per replica, per hash scheme → IndexEvent)
//!        ──▶ Router::ingest (or, in a fleet, relay: publish once for every sidecar)
//! ```

pub mod decode;
pub mod frames;
pub mod metrics;
pub mod msgpack;
pub mod relay;
pub mod subscriber;
pub mod supervisor;
pub mod translate;
pub mod zmtp;
