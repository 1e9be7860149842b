//! `inferencecache-sim`: simulated engines and the routing-quality benchmark. Not
//! part of the product: the `inferencecache` binary carries none of this.

use clap::{Parser, Subcommand};
use inferencecache_sim::bench::{self, BenchArgs};
use inferencecache_sim::engine::{self as sim_engine, EngineArgs};

/// Simulated inference engines and the routing benchmark for inferencecache.
#[derive(Parser)]
#[command(name = "inferencecache-sim", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one simulated inference engine (prefix KV cache, vLLM KV events, cost
    /// model) for the routing benchmark; prints its bound addresses as JSON.
    SimEngine(EngineArgs),
    /// Compare routers (round-robin, random, least-request, inferencecache, an oracle)
    /// on simulated engines through a real Envoy: hit rate, TTFT, throughput, balance.
    BenchRouting(BenchArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::SimEngine(args) => sim_engine::run(args).await,
        Command::BenchRouting(args) => bench::run(args).await,
    }
}
