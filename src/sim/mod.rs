//! A simulated engine fleet and the routing-quality benchmark (issue 6).
//!
//! Not on the router's serving path: nothing in [`crate::core`] or the adapters
//! depends on it. A simulated engine is an HTTP completions server over token
//! ids that keeps a vLLM-like prefix KV cache and publishes real-format vLLM KV
//! events, so the router can be measured against engines whose caches are known
//! exactly.
//!
//! ```text
//!  engine (HTTP, cost model) ──admit──▶ cache (blocks, LRU) ──Admission──▶
//!  events (msgpack, ZMQ PUB + replay) ──▶ the router's KV event subscriber
//! ```

pub mod cache;
pub mod engine;
pub mod events;
