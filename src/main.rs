//! The `inferencecache` command line: parses arguments and hands over to the wiring.

use clap::{Parser, Subcommand};
use inferencecache::adapters::admission::{self, WebhookArgs};
use inferencecache::chain_command::{self, ChainArgs};
use inferencecache::crd;
use inferencecache::serve::{self, ServeArgs};
use inferencecache::tokenize_command::{self, TokenizeArgs};

/// KV-cache-aware router for LLM inference: an Envoy ext_proc sidecar.
#[derive(Parser)]
#[command(name = "inferencecache", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once at start: the size of the serve flags does not matter.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Serve ext_proc, the gRPC API and the admin HTTP endpoints.
    Serve(ServeArgs),
    /// Compute a block-hash chain from token ids on stdin (x-inferencecache-block-hashes).
    Chain(ChainArgs),
    /// Print the token ids body mode routes an OpenAI request body on (JSON).
    Tokenize(TokenizeArgs),
    /// Print the CustomResourceDefinitions as one multi-document YAML stream.
    Crds,
    /// Serve the validating admission webhook (HTTPS, AdmissionReview v1 on /validate).
    Webhook(WebhookArgs),
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
        Command::Serve(args) => serve::run(args).await,
        Command::Chain(args) => {
            chain_command::run(&args, std::io::stdin().lock(), std::io::stdout().lock())
        }
        Command::Tokenize(args) => tokenize_command::run(&args, std::io::stdout().lock()),
        Command::Crds => {
            print!("{}", crd::render_yaml()?);
            Ok(())
        }
        Command::Webhook(args) => admission::run(args).await,
    }
}
