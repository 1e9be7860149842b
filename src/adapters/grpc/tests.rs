use super::*;

#[test]
fn reason_codes_keep_their_contract_names() {
    for r in ReasonCode::ALL {
        assert_eq!(reason_code(r).as_str_name(), r.as_str());
    }
    assert_eq!(pb::ReasonCode::PolicyRequiresChain as i32, 9);
    assert_eq!(strategy(Strategy::Affinity) as i32, 3);
}

fn stored(hashes: Vec<u64>) -> pb::KvEvent {
    pb::KvEvent {
        event: Some(pb::kv_event::Event::Stored(pb::BlocksStored {
            parent_block_hash: Some(7),
            block_hashes: hashes,
            block_token_counts: vec![],
        })),
    }
}

#[test]
fn events_convert_in_order_and_refuse_empty_or_huge_ones() {
    let events = vec![
        stored(vec![1, 2]),
        pb::KvEvent { event: None },
        stored(vec![0; MAX_CHAIN_BLOCKS + 1]),
        pb::KvEvent {
            event: Some(pb::kv_event::Event::Cleared(pb::AllBlocksCleared {})),
        },
        pb::KvEvent {
            event: Some(pb::kv_event::Event::PrefixStored(pb::PrefixStored {
                prefix_hash: "p".into(),
                token_count: 32,
            })),
        },
    ];
    let (out, refused) = index_events(events);
    assert_eq!(refused, 2);
    assert_eq!(
        out,
        vec![
            IndexEvent::Stored {
                parent: Some(7),
                hashes: vec![1, 2],
                token_counts: vec![]
            },
            IndexEvent::Cleared,
            IndexEvent::PrefixStored {
                prefix_hash: "p".into(),
                token_count: 32
            },
        ]
    );
}

#[test]
fn stats_ratios_are_checked() {
    assert!(replica_stats(None).is_err());
    let ok = pb::ReplicaStats {
        hit_rate: 0.5,
        kv_cache_usage: 1.0,
        waiting_requests: 3,
        ..Default::default()
    };
    assert_eq!(
        replica_stats(Some(&ok)).map(|s| s.waiting_requests).ok(),
        Some(3)
    );
    for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
        let s = pb::ReplicaStats {
            hit_rate: bad,
            ..Default::default()
        };
        let err = replica_stats(Some(&s))
            .err()
            .map(|e| e.message().to_string());
        assert!(err.is_some_and(|m| m.contains("hit_rate")), "{bad}");
    }
}

#[test]
fn oversized_lookups_are_refused_with_a_message() {
    let req = pb::LookupRouteRequest {
        block_hashes: vec![1; MAX_CHAIN_BLOCKS + 1],
        ..Default::default()
    };
    let err = check_lookup_limits(&req).err();
    assert_eq!(
        err.as_ref().map(Status::code),
        Some(tonic::Code::InvalidArgument)
    );
    let req = pb::LookupRouteRequest {
        candidate_replicas: vec![String::new(); MAX_CANDIDATES + 1],
        ..Default::default()
    };
    assert!(check_lookup_limits(&req).is_err());
    assert!(check_lookup_limits(&pb::LookupRouteRequest::default()).is_ok());
}
