//! A simulated engine fleet and the routing-quality benchmark (issue 6).
//!
//! Not on the router's serving path: these modules prove what the router is worth.
//! The engines model a prefix KV cache and prefill/decode costs and publish real
//! vLLM KV events; the benchmark plays seeded workloads through Envoy with each
//! router under comparison and reports hit rate, TTFT, throughput and balance.
//!
//! ```text
//!  engine (HTTP, cost model) ──admit──▶ cache (blocks, LRU) ──Admission──▶
//!  events (msgpack, ZMQ PUB + replay) ──▶ the router's KV event subscriber
//! ```

pub mod cache;
pub mod chart;
pub mod drive;
pub mod engine;
pub mod envoy;
pub mod events;
pub mod http;
pub mod process;
pub mod report;
pub mod router;
pub mod workload;
