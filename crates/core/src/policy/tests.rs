use super::*;

#[test]
fn defaults_match_contract_section_5() {
    let p = ResolvedPolicy::default();
    assert_eq!(p.eviction, EvictionAlgorithm::Lru);
    assert_eq!(p.eviction_ttl, Duration::from_secs(600));
    assert_eq!(p.minimum_prefix_tokens, 0);
    assert_eq!(p.minimum_matched_tokens, 64);
    assert_eq!(p.routing_floor_score.value(), 0.1);
    assert_eq!(p.lookup_timeout, Duration::ZERO);
    assert!(p.strategy.enable_chain_matching);
    assert!(!p.strategy.require_chain);
    assert!(p.strategy.enable_tenant_hot);
    assert_eq!(p.affinity_routing, AffinityRouting::Enabled);
    assert!(p.validate().is_ok());
}

#[test]
fn floor_score_accepts_non_negative_decimals_only() {
    for ok in ["0", "0.1", "5", "10.25", "007", "0.000"] {
        assert!(ok.parse::<FloorScore>().is_ok(), "{ok} should parse");
    }
    assert_eq!("5".parse::<FloorScore>().map(|f| f.value()), Ok(5.0));
    for bad in [
        "", "-1", "-0.1", "1e3", ".5", "5.", "1.2.3", " 1", "1 ", "NaN", "inf", "+1", "0x1", "1,5",
    ] {
        assert_eq!(
            bad.parse::<FloorScore>(),
            Err(PolicyError::FloorScore(bad.to_string())),
            "{bad:?} should be rejected"
        );
    }
}

#[test]
fn durations_parse_go_style() {
    assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
    assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
    assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
    assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
    assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
    for bad in ["", "10", "m", "10x", "1h-3m", "-5s", "10 m", "h1"] {
        assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
    }
}

#[test]
fn durations_format_round_trip() {
    for s in ["10m", "1h30m", "90s", "1h", "2h0m5s"] {
        let d = parse_duration(s).unwrap_or_default();
        assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{s}");
    }
    assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
}

#[test]
fn require_chain_without_matching_is_invalid() {
    let mut p = ResolvedPolicy::default();
    p.strategy.require_chain = true;
    p.strategy.enable_chain_matching = false;
    assert_eq!(p.validate(), Err(PolicyError::RequireChainWithoutMatching));
}

#[test]
fn zero_ttl_is_invalid() {
    let p = ResolvedPolicy {
        eviction_ttl: Duration::ZERO,
        ..ResolvedPolicy::default()
    };
    assert_eq!(p.validate(), Err(PolicyError::ZeroTtl));
}

#[test]
fn load_awareness_is_on_by_default_with_a_bound_that_always_admits_someone() {
    let p = ResolvedPolicy::default();
    assert_eq!(p.load_awareness, LoadAwareness::Enabled);
    assert!(p.load_balancing.factor >= 1.0);
    assert_eq!(
        LoadBalancing::parse_factor(LoadBalancing::DEFAULT_FACTOR_STR),
        Ok(p.load_balancing.factor)
    );
}

#[test]
fn load_factor_must_be_a_decimal_of_at_least_one() {
    assert_eq!(LoadBalancing::parse_factor("1"), Ok(1.0));
    assert_eq!(LoadBalancing::parse_factor("2.5"), Ok(2.5));
    for bad in ["0.99", "0", "-1", "1e2", "", "fast"] {
        assert_eq!(
            LoadBalancing::parse_factor(bad),
            Err(PolicyError::LoadFactor(bad.to_string())),
            "{bad:?}"
        );
    }
    assert_eq!("Disabled".parse(), Ok(LoadAwareness::Disabled));
    assert!("off".parse::<LoadAwareness>().is_err());
}

#[test]
fn share_factor_is_zero_for_off_or_a_decimal_of_at_least_one() {
    assert_eq!(LoadBalancing::parse_share_factor("0"), Ok(0.0));
    assert_eq!(LoadBalancing::parse_share_factor("1.2"), Ok(1.2));
    assert_eq!(
        LoadBalancing::parse_share_factor(LoadBalancing::DEFAULT_SHARE_FACTOR_STR),
        Ok(LoadBalancing::default().share_factor)
    );
    for bad in ["0.5", "-1", "1e2", "", "on"] {
        assert_eq!(
            LoadBalancing::parse_share_factor(bad),
            Err(PolicyError::ShareFactor(bad.to_string())),
            "{bad:?}"
        );
    }
}

#[test]
fn eviction_is_case_insensitive() {
    assert_eq!("LFU".parse(), Ok(EvictionAlgorithm::Lfu));
    assert_eq!("lru".parse(), Ok(EvictionAlgorithm::Lru));
    assert!("fifo".parse::<EvictionAlgorithm>().is_err());
}
