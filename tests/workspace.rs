//! The workspace boundaries, checked from the manifests: the core crate can import
//! no I/O, serving or Kubernetes crate, and the product carries no simulator.

use std::path::Path;

/// The crate names in one `[section]` of a Cargo.toml (`name = ...` or `name.workspace`).
fn section_crates(manifest: &str, section: &str) -> Vec<String> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(manifest))
        .unwrap_or_else(|e| panic!("reading {manifest}: {e}"));
    let header = format!("[{section}]");
    let mut inside = false;
    let mut names = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == header;
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name = line
            .split(['=', '.'])
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        names.push(name);
    }
    assert!(!names.is_empty(), "{manifest} has no [{section}] entries");
    names
}

#[test]
fn the_core_crate_depends_on_nothing_that_does_io_or_serving() {
    let deps = section_crates("crates/core/Cargo.toml", "dependencies");
    let forbidden = [
        "tokio",
        "tonic",
        "prost",
        "kube",
        "k8s-openapi",
        "axum",
        "hyper",
        "envoy-types",
        "zeromq",
        "serde_json",
        "tracing",
        "inferencecache",
    ];
    for d in &deps {
        assert!(
            !forbidden
                .iter()
                .any(|f| d == f || d.starts_with(&format!("{f}-"))),
            "crates/core depends on {d}: the core must stay free of I/O and serving crates"
        );
    }
}

#[test]
fn the_product_does_not_depend_on_the_simulator() {
    let deps = section_crates("Cargo.toml", "dependencies");
    for sim_only in ["inferencecache-sim", "plotters", "rand", "rand_xorshift"] {
        assert!(
            !deps.iter().any(|d| d == sim_only),
            "the product crate depends on {sim_only}, which belongs to crates/sim"
        );
    }
    assert!(deps.iter().any(|d| d == "inferencecache-core"));
}
