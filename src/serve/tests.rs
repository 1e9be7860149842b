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

#[test]
fn the_lease_duration_is_whole_seconds_of_at_least_three() {
    let cli = Cli::try_parse_from(["x", "--kubernetes"]).unwrap();
    assert_eq!(cli.serve.lease_duration, LeaseConfig::DEFAULT_DURATION);
    let cli = Cli::try_parse_from(["x", "--kubernetes", "--lease-duration", "1m"]).unwrap();
    assert_eq!(cli.serve.lease_duration, Duration::from_secs(60));
    for bad in ["2s", "3500ms", "soon"] {
        let Err(e) = Cli::try_parse_from(["x", "--kubernetes", "--lease-duration", bad]) else {
            panic!("--lease-duration {bad} accepted");
        };
        assert!(e.to_string().contains("--lease-duration"), "{e}");
    }
}

#[tokio::test]
async fn neither_source_is_a_clear_error() {
    let cli = Cli::try_parse_from(["x"]).unwrap();
    let e = run(cli.serve).await.unwrap_err().to_string();
    assert!(e.contains("--config") && e.contains("--kubernetes"), "{e}");
}
