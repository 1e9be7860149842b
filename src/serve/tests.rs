use clap::Parser;

use super::*;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[test]
fn kubernetes_mode_needs_no_config_and_accepts_one() {
    let cli = Cli::try_parse_from(["x", "--kubernetes", "--lease-name", "l"]).unwrap();
    assert!(cli.serve.kubernetes && cli.serve.config.is_none());
    assert_eq!(cli.serve.lease_name, "l");
    // The CRDs "instead of / as well as" a file.
    let both = Cli::try_parse_from(["x", "--kubernetes", "--config", "p.yaml"]).unwrap();
    assert!(both.serve.kubernetes && both.serve.config.is_some());
}

#[tokio::test]
async fn neither_source_is_a_clear_error() {
    let cli = Cli::try_parse_from(["x"]).unwrap();
    let e = run(cli.serve).await.unwrap_err().to_string();
    assert!(e.contains("--config") && e.contains("--kubernetes"), "{e}");
}
