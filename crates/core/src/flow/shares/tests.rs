use super::*;

const T0: Timestamp = Timestamp(1_000_000_000_000);

fn at_ms(ms: u64) -> Timestamp {
    Timestamp(T0.0 + ms * 1_000_000)
}

#[test]
fn a_tenant_alone_or_beside_tenants_that_get_what_they_ask_is_never_over() {
    let mut s = Shares::new();
    for i in 0..1000 {
        assert!(!s.over_share("a", 1, at_ms(i)));
        s.served("a", 1, 100, at_ms(i));
    }
    // b is served little but was never shed: a is not held back for it.
    s.served("b", 3, 100, at_ms(1000));
    assert!(!s.over_share("a", 1, at_ms(1000)));
}

#[test]
fn a_tenant_ahead_of_a_shed_tenant_per_weight_is_over_its_share() {
    let mut s = Shares::new();
    s.served("light", 1, 1000, at_ms(0));
    s.served("heavy", 3, 2400, at_ms(0));
    s.shed("heavy", 3, at_ms(1));
    // light: 1000 per weight against heavy's 800 × 1.1: over.
    assert!(s.over_share("light", 1, at_ms(2)));
    // Once heavy is served about 3 × as much, light may go again.
    s.served("heavy", 3, 500, at_ms(3));
    assert!(!s.over_share("light", 1, at_ms(4)));
    // heavy is never over beside light, which was not shed.
    assert!(!s.over_share("heavy", 3, at_ms(4)));
}

#[test]
fn service_and_sheds_older_than_the_window_are_forgotten() {
    let mut s = Shares::new();
    s.served("light", 1, 5000, at_ms(0));
    s.shed("heavy", 3, at_ms(0));
    assert!(s.over_share("light", 1, at_ms(10)));
    // Past the window the shed no longer says heavy wants more.
    let later = at_ms(WINDOW.as_millis() as u64 + 1);
    assert!(!s.over_share("light", 1, later));
    assert!(s.forget_idle(later));
}

#[test]
fn flooding_tenants_share_by_weight() {
    // Two tenants each ask 4 requests a tick; the replicas take 4 a tick. A
    // newcomer over its share is shed; otherwise it is served while room lasts,
    // in arrival order alternating between the tenants (no queue at all), and a
    // request finding no room is shed. Service comes out 1:3.
    let mut s = Shares::new();
    let mut served: HashMap<&str, u64> = HashMap::new();
    for tick in 0..20_000u64 {
        let now = Timestamp(T0.0 + tick * 1_000_000);
        let mut room = 4;
        for k in 0..8 {
            let (tenant, weight) = if k % 2 == 0 {
                ("light", 1)
            } else {
                ("heavy", 3)
            };
            if s.over_share(tenant, weight, now) || room == 0 {
                s.shed(tenant, weight, now);
                continue;
            }
            room -= 1;
            s.served(tenant, weight, 100, now);
            *served.entry(tenant).or_default() += 1;
        }
    }
    let ratio = served["heavy"] as f64 / served["light"] as f64;
    assert!((2.7..=3.3).contains(&ratio), "{served:?}");
    // Every tick's room was used.
    assert_eq!(served.values().sum::<u64>(), 4 * 20_000, "{served:?}");
}
