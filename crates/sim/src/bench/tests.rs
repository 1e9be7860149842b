use super::*;

#[test]
fn external_engine_specs_parse_or_say_what_is_expected() {
    let e = parse_external("a=http://10.0.0.5:8000,tcp://10.0.0.5:5557").unwrap();
    assert_eq!(
        (e.id.as_str(), e.http.port(), e.events.as_str()),
        ("a", 8000, "tcp://10.0.0.5:5557")
    );
    for bad in [
        "a",
        "a=http://x:1",
        "=http://1.2.3.4:1,tcp://1.2.3.4:2",
        "a=1.2.3.4:1,tcp://x:2",
        "a=http://1.2.3.4:1,udp://x",
    ] {
        let err = parse_external(bad).unwrap_err().to_string();
        assert!(err.contains("expected ID="), "{bad}: {err}");
    }
}

#[test]
fn a_trace_is_one_json_line_per_request_in_arrival_order() {
    let sample = |at_ms: f64, replica: &str, spilled_from: Option<&str>| crate::drive::Sample {
        at_ms,
        ttft_ms: 10.0,
        latency_ms: 20.0,
        prompt_tokens: 100,
        cached_tokens: 64,
        replica: replica.into(),
        reason: Some("PREFIX_MATCH".into()),
        predicted_cached: Some(64),
        spilled_from: spilled_from.map(str::to_string),
        spilled_by: spilled_from.map(|_| "share".to_string()),
        family: 3,
        tenant: 0,
        priority: 0,
        queued_ms: 0.0,
    };
    let dir = std::env::temp_dir().join(format!("ic-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Samples come back in completion order; the trace is in arrival order.
    let samples = [
        sample(5.0, "engine-1", Some("engine-0")),
        sample(1.0, "engine-0", None),
    ];
    write_trace(&dir, "rag", Router::InferenceCache, &samples).unwrap();
    let text = std::fs::read_to_string(dir.join("trace-rag-inferencecache.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["at_ms"], 1.0);
    assert_eq!(lines[0]["spilled_from"], serde_json::Value::Null);
    assert_eq!(lines[1]["replica"], "engine-1");
    assert_eq!(lines[1]["spilled_from"], "engine-0");
    assert_eq!(lines[1]["spilled_by"], "share");
    assert_eq!(lines[1]["cached_tokens"], 64);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_policy_file_names_every_engine_and_parses() {
    let engines = vec![
        Engine {
            id: "engine-0".into(),
            http: "127.0.0.1:1".parse().unwrap(),
            events: "tcp://127.0.0.1:2".into(),
            simulated: true,
        },
        Engine {
            id: "engine-1".into(),
            http: "127.0.0.1:3".parse().unwrap(),
            events: "tcp://127.0.0.1:4".into(),
            simulated: true,
        },
    ];
    let yaml = policy_yaml(
        &engines,
        &tenants(&Router::ALL),
        1,
        &flow_policy_spec(None, None),
        None,
        None,
        None,
    )
    .unwrap();
    let source = inferencecache::adapters::policy_file::Source {
        path: "policy.yaml".into(),
        text: yaml.clone(),
    };
    let loaded = inferencecache::adapters::policy_file::parse(&[source]);
    assert!(loaded.is_ok(), "{yaml}\n{:?}", loaded.err());
    let loaded = loaded.unwrap();
    assert_eq!(loaded.snapshot.backends().len(), 2, "{yaml}");
    let hot = |t: &str| loaded.snapshot.tenant(t).policy.strategy.enable_tenant_hot;
    assert!(hot("bench"));
    assert!(!hot("bench-tuned"));
    assert_eq!(
        loaded
            .snapshot
            .tenant("bench-tuned")
            .policy
            .minimum_matched_tokens,
        320
    );
    assert_eq!(
        loaded.snapshot.namespace_of("bench-tuned"),
        Some("bench-tuned")
    );
    assert!(yaml.contains("kvEventsEndpoint: \"tcp://127.0.0.1:4\""));
    assert!(yaml.contains("enableTenantHot: false"));
    assert!(!yaml.contains("metrics:"), "the server's default interval");

    // `--scrape-interval` sets every backend's `spec.metrics.interval`.
    let tenants = tenants(&Router::ALL);
    let yaml = policy_yaml(
        &engines,
        &tenants,
        1,
        &flow_policy_spec(None, None),
        None,
        None,
        Some("250ms"),
    )
    .unwrap();
    let source = inferencecache::adapters::policy_file::Source {
        path: "policy.yaml".into(),
        text: yaml.clone(),
    };
    let loaded = inferencecache::adapters::policy_file::parse(&[source]);
    assert!(loaded.is_ok(), "{yaml}\n{:?}", loaded.err());
    let set = yaml.matches("  metrics: { interval: \"250ms\" }\n").count();
    assert_eq!(set, tenants.len(), "{yaml}");
}

#[test]
fn several_tenants_get_a_namespace_each_with_their_weight_and_the_flow_row_its_policy() {
    let engines = vec![Engine {
        id: "engine-0".into(),
        http: "127.0.0.1:1".parse().unwrap(),
        events: "tcp://127.0.0.1:2".into(),
        simulated: true,
    }];
    let routers = [Router::InferenceCache, Router::InferenceCacheFlow];
    let yaml = policy_yaml(
        &engines,
        &tenants(&routers),
        3,
        &flow_policy_spec(Some("150ms"), Some(1500)),
        None,
        None,
        None,
    )
    .unwrap();
    let source = inferencecache::adapters::policy_file::Source {
        path: "policy.yaml".into(),
        text: yaml.clone(),
    };
    let loaded = inferencecache::adapters::policy_file::parse(&[source]);
    assert!(loaded.is_ok(), "{yaml}\n{:?}", loaded.err());
    let snapshot = loaded.unwrap().snapshot;
    for router in routers {
        for (index, weight) in [(0u8, 1u32), (1, 1), (2, 3)] {
            let tenant = router.tenant_of(index);
            let view = snapshot.tenant(&tenant);
            assert_eq!(view.namespace, Some(tenant.as_str()), "{yaml}");
            assert_eq!(view.fair_weight, Some(weight), "{tenant}");
            assert_eq!(
                view.policy.flow_control.enabled,
                router == Router::InferenceCacheFlow,
                "{tenant}"
            );
            if router == Router::InferenceCacheFlow {
                assert_eq!(
                    view.policy.flow_control.max_queue_wait,
                    Duration::from_millis(150)
                );
                assert_eq!(view.policy.flow_control.max_backlog_tokens, 1500);
            }
        }
    }
    // One tenant: no isolation mode, as before.
    let yaml = policy_yaml(
        &engines,
        &tenants(&routers),
        1,
        &flow_policy_spec(None, None),
        None,
        None,
        None,
    )
    .unwrap();
    assert!(!yaml.contains("isolationMode"), "{yaml}");
}
