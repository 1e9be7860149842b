//! A simulated engine fleet and the routing-quality benchmark.
//!
//! Not on the router's serving path: nothing in the core or the product crate
//! depends on it, and the `inferencecache` binary carries none of it. A simulated engine is an HTTP completions server over token
//! ids that keeps a vLLM-like prefix KV cache and publishes real-format vLLM KV
//! events, so the router can be measured against engines whose caches are known
//! exactly. The benchmark plays seeded workloads through one Envoy with each
//! router under comparison and reports hit rate, TTFT, throughput and balance.
//!
//! ```text
//!  engine (HTTP, cost model) ──admit──▶ cache (blocks, LRU) ──Admission──▶
//!  events (msgpack, ZMQ PUB + replay) ──▶ the router's KV event subscriber
//!
//!  bench: workload ─▶ drive ─▶ Envoy (a listener per router) ─▶ engines
//!         report (table) + chart (SVG)
//! ```
#![forbid(unsafe_code)]

pub mod bench;
pub mod cache;
pub mod capacity;
pub mod chart;
pub mod drive;
pub mod engine;
pub mod envoy;
pub mod events;
pub mod http;
pub mod process;
pub mod report;
pub mod router;
pub mod text;
pub mod workload;
